"""Routed experts (Qwen3-VL-MoE): a softmax router picks the top-k experts of each token, and the experts run as
grouped matmuls over the tokens sorted by expert (`jax.lax.ragged_dot`), so the work is k expert MLPs per token
whatever the number of experts. `dense_experts` is the plain reference: every expert on every token, weighted
by the (mostly zero) routing weights.

Under a mesh with an `expert` axis (see guijax.sharding) the experts are split over it and
`expert_parallel_experts` moves each (token, choice) pair to the device holding its expert by all-to-all, runs
the grouped matmuls on that device's experts alone, and brings the results back the same way. The buffers
have static shapes: by default each destination gets room for every pair a device routes ("dropless", exact),
or, with a capacity factor c, room for c times an even share, and pairs beyond it are dropped (their token
keeps its other choices and the residual), as capacity-based MoE trainers do.

The router's statistics per layer (how many tokens each expert took, and its summed probability) are sown
into the "intermediates" collection; `load_balancing_loss` turns them into the Switch-Transformer auxiliary
loss over all layers, as transformers computes it.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from guijax.models.layers import Linear, activation
from guijax.sharding import DATA_AXES

Dtype = Any
ROUTER_STATS = "router_stats"
DROPPED_PAIRS = "dropped_pairs"
EXPERT_AXIS = "expert"


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


def expert_parallel_size() -> int:
    """Devices on the `expert` axis of the mesh in context (1 without a mesh or without the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[EXPERT_AXIS]


def expert_capacity(pairs: int, devices: int, capacity_factor: float) -> int:
    """Rows each device reserves per destination for `pairs` (token, choice) pairs: all of them when the factor
    is 0 (dropless), else the factor times an even share, at least one row."""
    if capacity_factor <= 0:
        return pairs
    return max(1, min(pairs, math.ceil(capacity_factor * pairs / devices)))


def _dispatch_and_combine(x: jax.Array, experts: jax.Array, weights: jax.Array, valid: jax.Array,
                          gate_up: jax.Array, down: jax.Array, act: Callable[[jax.Array], jax.Array],
                          capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """One device's view (inside shard_map): its tokens x [T, H] with their choices, its experts gate_up
    [E/n, H, 2I] / down [E/n, I, H]. Returns its tokens' outputs [T, H] and the pairs dropped on the whole mesh."""
    devices = jax.lax.axis_size(EXPERT_AXIS)
    t, k = experts.shape
    hidden, local_experts = x.shape[-1], gate_up.shape[0]
    flat = experts.reshape(-1)
    real = jnp.repeat(valid, k)  # pairs of real (not padding) token rows
    # destination device of each pair; padding rows go to a bucket past the last device and are never sent
    dest = jnp.where(real, flat // local_experts, devices)
    capacity = expert_capacity(t * k, devices, capacity_factor)
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=devices + 1)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.zeros_like(dest).at[order].set(jnp.arange(t * k) - starts[dest[order]])
    kept = (dest < devices) & (slot < capacity)
    dest = jnp.where(kept, dest, devices)  # an out-of-range destination: scatters drop it, gathers read zero
    send = jnp.zeros((devices, capacity, hidden), x.dtype).at[dest, slot].set(jnp.repeat(x, k, axis=0), mode="drop")
    send_ids = jnp.full((devices, capacity), local_experts, jnp.int32).at[dest, slot].set(
        (flat % local_experts).astype(jnp.int32), mode="drop")
    rows = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0).reshape(devices * capacity, hidden)
    ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0).reshape(-1)
    # empty slots carry id local_experts: sorted last, outside every group, so ragged_dot leaves them zero
    by_expert = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    h = jax.lax.ragged_dot(jnp.take(rows, by_expert, axis=0), gate_up.astype(x.dtype), sizes)
    gate, up = jnp.split(h, 2, axis=-1)
    out = jax.lax.ragged_dot(act(gate) * up, down.astype(x.dtype), sizes)
    out = jnp.zeros_like(out).at[by_expert].set(out).reshape(devices, capacity, hidden)
    back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0)  # back[d]: what device d computed for our pairs
    pair_out = back.at[dest, slot].get(mode="fill", fill_value=0)
    pair_out = pair_out * weights.reshape(-1)[:, None].astype(pair_out.dtype)
    return jnp.sum(pair_out.reshape(t, k, hidden), axis=1), jax.lax.psum(jnp.sum(real & ~kept), DATA_AXES)


