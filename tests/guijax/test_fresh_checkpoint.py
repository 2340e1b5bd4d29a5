"""A fresh preset checkpoint goes through the real loading path: guijax and transformers both read it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from guijax.models import from_pretrained
from guijax.models.fresh import create_checkpoint


@pytest.mark.parametrize("preset, hf_class, mean", [("tiny", "Qwen2_5_VL", 0.48145466),
                                                   ("tiny_qwen2_vl", "Qwen2VL", 0.48145466),
                                                   ("tiny_qwen3_vl", "Qwen3VL", 0.5),
                                                   # the dense Qwen3-VL's processor and layout, with experts (30 s)
                                                   pytest.param("tiny_qwen3_vl_moe", "Qwen3VLMoe", 0.5,
                                                                marks=pytest.mark.slow)])
def test_fresh_tiny_checkpoint_loads_and_runs_on_an_image(tmp_path, preset, hf_class, mean):
    path = create_checkpoint(tmp_path / "ckpt", preset, seed=0, tokenizer_vocab=1024)
    policy = from_pretrained(path)
    assert policy.cfg.image_token_id == policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    proc = policy.processor
    assert proc.image_processor.patch_size == policy.cfg.vision.patch_size  # the family's own patch grid
    assert proc.image_processor.image_mean[0] == pytest.approx(mean)  # and its own normalisation
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Save the file"}]}])
    screenshot = np.random.RandomState(0).randint(0, 256, (112, 168, 3), dtype=np.uint8)
    inputs = proc([text], [[screenshot]])
    logits = np.asarray(policy.logits(**inputs))
    assert logits.shape == (1, inputs["input_ids"].shape[1], policy.cfg.vocab_size)
    assert np.isfinite(logits).all() and logits.std() > 0
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = json.loads((path / "preprocessor_config.json").read_text())
    reference = Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if not k.endswith("_class")
                                            and k != "image_processor_type"})(images=[screenshot], return_tensors="np")
    np.testing.assert_array_equal(inputs["image_grid_thw"], reference["image_grid_thw"])
    np.testing.assert_allclose(inputs["pixel_values"], reference["pixel_values"], atol=1e-6)
    hf = getattr(transformers, f"{hf_class}ForConditionalGeneration").from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf(**{k: torch.tensor(v) for k, v in inputs.items()}).logits.numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4)


def test_tokenizer_larger_than_preset_vocab_fails(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_vocab 5000 exceeds the tiny preset's vocab_size 1024"):
        create_checkpoint(tmp_path, "tiny", tokenizer_vocab=5000)
