"""Routed experts (Qwen3-VL-MoE): a softmax router picks the top-k experts of each token, and the experts run as
grouped matmuls over the tokens sorted by expert (`jax.lax.ragged_dot`), so the work is k expert MLPs per token
whatever the number of experts. `dense_experts` is the plain reference: every expert on every token, weighted
by the (mostly zero) routing weights.

The router's statistics per layer (how many tokens each expert took, and its summed probability) are sown
into the "intermediates" collection; `load_balancing_loss` turns them into the Switch-Transformer auxiliary
loss over all layers, as transformers computes it.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from guijax.models.layers import Linear, activation

Dtype = Any
ROUTER_STATS = "router_stats"


def route(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, experts [T, k], probabilities [T, E] f32):
    softmax in float32, the top k, renormalised to sum to one."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(logits.dtype), experts, probs


def grouped_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
                    act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """x [T, H]; experts / weights [T, k]; gate_up [E, H, 2I]; down [E, I, H] -> [T, H].

    Each (token, choice) pair is one row; rows sorted by expert form E contiguous groups that one ragged
    matmul multiplies by their expert's weights."""
    t, k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x, order // k, axis=0)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(rows, gate_up.astype(x.dtype), sizes)
    gate, up = jnp.split(h, 2, axis=-1)
    out = jax.lax.ragged_dot(act(gate) * up, down.astype(x.dtype), sizes)
    out = out * jnp.take(weights.reshape(-1), order)[:, None].astype(out.dtype)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return jnp.sum(unsorted.reshape(t, k, -1), axis=1)


def dense_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
                  act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The reference: every expert on every token ([T, E, ...] intermediates), mixed by the routing weights."""
    dense_weights = jnp.zeros((x.shape[0], gate_up.shape[0]), weights.dtype)
    dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    gate, up = jnp.split(jnp.einsum("th,ehi->tei", x, gate_up.astype(x.dtype)), 2, axis=-1)
    out = jnp.einsum("tei,eih->teh", act(gate) * up, down.astype(x.dtype))
    return jnp.einsum("teh,te->th", out, dense_weights.astype(out.dtype))


class ExpertWeights(nn.Module):
    """The stacked expert matrices: gate_up_proj [E, H, 2I] (gate then up) and down_proj [E, I, H]."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        def init(axes):
            return nn.with_logical_partitioning(nn.initializers.normal(0.02), axes)

        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return (self.param("gate_up_proj", init(("experts", "embed", "mlp")), (e, h, 2 * i), self.param_dtype),
                self.param("down_proj", init(("experts", "mlp", "embed")), (e, i, h), self.param_dtype))


class SparseMoE(nn.Module):
    """Qwen3-VL-MoE's MLP: router `gate` ([hidden, experts]) and stacked expert weights, named as its
    checkpoints name them (experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H])."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    hidden_act: str = "silu"
    implementation: str = "grouped"  # "grouped" (ragged_dot) or "dense" (the reference)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
        """x [b, s, H]; token_mask [b, s] (1 = a real token) weighs the router statistics."""
        b, s, hidden = x.shape
        flat = x.reshape(-1, hidden)
        logits = Linear(self.num_experts, ("embed", "experts"), name="gate", dtype=self.dtype,
                        param_dtype=self.param_dtype)(flat)
        weights, experts, probs = route(logits, self.experts_per_token)
        gate_up, down = ExpertWeights(self.num_experts, hidden, self.intermediate_size, self.param_dtype,
                                      name="experts")()
        run = {"grouped": grouped_experts, "dense": dense_experts}[self.implementation]
        out = run(flat, experts, weights, gate_up, down, activation(self.hidden_act))
        mask = jnp.ones((b * s,), jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
        counts = jnp.zeros((self.num_experts,), jnp.float32).at[experts.reshape(-1)].add(
            jnp.repeat(mask, self.experts_per_token))
        self.sow("intermediates", ROUTER_STATS,
                 jnp.stack([counts, jnp.sum(probs * mask[:, None], axis=0),
                            jnp.full((self.num_experts,), jnp.sum(mask))]))
        return out.reshape(b, s, hidden)


def load_balancing_loss(intermediates: Any) -> jax.Array:
    """The Switch-Transformer auxiliary loss over every MoE layer's sown statistics: num_experts times the sum
    over experts of (share of top-k choices) x (mean router probability), shares and means taken over all
    layers' real tokens together (transformers' `load_balancing_loss_func`). 0 for a model without experts."""
    stats = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates)
             if any(getattr(p, "key", None) == ROUTER_STATS for p in path)]
    if not stats:
        return jnp.zeros((), jnp.float32)
    # each leaf [..., 3, E]: scanned layers stack a leading layer axis; sow wraps values in a tuple
    total = sum(jnp.sum(s.reshape(-1, 3, s.shape[-1]), axis=0) for s in stats)
    rows = total[2, 0]
    return total.shape[-1] * jnp.sum((total[0] / rows) * (total[1] / rows))
