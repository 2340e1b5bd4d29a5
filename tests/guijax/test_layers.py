"""The decoder's dense layers: 2-D matmuls, in values and in what their gradient compiles to."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from guijax.models import layers
from guijax.models import lora as lora_lib
from guijax.models import rows
from jaxprs import equations  # tests/support


def _dot_generals(jaxpr) -> list:
    """Every dot_general equation of a jaxpr, nested calls included."""
    return [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "dot_general"]


def test_rows_matmul_equals_the_einsum_in_values_and_gradients():
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (3, 5, 8))
    w = jax.random.normal(kw, (8, 6))
    einsum = lambda x, w: jnp.einsum("...i,io->...o", x, w)  # noqa: E731
    chex.assert_trees_all_close(rows.rows_matmul(x, w), einsum(x, w), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    chex.assert_trees_all_close(jax.grad(loss(rows.rows_matmul), argnums=(0, 1))(x, w),
                                jax.grad(loss(einsum), argnums=(0, 1))(x, w), rtol=1e-5, atol=1e-5)


def test_a_linear_layer_and_its_adapter_backpropagate_through_single_axis_contractions():
    """The weight gradient of a [batch, seq, in] input contracts one flattened axis, not batch and sequence
    together (the form XLA:CPU lowers with a strided transpose of the incoming gradient)."""
    lora = lora_lib.LoraConfig(rank=2, alpha=4.0)
    layer = layers.Linear(features=6, axes=("embed", "mlp"), lora=lora)
    x = jnp.ones((2, 3, 4))
    params = layer.init(jax.random.PRNGKey(0), x)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(layer.apply(p, x) ** 2)))(params).jaxpr
    dots = _dot_generals(jaxpr)
    assert len(dots) >= 6  # forward, input and weight gradients of the kernel and of both adapter factors
    for eqn in dots:
        (lhs_contract, rhs_contract), (lhs_batch, _) = eqn.params["dimension_numbers"]
        shapes = [v.aval.shape for v in eqn.invars]
        assert len(lhs_contract) == 1 and not lhs_batch, (shapes, eqn.params["dimension_numbers"])
        assert all(len(s) == 2 for s in shapes), shapes
    np.testing.assert_equal(layer.apply(params, x).shape, (2, 3, 6))
