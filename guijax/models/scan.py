"""Layers under `nn.scan`, and the rematerialisation policies (one table for decoder layers and vision blocks).

A scanned stack holds one copy of the layer in the program however deep the model is, so compile time and
program size stay flat in depth; its parameters gain a leading layer axis.

A policy decides which values a layer keeps for the backward pass; everything else is recomputed. Layers tag
two values with `checkpoint_name` so a policy can keep them by name: the attention output (the input of the
output projection, the costliest value to recompute) and the MLP input (the post-attention norm's output).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax

ATTENTION_OUT = "attention_out"
MLP_IN = "mlp_in"

# name -> jax.checkpoint policy; "none" means no rematerialisation at all, "full" saves only the layer input.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention_saveable": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, MLP_IN),
}


def check_policy(policy: str) -> None:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; choose one of {tuple(REMAT_POLICIES)}")


def maybe_remat(cls: type[nn.Module], policy: str, *, scanned: bool = False) -> type[nn.Module]:
    """`cls` wrapped in rematerialisation under `policy`. Inside a scan the loop boundary already keeps XLA
    from merging the recomputation with the forward pass, so `prevent_cse` (extra barriers) is only needed
    for unrolled layers."""
    check_policy(policy)
    if policy == "none":
        return cls
    return nn.remat(cls, prevent_cse=not scanned, policy=REMAT_POLICIES[policy])


def scanned_layers(cls: type[nn.Module], length: int, in_axes: Any, axis_name: str = "layers") -> type[nn.Module]:
    """`cls` (a scan body module) applied `length` times by one `nn.scan`: its parameters gain a leading
    axis of that length with logical name `axis_name` ("layers", or "layer_groups" for an outer scan, as
    one array may not repeat a name; neither is sharded, see guijax.sharding.LOGICAL_RULES), so the program
    holds one copy of the layer however deep the model is."""
    return nn.scan(cls, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True, "dropout": True},
                   in_axes=in_axes, length=length, metadata_params={nn.PARTITION_NAME: axis_name})
