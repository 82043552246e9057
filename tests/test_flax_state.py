"""Framework state through ``moe_optimize`` (issue 33): a decorated Flax NNX method writes its
variables and advances its RNG streams exactly as the undecorated one, eagerly and under
``nnx.jit``; writes the rewritten program cannot carry (a plain object's array attribute, a
container argument changed in place, an NNX object's structure) raise ``StateNotCarriedError``
instead of being lost; with nothing to rewrite, the function itself runs and writes as it does."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering import NoMoeFoundWarning, explain, moe_optimize
from moe_lowering.arguments import StateNotCarriedError
from moe_lowering.testing.zoo import ZOO

nnx = pytest.importorskip("flax.nnx")

MODEL = ZOO["mixtral"].sized(T=16, d=8, f=16, E=4, k=2)


class Count(nnx.Variable):
    """A step counter: state, not a parameter."""


class MoeBlock(nnx.Module):
    """The issue's program: a counter bumped and dropout applied after the dense MoE."""

    def __init__(self, seed: int = 0):
        for name, value in MODEL.make_params(jax.random.key(seed)).items():
            setattr(self, name, nnx.Param(value))
        self.count = Count(jnp.array(0, jnp.int32))
        self.rngs = nnx.Rngs(dropout=seed + 1)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x):
        self.count[...] += 1
        y = MODEL.fn({name: getattr(self, name)[...] for name in ("router", "w_gate", "w_up", "w_down")}, x)
        return self.dropout(y, rngs=self.rngs)


class DecoratedBlock(MoeBlock):
    __call__ = moe_optimize(MoeBlock.__call__, strict=True)


def _inputs():
    return MODEL.make_inputs(jax.random.key(7))


def _rng_count(block) -> int:
    return int(block.rngs.dropout.count[...])


def _two_calls(block, call):
    x = _inputs()
    return call(block, x), call(block, 2 * x)


def _assert_same_as_undecorated(call):
    reference, decorated = MoeBlock(), DecoratedBlock()
    expected = _two_calls(reference, call)
    got = _two_calls(decorated, call)
    assert int(decorated.count[...]) == int(reference.count[...]) == 2
    assert _rng_count(decorated) == _rng_count(reference) == 2
    for want, have in zip(expected, got):
        np.testing.assert_array_equal(np.asarray(have) == 0, np.asarray(want) == 0)  # the same dropout masks
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(np.asarray(got[0]) == 0, np.asarray(got[1]) == 0)  # the stream advanced


def test_nnx_method_carries_counter_and_dropout_rng_eagerly():
    assert len(explain(DecoratedBlock.__call__, MoeBlock(), _inputs()).regions) == 1
    _assert_same_as_undecorated(lambda block, x: block(x))


def test_nnx_method_carries_counter_and_dropout_rng_under_nnx_jit():
    _assert_same_as_undecorated(nnx.jit(lambda block, x: block(x)))


def test_decorated_module_reads_its_parameters_at_every_call():
    """A module (or its bound method) decorated as a whole: its state is an argument, not a constant
    baked into the cached program, so a parameter update shows in the next call; its writes are carried."""
    reference, decorated_block = MoeBlock(), MoeBlock()
    x = _inputs()
    for decorated in (moe_optimize(decorated_block, strict=True), moe_optimize(decorated_block.__call__, strict=True)):
        for block in (reference, decorated_block):
            block.w_up[...] = 2 * block.w_up[...]
        np.testing.assert_allclose(decorated(x), reference(x), rtol=1e-5, atol=1e-6)
    assert int(decorated_block.count[...]) == int(reference.count[...]) == 2


class Holder:
    """A plain Python object holding an array that the function rebinds."""

    def __init__(self):
        self.total = jnp.zeros(MODEL.sizes.d)


def test_plain_object_array_write_is_refused_and_left_unchanged():
    params, x = MODEL.args(jax.random.key(1))

    def accumulate(holder, params, x):
        out = MODEL.fn(params, x)
        holder.total = holder.total + out.sum(0)
        return out

    holder = Holder()
    with pytest.raises(StateNotCarriedError, match="wrote the array attribute 'total' of the Holder object"):
        moe_optimize(accumulate)(holder, params, x)
    assert isinstance(holder.total, jax.Array) and not isinstance(holder.total, jax.core.Tracer)
    np.testing.assert_array_equal(holder.total, 0)


