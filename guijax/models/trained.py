"""What an optimiser step updates: every parameter, the LoRA adapters alone, or either with whole parameter
groups held fixed (`model.frozen`, e.g. the vision tower and its merger, as SGCD trains Qwen3-VL).

The parameters are cut in two, (trained, frozen): the step differentiates and keeps AdamW moments for the
first alone, and takes the second as constants, so a frozen group costs no gradient, no moment and no
backward pass through it (nothing trained lies upstream of a frozen vision tower)."""
from __future__ import annotations

import dataclasses
from typing import Any

from flax import traverse_util

from guijax.models.lora import LoraConfig, is_adapter

# the top-level parameter groups `model.frozen` may name (guijax.models.qwen2_5_vl.Qwen2_5_VL's submodules)
GROUPS = ("visual", "embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True)
class TrainedPart:
    """The adapters under `lora` (else every parameter), less the top-level groups in `frozen`."""

    lora: LoraConfig | None = None
    frozen: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.frozen) - set(GROUPS))
        if unknown:
            raise ValueError(f"model.frozen names {unknown}, which are not parameter groups; choose from {list(GROUPS)}")

    @classmethod
    def of(cls, module: Any) -> "TrainedPart":
        """The part a model module trains (its `lora` and `frozen` fields)."""
        return cls(module.lora, tuple(module.frozen))

    @property
    def everything(self) -> bool:
        return self.lora is None and not self.frozen

    def _trains(self, path: tuple[str, ...]) -> bool:
        return path[0] not in self.frozen and (self.lora is None or is_adapter(path))

    def partition(self, params: Any) -> tuple[Any, Any]:
        """(trained, frozen), each a nested dict like `params` holding its own leaves; (params, {}) when
        everything trains."""
        if self.everything:
            return params, {}
        missing = sorted(set(self.frozen) - set(params))
        if missing:
            raise ValueError(f"model.frozen names {missing}, which this model does not have (its groups: "
                             f"{sorted(params)}; a model with tied embeddings has no lm_head)")
        flat = traverse_util.flatten_dict(params)
        trained = {p: v for p, v in flat.items() if self._trains(p)}
        fixed = {p: v for p, v in flat.items() if not self._trains(p)}
        return traverse_util.unflatten_dict(trained), traverse_util.unflatten_dict(fixed)

    def join(self, trained: Any, frozen: Any) -> Any:
        """The inverse of `partition`."""
        if self.everything:
            return trained
        flat = traverse_util.flatten_dict(frozen)
        flat.update(traverse_util.flatten_dict(trained))
        return traverse_util.unflatten_dict(flat)

    def trainable(self, params: Any) -> Any:
        """What the optimiser updates."""
        return self.partition(params)[0]

    def with_trainable(self, params: Any, new: Any) -> Any:
        """`params` with its trained part replaced by `new` (the inverse of `trainable`)."""
        return self.join(new, self.partition(params)[1])