def expert_parallel_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_up: jax.Array,
                            down: jax.Array, act: Callable[[jax.Array], jax.Array],
                            capacity_factor: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """`grouped_experts` with the experts split over the mesh's `expert` axis (the mesh in context). Token rows
    are split over every data-parallel axis (padded to divide); each device sends its pairs to their experts'
    devices by all-to-all. Returns (out [T, H], number of dropped pairs: 0 when dropless)."""
    mesh = jax.sharding.get_abstract_mesh()
    devices = mesh.shape[EXPERT_AXIS]
    if gate_up.shape[0] % devices:
        raise ValueError(f"{gate_up.shape[0]} experts do not divide over the mesh's expert axis of {devices}")
    token_axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    t = x.shape[0]
    pad = -t % shards
    valid = jnp.arange(t + pad) < t
    x, experts, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, experts, weights))
    rows = P(token_axes)
    run = jax.shard_map(lambda *a: _dispatch_and_combine(*a, act=act, capacity_factor=capacity_factor), mesh=mesh,
                        in_specs=(rows, rows, rows, rows, P(EXPERT_AXIS), P(EXPERT_AXIS)), out_specs=(rows, P()))
    out, dropped = run(x, experts, weights, valid, gate_up, down)
    return out[:t], dropped


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
    # "grouped" (ragged_dot; all-to-all over the experts' devices under a mesh with an expert axis) or "dense"
    # (the reference)
    implementation: str = "grouped"
    capacity_factor: float = 0.0  # expert parallelism's per-destination room (expert_capacity); 0: dropless
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
        if self.implementation == "grouped" and expert_parallel_size() > 1:
            out, dropped = expert_parallel_experts(flat, experts, weights, gate_up, down, activation(self.hidden_act),
                                                   self.capacity_factor)
            self.sow("intermediates", DROPPED_PAIRS, dropped.astype(jnp.float32) / (b * s * self.experts_per_token))
        else:
            run = {"grouped": grouped_experts, "dense": dense_experts}[self.implementation]
            out = run(flat, experts, weights, gate_up, down, activation(self.hidden_act))
        mask = jnp.ones((b * s,), jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
        counts = jnp.zeros((self.num_experts,), jnp.float32).at[experts.reshape(-1)].add(
            jnp.repeat(mask, self.experts_per_token))
        self.sow("intermediates", ROUTER_STATS,
                 jnp.stack([counts, jnp.sum(probs * mask[:, None], axis=0),
                            jnp.full((self.num_experts,), jnp.sum(mask))]))
        return out.reshape(b, s, hidden)


def _sown(intermediates: Any, name: str) -> list[jax.Array]:
    return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates)
            if any(getattr(p, "key", None) == name for p in path)]


def dropped_fraction(intermediates: Any) -> jax.Array | None:
    """Mean over the MoE layers of the share of (token, choice) pairs expert parallelism dropped for want of
    capacity (padding rows included); None when no layer ran expert-parallel."""
    leaves = _sown(intermediates, DROPPED_PAIRS)
    if not leaves:
        return None
    return jnp.mean(jnp.concatenate([jnp.ravel(leaf) for leaf in leaves]))


def load_balancing_loss(intermediates: Any) -> jax.Array:
    """The Switch-Transformer auxiliary loss over every MoE layer's sown statistics: num_experts times the sum
    over experts of (share of top-k choices) x (mean router probability), shares and means taken over all
    layers' real tokens together (transformers' `load_balancing_loss_func`). 0 for a model without experts."""
    stats = _sown(intermediates, ROUTER_STATS)
    if not stats:
        return jnp.zeros((), jnp.float32)
    # each leaf [..., 3, E]: scanned layers stack a leading layer axis; sow wraps values in a tuple
    total = sum(jnp.sum(s.reshape(-1, 3, s.shape[-1]), axis=0) for s in stats)
    rows = total[2, 0]
    return total.shape[-1] * jnp.sum((total[0] / rows) * (total[1] / rows))