def test_container_argument_changed_in_place_is_refused():
    params, x = MODEL.args(jax.random.key(1))

    def log_output(log, params, x):
        out = MODEL.fn(params, x)
        log["last"] = out
        return out

    with pytest.raises(StateNotCarriedError, match="changed the structure of its arguments in place"):
        moe_optimize(log_output)({"last": None, "steps": jnp.zeros(())}, params, x)

    def replace_entry(log, params, x):
        log["steps"] = log["steps"] + 1
        return MODEL.fn(params, x)

    with pytest.raises(StateNotCarriedError, match=r"replaced its argument args\[0\]\['steps'\] in place"):
        moe_optimize(replace_entry)({"steps": jnp.zeros(())}, params, x)


def test_nnx_structure_change_and_non_array_write_are_refused():
    class AddsAttribute(MoeBlock):
        def __call__(self, x):
            self.last = nnx.Variable(x)
            return super().__call__(x)

    with pytest.raises(StateNotCarriedError, match="changed the structure of an NNX object"):
        moe_optimize(AddsAttribute.__call__)(AddsAttribute(), _inputs())

    class WritesPython(MoeBlock):
        def __init__(self):
            super().__init__()
            self.calls = nnx.Variable([0])  # a Python list: baked into the program, not an input

        def __call__(self, x):
            self.calls[0] = 1  # a write to the variable's value (not its structure)
            return super().__call__(x)

    with pytest.raises(StateNotCarriedError, match=r"wrote int 1 into the NNX variable at .*calls"):
        moe_optimize(WritesPython.__call__)(WritesPython(), _inputs())


def test_without_a_moe_the_function_itself_runs_and_writes():
    def count_calls(holder, x):
        holder.total = holder.total + x.sum(0)
        return x * 2

    holder, x = Holder(), _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoMoeFoundWarning)
        decorated = moe_optimize(count_calls)
        decorated(holder, x)
        decorated(holder, x)
    np.testing.assert_allclose(holder.total, 2 * x.sum(0), rtol=1e-6)


linen = pytest.importorskip("flax.linen")


def _linen_body(module, x):
    """The MoE on module params, a mutable counter, and dropout: every kind of Linen state."""
    params = {name: module.param(name, linen.initializers.normal(0.3), shape.shape)
              for name, shape in MODEL.make_params(jax.random.key(0)).items()}
    count = module.variable("stats", "count", lambda: jnp.zeros((), jnp.int32))
    count.value += 1
    return linen.Dropout(0.5, deterministic=False)(MODEL.fn(params, x) + x)


class LinenMoe(linen.Module):
    @linen.compact
    def __call__(self, x):
        return _linen_body(self, x)


class LinenMoeDecoratedOutside(linen.Module):
    @moe_optimize(strict=True)
    @linen.compact
    def __call__(self, x):
        return _linen_body(self, x)


class LinenMoeDecoratedInside(linen.Module):
    @linen.compact
    @moe_optimize(strict=True)
    def __call__(self, x):
        return _linen_body(self, x)


class LinenParent(linen.Module):
    block: type

    @linen.compact
    def __call__(self, x):
        return self.block(name="moe")(linen.Dense(MODEL.sizes.d)(x))


@pytest.mark.parametrize("block", [LinenMoeDecoratedOutside, LinenMoeDecoratedInside])
def test_linen_method_decorated_inside_the_module_is_lifted(block):
    """``moe_optimize`` on a Linen module's own method (either side of ``nn.compact``) runs as a Linen
    lifted transform: init (under jit) makes the same parameters, apply the same outputs, counter and
    gradients as the undecorated module, eagerly and under jit (its trace once leaked into the scope)."""
    x, rngs = _inputs(), {"dropout": jax.random.key(5)}
    reference, decorated = LinenParent(LinenMoe), LinenParent(block)
    variables = reference.init(jax.random.key(2), x)
    jax.tree.map(lambda want, got: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
                 variables, jax.jit(decorated.init)(jax.random.key(2), x))

    def loss(model, params):
        out, state = model.apply({**variables, "params": params}, x, rngs=rngs, mutable=["stats"])
        return out.sum(), state

    (want, want_state), want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, reference), has_aux=True))(
        variables["params"])
    (got, got_state), got_grads = jax.jit(jax.value_and_grad(functools.partial(loss, decorated), has_aux=True))(
        variables["params"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(got_state["stats"]["moe"]["count"]) == int(want_state["stats"]["moe"]["count"]) == 2
    jax.tree.map(lambda w, g: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), want_grads, got_grads)
    eager, eager_state = decorated.apply(variables, x, rngs=rngs, mutable=["stats"])
    np.testing.assert_allclose(eager.sum(), want, rtol=1e-5)
    assert int(eager_state["stats"]["moe"]["count"]) == 2
