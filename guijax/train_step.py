"""Jitted training steps over a padded batch: log-probs of the response tokens through the fused kernel
(hidden states + LM head, never [tokens, vocab] logits), a loss from guijax.losses, and an optax update.

Batch convention (what guijax.data produces): `targets[b, t]` is the token predicted at position t
(input_ids shifted left by one) and `loss_mask[b, t]` is 1 where that target is a response token.

With a mesh, the step and the log-prob function are jitted with explicit shardings: parameters and optimiser
state as `sharding.param_shardings` lays them out, batch rows over (data, fsdp), metrics replicated, traced
under the logical axis rules. Host batches are padded to a multiple of the data-parallel size and placed as
global arrays (`sharding.place_batch`). Without a mesh everything runs as plain `jax.jit` on one device.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh

from guijax import kernels, objectives, sharding
from guijax.data.packing import packed_hidden
from guijax.models.trained import TrainedPart
from guijax.models import weights
from guijax.models.moe import dropped_fraction, load_balancing_loss
from guijax.models.qwen2_5_vl import Qwen2_5_VL

Batch = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """All parameters, the optimiser state of the trainable ones (the LoRA adapters when the module has them,
    else every parameter), and the step count."""

    params: Any
    opt_state: Any
    step: jax.Array


def checkpointed(state: TrainState, module: Qwen2_5_VL) -> TrainState:
    """What a checkpoint must hold to resume: what trains (guijax.models.trained), so under LoRA the adapters,
    not the frozen base weights (which the run reloads from its checkpoint directory; a 7B LoRA checkpoint is
    megabytes, not gigabytes), and never a group `model.frozen` holds fixed."""
    return TrainState(TrainedPart.of(module).trainable(state.params), state.opt_state, state.step)


def restored(state: TrainState, saved: TrainState, module: Qwen2_5_VL) -> TrainState:
    """The inverse of `checkpointed`: `saved`'s trainable parameters and optimiser state on `state`'s base."""
    return TrainState(TrainedPart.of(module).with_trainable(state.params, saved.params), saved.opt_state, saved.step)


def lm_head(params: Any, module: Qwen2_5_VL) -> jax.Array:
    head = params["embed_tokens"].T if module.cfg.tie_word_embeddings else params["lm_head"]
    return head.astype(module.dtype)


def kernel_mesh(impl: str, mesh: Mesh | None) -> dict[str, Any]:
    """The Pallas kernels are custom calls XLA cannot partition, so with a mesh they run under shard_map
    with rows split over (data, fsdp); the XLA paths partition under jit by themselves."""
    if mesh is None or not kernels.resolve_impl(impl).startswith("pallas"):
        return {}
    return {"mesh": mesh, "batch_axes": sharding.DATA_AXES}


def batch_logprobs(module: Qwen2_5_VL, params: Any, batch: Batch, temperature: float = 1.0,
                   impl: str = "auto", mesh: Mesh | None = None,
                   dropout_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-token log π(target) and entropy [b, s] at the sampling temperature (so ratios compare like with
    like: the sampler's behaviour log-probs are of softmax(logits / T)).

    With `response_positions` in the batch the LM head runs on those positions only (`response_logprobs`);
    without it, on every position (`all_positions_logprobs`, the reference). A packed batch (`token_index`)
    gives [b, R] arrays in response space (`packed_logprobs`). `dropout_key`: LoRA dropout on
    (training only)."""
    logp, entropy, _ = _logprobs_and_router_loss(module, params, batch, temperature, impl, mesh, router=False,
                                                 dropout_key=dropout_key)
    return logp, entropy


