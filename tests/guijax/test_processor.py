"""numpy Qwen2.5-VL processor against transformers' processor (PIL image backend, `Qwen2VLImageProcessorPil`)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from guijax.models.processor import ImageProcessor, ImageSizeError, Processor, smart_resize  # noqa: E402
from guijax.models.tokenizer import build_tokenizer  # noqa: E402

PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=1024)
    return path


def auto_processor(path):
    """transformers' AutoProcessor on `path`, minus the video processor: every video processor needs torchvision,
    which cannot be installed beside the local torch build; images and text take the normal path."""
    cls = transformers.Qwen2_5_VLProcessor
    assert "get_attributes" not in cls.__dict__  # inherited from ProcessorMixin; shadowed only for this call
    attributes = transformers.ProcessorMixin.get_attributes.__func__
    cls.get_attributes = classmethod(lambda c: [a for a in attributes(c) if a != "video_processor"])
    try:
        proc = transformers.AutoProcessor.from_pretrained(path)
    finally:
        del cls.get_attributes
    assert isinstance(proc.image_processor, Qwen2VLImageProcessorPil)
    return proc


def _image(seed, w, h, mode="RGB"):
    rs = np.random.RandomState(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    return Image.fromarray(rs.randint(0, 256, (h, w, channels), dtype=np.uint8).squeeze(), mode=mode)


def _assert_same_pixels(ours, ref):
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert ours["pixel_values"].shape == ref["pixel_values"].shape
    assert ours["pixel_values"].dtype == np.float32
    assert np.abs(ours["pixel_values"] - ref["pixel_values"]).max() <= 1e-6  # measured: exactly 0


@pytest.mark.parametrize("size", [(1920, 1080), (1022, 1522), (28, 28), (56, 300), (300, 56), (641, 479), (30, 5000)])
def test_image_processor_parity(size):
    img = _image(sum(size), *size)
    ref = Qwen2VLImageProcessorPil()(images=[img], return_tensors="np")
    ours = ImageProcessor()([img])
    _assert_same_pixels(ours, ref)
    h, w = smart_resize(size[1], size[0])
    assert ours["image_grid_thw"].tolist() == [[1, h // 14, w // 14]]
    assert ours["pixel_values"].shape == (h * w // 196, 3 * 2 * 14 * 14)


def test_patch_layout_is_merge_window_major():
    """Rows go 2x2 merge window by window (row-major over windows), each row is (C, T, 14, 14) with the image
    repeated over T: checked on a constructed image, independent of the reference."""
    proc = ImageProcessor(image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0), rescale_factor=1.0)
    pixels = np.zeros((56, 84, 3), np.uint8)
    for y in range(4):
        for x in range(6):
            pixels[y * 14:(y + 1) * 14, x * 14:(x + 1) * 14] = (y * 6 + x, 100 + y, 200 + x)
    out = proc([pixels])
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    rows = out["pixel_values"].reshape(24, 3, 2, 14, 14)
    np.testing.assert_array_equal(rows[:, :, 0], rows[:, :, 1])
    order = [(wy * 2 + my, wx * 2 + mx) for wy in range(2) for wx in range(3) for my in range(2) for mx in range(2)]
    for row, (y, x) in zip(rows, order):
        assert (row[0] == y * 6 + x).all() and (row[1] == 100 + y).all() and (row[2] == 200 + x).all()


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA", "P"])
def test_non_rgb_inputs(mode):
    img = _image(1, 130, 100, "L" if mode == "P" else mode)
    img = img.convert("P") if mode == "P" else img
    _assert_same_pixels(ImageProcessor()([img]), Qwen2VLImageProcessorPil()(images=[img], return_tensors="np"))


def test_min_max_pixel_overrides_and_numpy_input():
    array = np.random.RandomState(2).randint(0, 256, (700, 900, 3), dtype=np.uint8)
    for lo, hi in ((4 * 28 * 28, 64 * 28 * 28), (600 * 28 * 28, 2000 * 28 * 28)):
        ref = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi)(images=[Image.fromarray(array)], return_tensors="np")
        ours = ImageProcessor(min_pixels=lo, max_pixels=hi)([array])
        assert lo <= int(ours["image_grid_thw"].prod()) * 14 * 14 <= hi
        _assert_same_pixels(ours, ref)


def test_preprocessor_config_is_read(tmp_path, tokenizer_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    config = json.loads((tokenizer_dir / "preprocessor_config.json").read_text())
    config.update(min_pixels=8 * 28 * 28, max_pixels=16 * 28 * 28)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    ours = Processor.from_pretrained(tmp_path)
    assert (ours.image_processor.min_pixels, ours.image_processor.max_pixels) == (8 * 28 * 28, 16 * 28 * 28)
    img = _image(5, 1920, 1080)
    ref = auto_processor(tmp_path)(text=[f"a {PAD}"], images=[[img]], return_tensors="np")
    out = ours([f"a {PAD}"], [[img]])
    _assert_same_pixels(out, ref)
    assert int(out["image_grid_thw"].prod()) <= 16 * 4
    # the `size` form of newer configs works too, and min_pixels/max_pixels win over it as in transformers
    assert ImageProcessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 5000}}).max_pixels == 5000
    assert ImageProcessor.from_config({"size": {"longest_edge": 5000}, "max_pixels": 7000}).max_pixels == 7000
    with pytest.raises(ValueError, match="min_pixels 9000 > max_pixels 5000"):
        ImageProcessor.from_config({"min_pixels": 9000, "max_pixels": 5000})


def test_bad_image_sizes_fail_clearly():
    with pytest.raises(ImageSizeError, match="20x50 px is smaller than 28"):
        smart_resize(50, 20)
    with pytest.raises(ImageSizeError, match="6000x28 px has aspect ratio 214.3 > 200"):
        smart_resize(28, 6000)
    with pytest.raises(ImageSizeError, match="27x100 px"):
        ImageProcessor()([_image(0, 27, 100)])
    with pytest.raises(TypeError, match="expected a PIL image"):
        ImageProcessor()(["screenshot.png"])


def _batch():
    images = [[_image(3, 200, 120)], [_image(4, 60, 60), _image(6, 1022, 1522)], []]
    texts = [f"hi {PAD} click", f"a {PAD} b {PAD} the OK button is here", "text only"]
    return texts, images


@pytest.mark.parametrize("side", [None, "left"])
def test_processor_batch_parity(tokenizer_dir, side):
    texts, images = _batch()
    kwargs = {"padding_side": side} if side else {}
    ref = auto_processor(tokenizer_dir)(text=texts, images=images, return_tensors="np", padding=True, **kwargs)
    ours = Processor.from_pretrained(tokenizer_dir)(texts, images, **kwargs)
    assert set(ours) == set(ref)
    for key in ("input_ids", "attention_mask", "image_grid_thw", "mm_token_type_ids"):
        np.testing.assert_array_equal(ours[key], ref[key], err_msg=key)
        assert ours[key].dtype == np.int64, key
    _assert_same_pixels(ours, ref)
    grid = ours["image_grid_thw"]
    proc = Processor.from_pretrained(tokenizer_dir)
    assert (ours["input_ids"] == proc.image_token_id).sum(1).tolist() == [
        grid[0].prod() // 4, (grid[1].prod() + grid[2].prod()) // 4, 0]
    pad_column = 0 if side == "left" else -1
    assert ours["attention_mask"][2, pad_column] == 0 and ours["attention_mask"][1].all()


def test_processor_text_only_flat_images_and_mismatch_errors(tokenizer_dir):
    proc = Processor.from_pretrained(tokenizer_dir)
    assert proc.padding_side == "right" == proc.tokenizer.padding_side
    ref = auto_processor(tokenizer_dir)(text=["just text", "more text here"], return_tensors="np", padding=True)
    ours = proc(["just text", "more text here"])
    assert set(ours) == set(ref) == {"input_ids", "attention_mask", "mm_token_type_ids"}
    for key in ours:
        np.testing.assert_array_equal(ours[key], ref[key], err_msg=key)
    single = proc(f"one {PAD}", [_image(7, 100, 80)])  # a single string and a flat image list
    assert single["input_ids"].shape[0] == 1 and single["image_grid_thw"].shape == (1, 3)
    with pytest.raises(ValueError, match=r"text 0 has more <\|image_pad\|> placeholders than the 0 images"):
        proc(["x <|image_pad|>"])
    with pytest.raises(ValueError, match="1 images given but the texts hold fewer"):
        proc(["x"], [[np.zeros((56, 56, 3), np.uint8)]])
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        Processor(proc.tokenizer, padding_side="middle")
    with pytest.raises(FileNotFoundError, match="no tokenizer_config.json in"):
        Processor.from_pretrained(tokenizer_dir / "missing")


def test_apply_chat_template_feeds_the_processor(tokenizer_dir):
    proc = Processor.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Save the file."}]}]
    text = proc.apply_chat_template(messages)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    f"{PAD}Save the file.<|im_end|>\n<|im_start|>assistant\n")
    img = _image(8, 320, 200)
    ref = auto_processor(tokenizer_dir)
    assert ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    ours = proc([text], [[img]])
    np.testing.assert_array_equal(ours["input_ids"], ref(text=[text], images=[[img]], return_tensors="np")["input_ids"])
