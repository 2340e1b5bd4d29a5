"""numpy processor and local tokenizer against transformers' Qwen2.5-VL processor (PIL backend)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from guijax.models.processor import ImageProcessor, ImageSizeError, Processor, smart_resize  # noqa: E402
from guijax.models.tokenizer import SPECIAL_TOKENS, build_tokenizer, special_token_ids  # noqa: E402

UITARS = ("Thought: The Save button is at the top left.\n"
          "Action: click(start_box='<|box_start|>(123,45)<|box_end|>')")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=1024)
    return path


def _reference_processor(tokenizer_dir, **image_kwargs):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    # The video processor needs torchvision, which cannot be installed beside the local torch build; images only.
    cls = transformers.Qwen2_5_VLProcessor
    original = cls.check_argument_for_proper_class
    cls.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        return cls(image_processor=Qwen2VLImageProcessorPil(**image_kwargs), tokenizer=tok, video_processor=None,
                   chat_template=tok.chat_template)
    finally:
        cls.check_argument_for_proper_class = original


def _image(rs, w, h, mode="RGB"):
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    return Image.fromarray(rs.randint(0, 256, (h, w, channels), dtype=np.uint8).squeeze(), mode=mode)


@pytest.mark.parametrize("size", [(1920, 1080), (1022, 1522), (28, 28), (56, 300), (300, 56), (641, 479)])
def test_image_processor_parity(size):
    img = _image(np.random.RandomState(sum(size)), *size)
    ref = Qwen2VLImageProcessorPil()(images=[img], return_tensors="np")
    ours = ImageProcessor()([img])
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert ours["pixel_values"].shape == ref["pixel_values"].shape
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"], atol=1e-5)


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_non_rgb_inputs(mode):
    img = _image(np.random.RandomState(1), 130, 100, mode)
    ref = Qwen2VLImageProcessorPil()(images=[img], return_tensors="np")
    np.testing.assert_allclose(ImageProcessor()([img])["pixel_values"], ref["pixel_values"], atol=1e-5)


def test_min_max_pixel_overrides_and_numpy_input():
    rs = np.random.RandomState(2)
    array = rs.randint(0, 256, (700, 900, 3), dtype=np.uint8)
    ref = Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)(images=[Image.fromarray(array)],
                                                                                   return_tensors="np")
    ours = ImageProcessor(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)([array])
    assert int(ours["image_grid_thw"].prod()) <= 64 * 4
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"], atol=1e-5)


def test_bad_image_sizes_fail_clearly():
    with pytest.raises(ImageSizeError, match="20x50 px is smaller than 28"):
        smart_resize(50, 20)
    with pytest.raises(ImageSizeError, match="aspect ratio 214.3 > 200"):
        smart_resize(28, 6000)


def test_processor_batch_parity(tokenizer_dir):
    rs = np.random.RandomState(3)
    images = [[_image(rs, 200, 120)], [_image(rs, 60, 60), _image(rs, 300, 90)]]
    texts = ["hi <|vision_start|><|image_pad|><|vision_end|> click",
             "a <|vision_start|><|image_pad|><|vision_end|> b <|vision_start|><|image_pad|><|vision_end|> the OK button"]
    ref = _reference_processor(tokenizer_dir)(text=texts, images=images, return_tensors="np", padding=True)
    ours = Processor.from_pretrained(tokenizer_dir)(texts, images)
    for key in ("input_ids", "attention_mask", "image_grid_thw", "mm_token_type_ids"):
        np.testing.assert_array_equal(ours[key], ref[key], err_msg=key)
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"], atol=1e-5)
    assert (ours["input_ids"] == special_token_ids(Processor.from_pretrained(tokenizer_dir).tokenizer)["image_token_id"]
            ).sum() == int(ours["image_grid_thw"].prod(1).sum()) // 4


def test_processor_text_only_and_mismatch_errors(tokenizer_dir):
    proc = Processor.from_pretrained(tokenizer_dir)
    ref = _reference_processor(tokenizer_dir)(text=["just text", "more text here"], return_tensors="np", padding=True)
    ours = proc(["just text", "more text here"])
    np.testing.assert_array_equal(ours["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(ours["attention_mask"], ref["attention_mask"])
    assert "pixel_values" not in ours
    with pytest.raises(ValueError, match="more <\\|image_pad\\|> placeholders than the 0 images"):
        proc(["x <|image_pad|>"])
    with pytest.raises(ValueError, match="1 images given but the texts hold fewer"):
        proc(["x"], [[np.zeros((56, 56, 3), np.uint8)]])


def test_tokenizer_round_trip_and_special_tokens(tokenizer_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) <= 1024
    ids = tok(UITARS)["input_ids"]
    assert tok.decode(ids) == UITARS
    for token in SPECIAL_TOKENS:
        assert len(tok(token)["input_ids"]) == 1, token
    ids = special_token_ids(tok)
    assert ids["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert ids["pad_token_id"] == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


def test_chat_template_renders_images(tokenizer_dir):
    proc = Processor.from_pretrained(tokenizer_dir)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "task"}, {"type": "image"}]},
                                     {"role": "assistant", "content": [{"type": "text", "text": UITARS}]},
                                     {"role": "user", "content": [{"type": "image"}]}])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\ntask")
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert text.endswith("<|im_start|>assistant\n")


def test_tokenizer_is_deterministic(tmp_path, tokenizer_dir):
    build_tokenizer(tmp_path, vocab_size=1024)
    assert (tmp_path / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()
