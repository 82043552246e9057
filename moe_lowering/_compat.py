"""Every difference between the JAX versions we support (0.10.2 to 0.12.x), in one place.

Between these versions ``ClosedJaxpr`` merged into ``Jaxpr`` (0.11: ``make_jaxpr`` returns a
``Jaxpr`` that carries its consts), and core types live in ``jax.extend.core``. 0.12 (checked on
0.12.0.1) needs nothing beyond 0.11's. Primitives are looked up as objects here, so the passes
identify them by identity, never by name.
"""

from __future__ import annotations

import functools

import jax
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import ad_util as _ad_util
from jax._src import core as _core
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import dispatch as _dispatch
from jax._src import mesh as _abstract_mesh
from jax._src import pjit as _pjit
from jax._src.lax import lax as _lax_internal
from jax.extend import core as jex_core

Var = jex_core.Var
Literal = jex_core.Literal

jit_p = _pjit.jit_p
sharding_constraint_p = _pjit.sharding_constraint_p
closed_call_p = _core.closed_call_p
remat_p = _ad_checkpoint.remat_p
optimization_barrier_p = _lax_internal.optimization_barrier_p  # a lowered jax.checkpoint's fence in a dump
custom_jvp_call_p = _custom_derivatives.custom_jvp_call_p
stop_gradient_p = _ad_util.stop_gradient_p
name_p = _ad_checkpoint.name_p  # jax.ad_checkpoint.checkpoint_name
device_put_p = _dispatch.device_put_p
# shard_map(check_vma=True)'s casts of a value that does not vary over manual mesh axes to one that does:
# types only, the same values (``pvary``; ``reduced_vary_cast`` from a "reduced" value)
pvary_p = getattr(_core, "pvary_p", None)
varying_casts = tuple(p for p in (pvary_p, getattr(_core, "reduced_vary_cast_p", None)) if p)
stack_p = getattr(jax.lax, "stack_p", None)  # jnp.stack as one primitive (0.11+); before, broadcasts + concatenate
unstack_p = getattr(jax.lax, "unstack_p", None)  # tuple unpacking of an array (0.11+); before, slices + squeezes


def unit_tile_as_broadcast(primitive, params, operand_shape, out_shape):
    """``(broadcast_in_dim_p, its params)`` for ``tile`` (its own primitive in recent JAX) whose every repeated
    axis has size 1: the same values as a broadcast, the form the matcher reads; ``None`` for other eqns. The
    params come from tracing the broadcast, so they are whatever this JAX version binds."""
    if getattr(primitive, "name", None) != "tile" or len(operand_shape) != len(out_shape):
        return None
    if any(rep != 1 and size != 1 for rep, size in zip(params.get("reps", ()), operand_shape)):
        return None
    return jax.lax.broadcast_in_dim_p, dict(_broadcast_params(tuple(operand_shape), tuple(out_shape)))


@functools.lru_cache(maxsize=256)
def _broadcast_params(operand_shape: tuple, out_shape: tuple) -> tuple:
    """A same-rank ``broadcast_in_dim``'s params as this JAX version binds them (traced once a shape pair:
    the graph is built many times a trace)."""
    dims = tuple(range(len(out_shape)))
    traced = jax.make_jaxpr(lambda a: jax.lax.broadcast_in_dim(a, out_shape, dims))(
        jax.ShapeDtypeStruct(operand_shape, jax.numpy.float32))
    (eqn,) = traced.jaxpr.eqns
    return tuple(eqn.params.items())


def jaxpr_parts(closed):
    """``(jaxpr, consts)`` of a closed jaxpr, whichever class this JAX version uses for it."""
    return closed.jaxpr, list(closed.consts)


def open_jaxpr(jaxpr_like):
    """The open ``Jaxpr`` inside a sub-jaxpr param (``ClosedJaxpr`` on 0.10, ``Jaxpr`` on 0.11)."""
    inner = getattr(jaxpr_like, "jaxpr", jaxpr_like)
    return inner


