"""A Qwen2.5-VL-style tokenizer trained locally, for checkpoints created from scratch.

No tokenizer can be downloaded here, so fresh CPU-recipe checkpoints get a byte-level BPE trained with the
`tokenizers` library on a small generated corpus of agent text, with Qwen2.5-VL's special tokens, its
pre-tokenizer regex and its chat template. It is saved in Hugging Face format so the very same loading path
(AutoTokenizer / AutoProcessor / guijax.models.processor) serves fresh and released checkpoints.
"""
from __future__ import annotations

import json
import pathlib
import random
from typing import Iterable

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation runs, newlines, spaces).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Ordinary (non-special) added tokens of Qwen2.5, ids 151657-151664 there, right after the special ones.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>")

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PREPROCESSOR_CONFIG = {
    "processor_class": "Qwen2_5_VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3,
}

_WORDS = ("the a an to of and in on for with click button window menu file edit view save open close cancel ok "
          "apply settings dialog field text type enter name value select option list item scroll down up left "
          "right drag slider check box checkbox toggle tab press key hotkey ctrl shift alt task done finished "
          "wait screen icon panel bar title search submit next back home page document sheet cell row column "
          "font bold size color red green blue new delete rename copy paste undo redo I need the first then "
          "now should will is are this that it see notice task completed successfully popup banner dismiss "
          "account email password username message send reply form volume brightness dark mode theme").split()
_KEYS = ("enter", "tab", "esc", "ctrl a", "ctrl s", "ctrl c", "ctrl v", "alt f4", "ctrl shift a", "backspace")


def agent_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """UI-TARS-style thoughts and actions with random words and coordinates: what the policy writes."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def point() -> str:
        return f"({rng.randint(0, 1920)},{rng.randint(0, 1080)})"

    lines = list(_fixed_texts())
    for _ in range(num_lines):
        kind = rng.randrange(8)
        thought = f"Thought: {words(rng.randint(4, 14)).capitalize()}."
        if kind == 0:
            action = f"click(start_box='<|box_start|>{point()}<|box_end|>')"
        elif kind == 1:
            action = f"drag(start_box='<|box_start|>{point()}<|box_end|>', end_box='<|box_start|>{point()}<|box_end|>')"
        elif kind == 2:
            action = f"type(content='{words(rng.randint(1, 4))}\\n')"
        elif kind == 3:
            action = f"hotkey(key='{rng.choice(_KEYS)}')"
        elif kind == 4:
            action = (f"scroll(start_box='<|box_start|>{point()}<|box_end|>', "
                      f"direction='{rng.choice(['up', 'down', 'left', 'right'])}')")
        elif kind == 5:
            action = f"finished(content='{words(3)}')"
        elif kind == 6:
            action = f"left_double(start_box='<|box_start|>{point()}<|box_end|>')"
        else:
            action = f"import pyautogui; pyautogui.click({rng.randint(0, 1920)}, {rng.randint(0, 1080)})"
        lines.append(f"{thought}\nAction: {action}")
    return lines


def _fixed_texts() -> list[str]:
    """Text every CPU-recipe prompt contains (system prompts, desk vocabulary), so the BPE learns it as whole
    words: shorter sequences are the cheapest speed-up on CPU."""
    from guijax.rollout.prompt import COMPACT_PROMPT, SYSTEM_PROMPT

    texts = [SYSTEM_PROMPT] * 20 + [COMPACT_PROMPT] * 20
    try:
        from envs.desk import families

        vocab = [*families.BUTTONS, *families.CHECKS, *families.FIELDS, *families.SLIDERS, *families.WORDS,
                 *families.FILE_STEMS, *families.DROPDOWNS, *[o for v in families.DROPDOWNS.values() for o in v]]
        texts += [" ".join(vocab)] * 20
    except ImportError:  # envs not installed beside guijax
        pass
    return texts


def build_tokenizer(out_dir: str | pathlib.Path, *, vocab_size: int = 1024, corpus: Iterable[str] | None = None):
    """Train, save (tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json) and
    return the transformers tokenizer. `vocab_size` bounds the total including special tokens; the model's
    embedding may be larger (unused rows), as in the released Qwen2.5-VL checkpoints."""
    from transformers import PreTrainedTokenizerFast

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size < 256 + added + 16:
        raise ValueError(f"vocab_size {vocab_size} too small: byte-level BPE needs 256 bytes + {added} added tokens")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(list(corpus) if corpus is not None else agent_corpus(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None, model_max_length=32768,
                                   extra_special_tokens=list(SPECIAL_TOKENS[1:]),
                                   clean_up_tokenization_spaces=False, split_special_tokens=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["processor_class"] = "Qwen2_5_VLProcessor"
    config["errors"] = "replace"
    config["add_prefix_space"] = False
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out_dir)


def special_token_ids(tokenizer) -> dict[str, int]:
    """The ids a Qwen2.5-VL config.json needs, read from the tokenizer (bos is <|endoftext|> as in Qwen)."""
    ids = {}
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                       ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"),
                       ("pad_token_id", "<|endoftext|>")):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {token} token")
        ids[key] = int(token_id)
    return ids
