"""The locally trained Qwen2.5-VL-style tokenizer: round trips, special tokens, chat template, saved files."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from guijax.models.tokenizer import (  # noqa: E402
    SPECIAL_TOKENS, TOOL_TOKENS, agent_corpus, build_tokenizer, special_token_ids)

UITARS = [
    "Thought: The Save button is at the top left.\nAction: click(start_box='<|box_start|>(123,45)<|box_end|>')",
    "Thought: I need to drag the slider.\nAction: drag(start_box='(12,34)', end_box='(560,34)')",
    "Action: type(content='héllo wörld ✓ 你好\\n')",
    "Action: hotkey(key='ctrl shift a')\n\n  finished(content='done')",
    "import pyautogui\npyautogui.click(1919, 1079)\nfor i in range(3):\n    print(i)  # tabs\tand spaces",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=1024)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def test_saved_files_load_as_qwen2(tokenizer_dir, tok):
    names = {p.name for p in tokenizer_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"} <= names
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert len(tok) == 1024
    config = json.loads((tokenizer_dir / "preprocessor_config.json").read_text())
    assert (config["min_pixels"], config["max_pixels"], config["patch_size"], config["merge_size"]) == (
        3136, 1003520, 14, 2)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)")
    assert spec["normalizer"]["type"] == "NFC" and spec["decoder"]["type"] == "ByteLevel"


@pytest.mark.parametrize("text", UITARS)
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_bpe_learned_agent_words(tok):
    """A trained vocabulary, not bytes: frequent agent words are one token, digits stay single (Qwen2 split)."""
    assert len(tok(" click")["input_ids"]) == 1 and len(tok("Thought")["input_ids"]) == 1
    assert tok.convert_ids_to_tokens(tok("1920")["input_ids"]) == ["1", "9", "2", "0"]


def test_special_tokens_are_single_ids_in_qwen_order(tok):
    added = SPECIAL_TOKENS + TOOL_TOKENS
    ids = [tok.convert_tokens_to_ids(t) for t in added]
    assert ids == list(range(1024 - len(added), 1024))  # contiguous after the BPE vocabulary, as in Qwen2.5-VL
    for token, token_id in zip(added, ids):
        assert tok(token)["input_ids"] == [token_id], token
        assert tok(f"x{token}y")["input_ids"].count(token_id) == 1, token  # never split, even inside text
    assert set(tok.all_special_tokens) == set(SPECIAL_TOKENS)  # tool/fim tokens are ordinary added tokens
    text = UITARS[0] + "<|im_end|>"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == UITARS[0].replace(
        "<|box_start|>", "").replace("<|box_end|>", "")


def test_special_token_ids(tok):
    ids = special_token_ids(tok)
    assert ids["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert ids["pad_token_id"] == ids["bos_token_id"] == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_token is None  # Qwen2.5-VL prepends nothing; config.json still names <|endoftext|> as bos
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        assert ids[key] == tok.convert_tokens_to_ids(token), key
    plain = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer.__class__.from_str(
        json.dumps({**json.loads(tok.backend_tokenizer.to_str()), "added_tokens": []})))
    with pytest.raises(ValueError, match=r"tokenizer has no <\|image_pad\|> token"):
        special_token_ids(plain)


def test_chat_template_renders_images(tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "task"}, {"type": "image"}]},
                {"role": "assistant", "content": [{"type": "text", "text": UITARS[0]}]},
                {"role": "user", "content": [{"type": "image", "image": "s.png"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    f"<|im_start|>user\ntask{pad}<|im_end|>\n"
                    f"<|im_start|>assistant\n{UITARS[0]}<|im_end|>\n"
                    f"<|im_start|>user\n{pad}<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "You are a GUI agent."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nYou are a GUI agent.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    numbered = tok.apply_chat_template(messages, tokenize=False, add_vision_id=True)
    assert f"Picture 1: {pad}" in numbered and f"Picture 2: {pad}" in numbered


def test_deterministic_and_configurable(tmp_path, tokenizer_dir):
    build_tokenizer(tmp_path / "again", vocab_size=1024)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name
    small = build_tokenizer(tmp_path / "small", vocab_size=512)
    assert len(small) == 512 and special_token_ids(small)["image_token_id"] == 512 - len(TOOL_TOKENS) - 2
    own = build_tokenizer(tmp_path / "own", vocab_size=600, corpus=["zebra zebra zebra quokka"] * 50)
    assert own.convert_ids_to_tokens(own(" zebra")["input_ids"]) == ["Ġzebra"]
    with pytest.raises(ValueError, match="vocab_size 200 too small"):
        build_tokenizer(tmp_path / "tiny", vocab_size=200)


def test_corpus_is_agent_text():
    lines = agent_corpus(num_lines=50, seed=1)
    assert lines == agent_corpus(num_lines=50, seed=1) and lines != agent_corpus(num_lines=50, seed=2)
    generated = [line for line in lines if line.startswith("Thought: ")][-50:]
    assert len(generated) == 50 and all("\nAction: " in line for line in generated)