def _logprobs_and_router_loss(module: Qwen2_5_VL, params: Any, batch: Batch, temperature: float, impl: str,
                              mesh: Mesh | None, router: bool,
                              dropout_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict | None]:
    """`batch_logprobs`, and with `router` the routers' metrics of a routed-expert model: the load-balancing
    loss and, under expert parallelism, the share of pairs dropped for capacity. `dropout_key` turns on the LoRA
    adapters' dropout (training steps only)."""
    args = (batch["input_ids"], batch["positions"], batch["attention_mask"], batch.get("vision"))
    rngs = {} if dropout_key is None else {"dropout": dropout_key}
    aux = None
    if router:
        (hidden, _), state = module.apply({"params": params}, *args, return_logits=False, mutable=["intermediates"],
                                          rngs=rngs)
        sown = state.get("intermediates", {})
        aux = {"router_aux_loss": load_balancing_loss(sown)}
        dropped = dropped_fraction(sown)
        if dropped is not None:
            aux["moe_dropped_fraction"] = dropped
    else:
        hidden, _ = module.apply({"params": params}, *args, return_logits=False, rngs=rngs)
    head = lm_head(params, module)
    if temperature != 1.0:
        head = head / temperature
    if "token_index" in batch:  # a packed batch: its training arrays are already in response space
        return (*packed_logprobs(hidden, head, batch["targets"], batch["loss_mask"], batch["token_index"], impl,
                                 mesh), aux)
    positions = batch.get("response_positions")
    if positions is None:
        return (*all_positions_logprobs(hidden, head, batch["targets"], batch["loss_mask"], impl, mesh), aux)
    return (*response_logprobs(hidden, head, batch["targets"], batch["loss_mask"], positions, impl, mesh), aux)


def all_positions_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array,
                           impl: str = "auto", mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """The head and the log-prob kernel over all b·s positions, masked afterwards."""
    return kernels.token_logprobs(hidden, head, targets, mask, impl=impl, **kernel_mesh(impl, mesh))


