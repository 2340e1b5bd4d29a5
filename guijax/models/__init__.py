"""The policies (Qwen2.5-VL, Qwen2-VL, Qwen3-VL): architecture, presets, Hugging Face loading and saving."""
from guijax.models.config import PRESETS, ModelConfig, VisionConfig, get_preset
from guijax.models.policy import ModelInputs, Policy, from_pretrained, prepare_inputs, save_pretrained

__all__ = ["PRESETS", "ModelConfig", "VisionConfig", "get_preset", "ModelInputs", "Policy", "from_pretrained",
           "prepare_inputs", "save_pretrained"]