def sub_jaxprs(params) -> list:
    """The jaxprs an eqn's params hold, alone or in a tuple (as ``cond`` keeps its branches), as stored:
    ``ClosedJaxpr`` or ``Jaxpr`` (``open_jaxpr`` of each has ``eqns``)."""
    values = [v for value in params.values() for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return [v for v in values if hasattr(open_jaxpr(v), "eqns")]


def memory_move(params) -> str | None:
    """``"host"`` or ``"device"``: where a ``device_put`` moves its values when it moves them between the
    memories of their own devices only (a remat policy's offload: ``MemorySpace`` on 0.11+,
    ``TransferToMemoryKind`` on 0.10); else None."""
    kinds = set()
    for target in params.get("devices", ()):
        if type(target).__name__ not in ("MemorySpace", "TransferToMemoryKind"):
            return None
        kind = str(getattr(target, "memory_kind", None) or getattr(target, "name", "")).lower()
        kinds.add("host" if "host" in kind else kind)
    return kinds.pop() if len(kinds) == 1 and kinds <= {"host", "device"} else None


def sub_jaxpr_consts(jaxpr_like) -> list:
    return list(getattr(jaxpr_like, "consts", ()))


def custom_jvp_rule(params, num_inputs: int):
    """``(jaxpr, consts, out_zeros)`` of a ``custom_jvp_call`` eqn's derivative rule with every
    tangent nonzero: inputs ``(*primals, *tangents)``, outputs ``(*primals, *nonzero tangents)``."""
    rule = params["jvp_jaxpr_fun"]
    with _mesh_of_call(params):
        jaxpr, consts, out_zeros = rule.call_wrapped(*([False] * num_inputs))
    return open_jaxpr(jaxpr), list(consts) + sub_jaxpr_consts(jaxpr), list(out_zeros)


def _mesh_of_call(params):
    """The abstract mesh the ``custom_jvp_call`` eqn was traced under, made current while its rule is
    traced (a lazy trace at the eqn's avals): a rule first traced when the expert body is replayed
    inside the expert-parallel ``shard_map`` would otherwise meet a Manual context mesh with avals
    typed on the caller's Auto mesh (``jax.set_mesh``) and fail."""
    import contextlib

    avals = getattr(open_jaxpr(params["call_jaxpr"]), "in_avals", ())
    meshes = {getattr(getattr(a, "sharding", None), "mesh", None) for a in avals}
    meshes.discard(None)
    mesh = next(iter(meshes), None) if len(meshes) == 1 else None
    if mesh is None or getattr(mesh, "empty", True) or mesh == _abstract_mesh.get_abstract_mesh():
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def custom_jvp_name(params) -> str:
    """The Python name of a ``custom_jvp_call`` eqn's function (``relu``), for messages."""
    info = getattr(open_jaxpr(params["call_jaxpr"]), "debug_info", None)
    return params.get("name") or getattr(info, "func_name", None) or "custom_jvp"


def literal_value(atom):
    return atom.val


def is_literal(atom) -> bool:
    return isinstance(atom, Literal)


def remat_wrapper(params):
    """``jax.checkpoint`` configured like a ``remat`` eqn's params."""
    return lambda fn: jax.checkpoint(fn, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))


def as_closed(jaxpr_like):
    """A sub-jaxpr param as something ``build_graph`` takes (``remat`` keeps an open jaxpr on 0.10)."""
    if hasattr(jaxpr_like, "consts") and hasattr(jaxpr_like, "jaxpr") and jaxpr_like.jaxpr is not jaxpr_like:
        return jaxpr_like
    if hasattr(jaxpr_like, "consts") and getattr(jaxpr_like, "jaxpr", None) is jaxpr_like:
        return jaxpr_like
    return jex_core.ClosedJaxpr(jaxpr_like, ())


def scan_roles(params, operands) -> tuple[list, list, list]:
    """``(consts, carry, xs)``: a ``scan`` eqn's operands, or its body's inputs, split by role (0.11 describes
    them with a flat tree, ``ft_in``; 0.10 with ``num_consts`` and ``num_carry``)."""
    operands = list(operands)
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].update(operands).unpack()
        return list(consts), list(carry), list(xs)
    consts, carry = params["num_consts"], params["num_carry"]
    return operands[:consts], operands[consts:consts + carry], operands[consts + carry:]