def response_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array,
                      positions: jax.Array, impl: str = "auto",
                      mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropy [b, s] computed at `positions` [b, R] only (-1 pads a row's unused slots).

    Responses are a few percent of a GUI batch's tokens, so gathering their hidden states before the head
    saves that fraction of the head's and the kernel's FLOPs and memory (forward and backward). Results are
    scattered back to zeros [b, s], so the losses see the same arrays as on the all-positions path. A
    masked position the indices miss cannot vanish quietly: its log-prob and entropy become NaN, so the loss
    is non-finite and the step is skipped and reported (the pipeline raises before that can happen)."""
    b, s = targets.shape
    positions = positions.astype(jnp.int32)
    valid = positions >= 0
    index = jnp.where(valid, positions, 0)
    picked_mask = jnp.take_along_axis(mask, index, axis=1) * valid.astype(mask.dtype)
    logp, entropy = kernels.token_logprobs(jnp.take_along_axis(hidden, index[..., None], axis=1), head,
                                           jnp.take_along_axis(targets, index, axis=1), picked_mask, impl=impl,
                                           **kernel_mesh(impl, mesh))
    rows = jnp.arange(b)[:, None]
    slots = jnp.where(valid, positions, s)  # out of range: dropped by the scatter
    scatter = lambda v: jnp.zeros((b, s), v.dtype).at[rows, slots].set(v, mode="drop")  # noqa: E731
    covered = scatter(picked_mask.astype(jnp.float32)) > 0
    missed = (mask > 0) & ~covered
    nan = jnp.float32(jnp.nan)
    return jnp.where(missed, nan, scatter(logp)), jnp.where(missed, nan, scatter(entropy))


def packed_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array,
                    token_index: jax.Array, impl: str = "auto",
                    mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropy [b, R] of a packed batch (guijax.data.packing): the hidden states of the packed
    rows [P, L, d] gathered at each example's loss positions, then the head and the kernel on those alone."""
    picked = packed_hidden(hidden, token_index.astype(jnp.int32))
    return kernels.token_logprobs(picked, head, targets, mask, impl=impl, **kernel_mesh(impl, mesh))


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """`loss`: an `objectives.Loss` (it decides what the batch must carry); the log-probs it receives are at
    the sampling `temperature`, through the `impl` kernel."""

    loss: Any = objectives.ClippedPolicyLoss()
    temperature: float = 1.0
    impl: str = "auto"
    router_aux_loss_coef: float = 0.0  # routed-expert models: the load-balancing loss's weight (always reported)
    dropout_seed: int = 0  # LoRA dropout: step k's masks are drawn from fold_in(seed, k)


def loss_fn(params: Any, batch: Batch, module: Qwen2_5_VL, cfg: StepConfig,
            mesh: Mesh | None = None, dropout_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
    logp, entropy, aux = _logprobs_and_router_loss(module, params, batch, cfg.temperature, cfg.impl, mesh,
                                                   router=module.cfg.num_experts > 0, dropout_key=dropout_key)
    loss, metrics = cfg.loss(logp, entropy, batch)
    mask = batch["loss_mask"]
    metrics.setdefault("entropy", jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0))
    if aux is not None:
        metrics.update(aux)
        loss = loss + cfg.router_aux_loss_coef * aux["router_aux_loss"]
    metrics["loss"] = loss
    return loss, metrics


def state_shardings(module: Qwen2_5_VL, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """NamedShardings of a TrainState: parameters by the logical rules, moments like their parameters, the
    step counter replicated."""
    boxed = weights.abstract_params(module)
    params = sharding.param_shardings(boxed, mesh)
    trainable = TrainedPart.of(module).trainable
    opt = sharding.opt_state_shardings(tx, trainable(nn.unbox(boxed)), trainable(params), mesh)
    return TrainState(params, opt, sharding.replicated(mesh))


def init_state(module: Qwen2_5_VL, params: Any, tx: optax.GradientTransformation,
               mesh: Mesh | None = None) -> TrainState:
    """Step-0 TrainState. With a mesh the parameters are (re)placed in their shards and the optimiser state is
    created directly in its shards by a jitted init, never whole on one device."""
    trainable = TrainedPart.of(module).trainable
    if mesh is None:  # committed, as the step's outputs are: uncommitted inputs would compile the step twice
        state = TrainState(params, sharding.init_opt_state(tx, trainable(params)), jnp.int32(0))
        return jax.device_put(state, jax.devices()[0])
    shards = state_shardings(module, tx, mesh)
    params = jax.device_put(params, shards.params)
    return TrainState(params, sharding.init_opt_state(tx, trainable(params), mesh, trainable(shards.params)),
                      jax.device_put(jnp.int32(0), shards.step))


class BatchFn:
    """f(*args, batch) on a mesh: host batches are padded to divide over the data-parallel axes and placed as
    global arrays before the jitted call. With `host_outputs`, results of a host batch come back as this
    process's rows (padding dropped), so host code can index them with the batch's own rows; results of an
    already placed batch stay global."""

    def __init__(self, fn: sharding.MeshJit, image_token_id: int | None, host_outputs: bool = False):
        self.fn, self.image_token_id, self.host_outputs = fn, image_token_id, host_outputs
        self.mesh = fn.mesh

    def place(self, batch: Batch) -> Batch:
        batch = {k: v for k, v in batch.items() if k != "meta"}
        return sharding.place_batch(batch, self.mesh, pad=True, image_token_id=self.image_token_id)

    def __call__(self, *args: Any) -> Any:
        *first, batch = args
        out = self.fn(*first, self.place(batch))
        if not self.host_outputs or sharding.is_placed(batch["input_ids"]):
            return out
        rows = np.shape(batch["loss_mask"])[0]  # a packed batch's outputs have its examples' rows, not its packed ones
        return jax.tree.map(lambda x: sharding.host_rows(x, self.mesh, rows), out)

    def lower(self, *args: Any) -> Any:
        *first, batch = args
        return self.fn.lower(*first, self.place(batch))


def make_train_step(module: Qwen2_5_VL, tx: optax.GradientTransformation, cfg: StepConfig,
                    mesh: Mesh | None = None) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """One optimiser step. A non-finite loss or gradient leaves parameters and optimiser state untouched
    and reports `skipped = 1`, so one bad batch cannot poison a run (the trainer stops after N in a row).
    The trained part of the state is donated: its buffers become the new state's.

    Under LoRA (`module.lora`) the gradient is taken with respect to the adapters alone: the base weights
    enter as constants, so no full-size gradient or moment is ever computed or held. The base is passed
    beside the donated state, neither donated nor returned, so the new state holds the very same base arrays
    and other holders of them (a KL reference policy) share them instead of keeping a copy. Groups held fixed
    by `module.frozen` (a frozen vision tower) are passed the same way, with the same savings."""
    part = TrainedPart.of(module)
    use_dropout = module.lora is not None and module.lora.dropout > 0

    def step(state: TrainState, frozen: Any, batch: Batch) -> tuple[TrainState, dict]:
        """`state.params`: the trained parameters (TrainedPart: the adapters under LoRA, else all, less the
        frozen groups); `frozen`: the rest."""
        trained = state.params
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.dropout_seed), state.step) if use_dropout else None
        scale = batch.get("loss_scale")  # a micro-batch's weight in its accumulation group (metrics unscaled)

        def objective(t: Any) -> tuple[jax.Array, dict]:
            loss, metrics = loss_fn(part.join(t, frozen), batch, module, cfg, mesh, key)
            return (loss if scale is None else loss * scale), metrics

        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trained)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(args: tuple[Any, Any]) -> tuple[Any, Any]:
            params, opt_state = args
            updates, new_opt = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        # A branch rather than a select per leaf: the update's fusions write the new state once, where
        # `where(finite, new, old)` over every parameter and moment read both again (147 select_n, 5.1% of the
        # small preset's CPU step in benchmarks/profile_step.py, before this branch).
        new_trained, new_opt = lax.cond(finite, update, lambda args: args, (trained, state.opt_state))
        metrics = dict(metrics, grad_norm=grad_norm, skipped=(~finite).astype(jnp.int32))
        return TrainState(new_trained, new_opt, state.step + 1), metrics

    if mesh is None:
        return _SplitStep(jax.jit(step, donate_argnums=(0,)), part)
    shards = state_shardings(module, tx, mesh)
    trained_state, frozen_shards = _split_state(part, shards)
    shardings = lambda state, frozen, batch: ((trained_state, frozen_shards,  # noqa: E731
                                               sharding.batch_shardings(batch, mesh)),
                                              (trained_state, sharding.replicated(mesh)))
    return _SplitStep(BatchFn(sharding.MeshJit(step, mesh, shardings, donate_argnums=(0,)), module.cfg.image_token_id),
                      part)


