"""A layer inside ``jax.shard_map``: ``moe_optimize`` applied to the function the ``shard_map`` runs.

Under the default ``check_vma=True`` JAX casts every value that does not vary over the mesh axes to one
that does (``pvary``) where it meets one that does: the expert weights, the one-hot's iota, the literals
of ``relu`` and of the index arithmetic. The pass reads through these casts and puts them back where it
re-binds, so the layer is rewritten as without ``check_vma``, forward and backward (the casts' transposes
are the ``psum`` of a replicated weight's cotangent). Two devices of the suite's eight host CPU devices.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from moe_lowering import MoeNotFoundError, moe_optimize

T, D, F, E, K = 8, 8, 16, 4, 2  # T tokens per device

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two devices")


def _mesh():
    return jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])


def _layer(between=lambda hidden: hidden):
    """Top-2 softmax routing, a ReLU expert, a one-hot combine; ``between`` runs on the expert activations
    between the two products."""

    def layer(x, router, w_up, w_down):
        weights, experts = lax.top_k(jax.nn.softmax(x @ router), K)
        combine = (jax.nn.one_hot(experts, router.shape[-1]) * weights[..., None]).sum(1)
        hidden = between(jax.nn.relu(jnp.einsum("td,edf->tef", x, w_up)))
        return jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", hidden, w_down))

    return layer


def _args(key, num_experts=E):
    k = jax.random.split(key, 4)
    return (jax.random.normal(k[0], (2 * T, D)), jax.random.normal(k[1], (D, num_experts)),
            jax.random.normal(k[2], (num_experts, D, F)) / np.sqrt(D),
            jax.random.normal(k[3], (num_experts, F, D)) / np.sqrt(F))


def _step(layer):
    """The layer's output, the loss on this device's tokens and its gradients with respect to every input."""

    def step(*args):
        def loss(*args):
            out = layer(*args)
            return jnp.sum(jnp.sin(out)), out

        (loss, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return out, loss[None], grads

    return step


def _mapped(fn, in_specs, out_specs, check_vma):
    return jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def _assert_close(got, expected):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


TOKENS_SPLIT = (P("data"), P(), P(), P())  # data parallel: the weights replicated, pvary'd where they meet tokens
EXPERTS_SPLIT = (P(), P(None, "data"), P("data"), P("data"))  # each device its own experts: the tokens pvary'd


def _per_device(step, d_tokens_summed):
    """``step`` with a leading device axis on what differs per device when the tokens are replicated: the
    output, and the tokens' gradient unless ``check_vma`` summed it over the devices."""

    def per_device(*args):
        out, loss, (d_tokens, *d_weights) = step(*args)
        return out[None], loss, (d_tokens if d_tokens_summed else d_tokens[None], *d_weights)

    return per_device


@pytest.mark.parametrize("experts_split, check_vma", [(False, True), (True, True), (False, False)],
                         ids=["tokens_split", "experts_split", "tokens_split_no_check_vma"])
def test_training_step_inside_shard_map_is_rewritten(experts_split, check_vma):
    """The output, the loss and the gradients with respect to every input (a replicated input's summed over
    the devices under ``check_vma``) as the dense program's; no dense ``[T, E, F]`` activation left, forward
    or backward."""
    step = _step(_layer())
    if experts_split:
        in_specs, args = EXPERTS_SPLIT, _args(jax.random.key(0), num_experts=2 * E)
        step = _per_device(step, check_vma)
        out_specs = (P("data"), P("data"), (P() if check_vma else P("data"),) + in_specs[1:])
    else:
        in_specs, args = TOKENS_SPLIT, _args(jax.random.key(0))
        out_specs = (P("data"), P("data"), in_specs)
    rewritten = _mapped(moe_optimize(step, strict=True), in_specs, out_specs, check_vma)
    _assert_close(rewritten(*args), _mapped(step, in_specs, out_specs, check_vma)(*args))
    program = str(jax.make_jaxpr(rewritten)(*args))
    assert "moe_lowering_sparse_moe" in program
    assert not re.search(rf"f32\[{2 * T if experts_split else T},{E},{F}\]", program), "a dense activation is left"


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
def test_a_sum_over_the_devices_between_the_products_declines(check_vma):
    """``psum`` of the expert activations over the mesh axis sums other devices' tokens into each: not the
    layer, so it is not rewritten, and runs as written."""
    layer = _layer(between=lambda hidden: lax.psum(hidden, "data"))
    args = _args(jax.random.key(1))
    specs = dict(in_specs=TOKENS_SPLIT, out_specs=P("data"), check_vma=check_vma)
    with pytest.raises(MoeNotFoundError, match="psum"):
        _mapped(moe_optimize(layer, strict=True), **specs)(*args)
    with pytest.warns(UserWarning, match="psum"):
        got = _mapped(moe_optimize(layer), **specs)(*args)
    _assert_close(got, _mapped(layer, **specs)(*args))