def approx_top_k_candidates(input_size: int, rank: int, k: int, recall_target: float, override: int) -> int | None:
    """How many candidates a TPU's ``ApproxTopK`` keeps along the reduction axis before its exact top-k of
    them (jaxlib's ``approx_top_k_reduction_output_size``, what ``aggregate_to_topk=False`` returns); None
    where this jaxlib does not say."""
    try:
        from jax._src.lib import _jax

        return int(_jax.approx_top_k_reduction_output_size(input_size, rank, k, recall_target, False, override)[0])
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


def is_jitted(fn) -> bool:
    return hasattr(fn, "_jit_info") and hasattr(fn, "lower") and hasattr(fn, "__wrapped__")


def jit_options(jitted) -> dict:
    """The options a ``jax.jit``-wrapped function was made with, to re-jit its rewrite alike."""
    import jax.tree_util as tu

    info = jitted._jit_info
    options = {
        "static_argnums": tuple(info.static_argnums),
        "static_argnames": tuple(info.static_argnames),
        "donate_argnums": tuple(info.donate_argnums),
        "donate_argnames": tuple(info.donate_argnames),
        "keep_unused": info.keep_unused,
    }
    for name in ("in_shardings", "out_shardings"):
        leaves = getattr(info, f"{name}_leaves")
        if any(type(l).__name__ != "UnspecifiedValue" for l in leaves):
            options[name] = tu.tree_unflatten(getattr(info, f"{name}_treedef"), leaves)
    return options


# --------------------------------------------------------------------------- primitive definitions
# What ``moe_lowering.primitives`` needs to define JAX primitives with JVP, transpose and batching
# rules (the way ``lax.ragged_dot`` is built). These names are the same in 0.10.2 through 0.12.x; they
# live here so that a later JAX moving them needs one change.

from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402
from jax._src.interpreters import mlir as _mlir  # noqa: E402

Primitive = jex_core.Primitive
ShapedArray = _core.ShapedArray
Zero = _ad.Zero  # a symbolic zero tangent or cotangent
instantiate_zeros = _ad.instantiate_zeros
is_undefined_primal = _ad.is_undefined_primal  # the linear operand of a transpose rule
primitive_jvps = _ad.primitive_jvps
primitive_transposes = _ad.primitive_transposes
primitive_batchers = _batching.primitive_batchers


def varying_axes(aval) -> frozenset:
    """The manual mesh axes ``aval`` varies over (``shard_map``'s ``check_vma`` type); empty outside one."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def vary_over(value, axes: frozenset):
    """``value`` typed as varying over the manual mesh ``axes`` (a ``pvary`` of those it does not vary over
    yet): its values unchanged, and its cotangent summed over them, as JAX does for a replicated operand."""
    missing = axes - varying_axes(jax.typeof(value))
    return _core.pvary(value, tuple(sorted(missing))) if missing else value


def vary_alike(values) -> list:
    """``values`` typed as varying over the same manual mesh axes, the union of theirs: what JAX's own
    ``lax`` functions do to their operands before binding a primitive that requires it."""
    values = list(values)
    axes = frozenset().union(*(varying_axes(jax.typeof(v)) for v in values))
    return [vary_over(v, axes) for v in values] if axes else values


def shaped_array_varying_like(shape, dtype, avals) -> ShapedArray:
    """The aval of a primitive's output computed from ``avals``: varying over every manual axis any of them
    varies over (a value read from one that differs between devices differs too), as JAX's own primitives
    type their outputs under ``shard_map(check_vma=True)``; a plain ``ShapedArray`` where none varies."""
    varying = frozenset().union(*map(varying_axes, avals))
    if not varying:
        return ShapedArray(shape, dtype)
    replicated = _core.get_cur_mesh_sharding(jax.sharding.PartitionSpec(*[None] * len(shape)))
    return ShapedArray(shape, dtype, sharding=replicated, manual_axis_type=_core.ManualAxisType(varying=varying))


def shape_struct(aval) -> jax.ShapeDtypeStruct:
    """``aval`` as an argument to trace with: its shape and type, and the manual axes it varies over, so that
    a region or body traced again inside ``shard_map(check_vma=True)`` types its values as the program did."""
    if not varying_axes(aval):
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding, manual_axis_type=aval.manual_axis_type)


def zero_tangent(value):
    """The symbolic zero tangent of ``value``."""
    return Zero(jax.typeof(value).to_tangent_aval())


def register_lowering(primitive, impl, multiple_results: bool) -> None:
    """Lowers ``primitive`` by tracing ``impl`` (jnp code or kernel calls) on every platform, inline
    at each use (not cached into one shared function per signature), as the code it replaced was.
    ``impl`` is traced on its operands' shapes and types without their varying manual axes: which
    devices' values differ is a type the lowering does not change (``pvary`` lowers to nothing), and
    the kernels' loops start their carries from constants that do not vary."""
    lowered = _mlir.lower_fun(impl, multiple_results=multiple_results)

    def lowering(ctx, *args, **params):
        return lowered(ctx.replace(avals_in=[_without_varying_axes(a) for a in ctx.avals_in]), *args, **params)

    _mlir.register_lowering(primitive, lowering, cacheable=False)