def make_empty_microstep(module: Qwen2_5_VL, tx: optax.GradientTransformation,
                         mesh: Mesh | None = None) -> "_EmptyMicrostep":
    """A gradient-accumulation micro-step that contributes nothing: `tx` (an `optax.MultiSteps`) given zero
    gradients, with no forward or backward pass. It completes a partial accumulation group, so the group's
    update is applied where its batches end instead of waiting for the next ones (`guijax.accumulation`)."""
    part = TrainedPart.of(module)

    def empty(state: TrainState) -> TrainState:
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        updates, new_opt = tx.update(zeros, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), new_opt, state.step)

    if mesh is None:
        fn = jax.jit(empty, donate_argnums=(0,))
    else:
        shards = state_shardings(module, tx, mesh)
        trained = _split_state(part, shards)[0]
        fn = sharding.MeshJit(empty, mesh, lambda state: ((trained,), trained), donate_argnums=(0,))
    return _EmptyMicrostep(fn, part)


class _EmptyMicrostep:
    """`micro(state)` over the jitted `fn(trained state)`: the frozen parameters stay out of the program."""

    def __init__(self, fn: Any, part: TrainedPart):
        self.fn, self.part = fn, part

    def __call__(self, state: TrainState) -> TrainState:
        trained, frozen = _split_state(self.part, state)
        new = self.fn(trained)
        return TrainState(self.part.join(new.params, frozen), new.opt_state, new.step)

    def lower(self, state: TrainState) -> Any:
        """Lowered for `state`'s shapes (ShapeDtypeStructs will do): the dry run compiles it to check its memory
        at the recipe's shapes."""
        return self.fn.lower(_split_state(self.part, state)[0])