def _without_varying_axes(aval):
    return ShapedArray(aval.shape, aval.dtype, aval.weak_type) if varying_axes(aval) else aval


def distributed_client():
    """``jax.distributed``'s key-value store client (``key_value_set``, ``blocking_key_value_get``),
    or ``None`` outside a multi-process job. Private in every supported JAX (same methods)."""
    from jax._src import distributed

    return distributed.global_state.client



# --------------------------------------------------------------------------- Flax (NNX and Linen)
# Flax is optional: NNX objects (Linen modules) can only be among a call's arguments once the caller
# imported ``flax.nnx`` (``flax.linen``), so it is looked up there and never imported here.
# ``split``/``merge``/``update``, ``graph.is_graph_node`` and Linen's ``lift.pack`` /
# ``decorator_lift_transform`` are the same in Flax 0.10 through 0.12.

def flax_nnx():
    """The ``flax.nnx`` module if the program imported it, else ``None``."""
    import sys

    return sys.modules.get("flax.nnx")


def flax_linen():
    """The ``flax.linen`` module if the program imported it, else ``None``."""
    import sys

    return sys.modules.get("flax.linen")


def nnx_is_graph_node(value) -> bool:
    """Whether ``value`` is a Flax NNX object (module, variable, RNG stream) with state of its own."""
    nnx = flax_nnx()
    return nnx is not None and nnx.graph.is_graph_node(value)


def def_compiled_impl(primitive) -> None:
    """``primitive`` evaluated outside ``jit`` (eager ``jax.grad``, op-by-op) by compiling it alone, as
    JAX's own primitives are: for a primitive that only lowers (a custom call)."""
    primitive.def_impl(functools.partial(_dispatch.apply_primitive, primitive))


def register_custom_call_lowering(primitive, lowering, platform: str) -> None:
    """Lowers ``primitive`` on ``platform`` by ``lowering(ctx, *operands, **params)``, which may call
    :func:`custom_call` (a target registered with ``jax.ffi.register_ffi_target``)."""
    _mlir.register_lowering(primitive, lowering, platform=platform)


def custom_call(call_target_name: str, **kwargs):
    """A ``stablehlo.custom_call`` (legacy API versions, operand-result aliases), looked up when used."""
    return _mlir.custom_call(call_target_name, **kwargs)


def aval_to_ir_type(ctx, aval):
    """The MLIR type of ``aval`` in lowering context ``ctx`` (newer JAX takes the module context)."""
    if _aval_to_ir_type_takes_context():
        return _mlir.aval_to_ir_type(ctx.module_context, aval)
    return _mlir.aval_to_ir_type(aval)


@functools.cache
def _aval_to_ir_type_takes_context() -> bool:
    import inspect

    return "ctx" in inspect.signature(_mlir.aval_to_ir_type).parameters