def _split_state(part: TrainedPart, state: TrainState) -> tuple[TrainState, Any]:
    """(the state of what trains: its parameters, moments and step; the frozen parameters)."""
    trained, frozen = part.partition(state.params)
    return TrainState(trained, state.opt_state, state.step), frozen


def pending_microsteps(opt_state: Any) -> int:
    """Micro-batches accumulated and not yet applied (0 without `optax.MultiSteps`)."""
    return int(opt_state.mini_step) if isinstance(opt_state, optax.MultiStepsState) else 0


def applied_updates(opt_state: Any) -> int | None:
    """Updates `optax.MultiSteps` has applied so far (None without it: every step is one)."""
    return int(opt_state.gradient_step) if isinstance(opt_state, optax.MultiStepsState) else None


def reference_params(params: Any, part: TrainedPart) -> Any:
    """A frozen copy of `params` that training steps cannot touch: the trained part copied (steps donate its
    buffers), the frozen base under LoRA shared (steps neither donate nor replace it), so a 7B LoRA run's
    reference policy costs the adapters' bytes, not a second model."""
    trained, frozen = part.partition(params)
    return part.join(jax.tree.map(jnp.copy, trained), frozen)


class _SplitStep:
    """`step(state, batch)` over the jitted `fn(trained state, frozen params, batch)`: the state's parameters are
    cut into what the step trains and what it only reads, and joined again around the call."""

    def __init__(self, fn: Any, part: TrainedPart):
        self.fn, self.part = fn, part

    def _args(self, state: TrainState) -> tuple[TrainState, Any]:
        return _split_state(self.part, state)

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        trained_state, frozen = self._args(state)
        new, metrics = self.fn(trained_state, frozen, batch)
        return TrainState(self.part.join(new.params, frozen), new.opt_state, new.step), metrics

    def lower(self, state: TrainState, batch: Batch) -> Any:
        return self.fn.lower(*self._args(state), batch)

    def compile(self, state: TrainState, batch: Batch) -> "_SplitStep":
        """Compiled ahead of time for these shapes: a step whose calls run that one program (no tracing, no
        second compile; the jitted step's own cache is not filled by `lower().compile()`), with the program
        at `.compiled` for its memory and cost analyses. Its calls take the batch as `place` returns it."""
        placed = self.place(batch)
        compiled = self.lower(state, placed).compile()
        out = _SplitStep(compiled, self.part)
        out.compiled = compiled
        return out

    def place(self, batch: Batch) -> Batch:
        """The batch as the jitted step receives it (on a mesh: padded and placed as global arrays)."""
        return self.fn.place(batch) if isinstance(self.fn, BatchFn) else batch

    def lower_abstract(self, state: TrainState, batch: Batch) -> Any:
        """Lower for shapes alone (ShapeDtypeStructs, the batch taken as placed): what ahead-of-time compiles
        read."""
        fn = self.fn.fn if isinstance(self.fn, BatchFn) else self.fn
        return fn.lower(*self._args(state), batch)


def make_logprob_fn(module: Qwen2_5_VL, temperature: float = 1.0, impl: str = "auto", mesh: Mesh | None = None):
    """Jitted log-probs of a batch's targets under given parameters: π_θold before the update epochs,
    a reference policy, or a cache trajectory re-scored under the current policy (BEPA LEVEL-2)."""
    fn = lambda params, batch: batch_logprobs(module, params, batch, temperature, impl, mesh)  # noqa: E731
    if mesh is None:
        return jax.jit(fn)
    params_shards = sharding.param_shardings(weights.abstract_params(module), mesh)
    rows = sharding.batch_sharding(mesh, 2)
    shardings = lambda params, batch: ((params_shards, sharding.batch_shardings(batch, mesh)),  # noqa: E731
                                       (rows, rows))
    return BatchFn(sharding.MeshJit(fn, mesh, shardings), module.cfg.image_token_id, host_outputs=True)
