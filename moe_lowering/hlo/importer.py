"""StableHLO module -> Python callable built from ``jax.lax`` ops.

The HLO tool does not match MoE layers on MLIR: it interprets the module's ``main`` with JAX
primitives, traces that with ``jax.make_jaxpr`` and hands the jaxpr to the same matcher and
rewrite the decorator uses (one implementation for both entry points). Each op maps to the lax op
JAX itself would have lowered to it (``chlo.top_k`` -> ``lax.top_k``, an iota-indexed variadic
reduce -> ``lax.argmax``, a full-window ``reduce_window`` -> ``lax.cumsum``), so the jaxpr reads
like a traced JAX program. ``func.call`` becomes a named ``jax.jit`` call, keeping calls as calls.

Ops without a lax counterpart and without regions (custom calls, collectives, convolutions...) are
re-emitted verbatim through :data:`stablehlo_passthrough_p`, so they survive the round trip.
``stablehlo.composite`` becomes ``lax.composite`` (same name, version and attributes; its
decomposition is interpreted like any function). Constants Python cannot read through the MLIR
bindings (complex ones raise ``TypeError`` there) are read from their printed form, or re-emitted
as printed through :data:`stablehlo_verbatim_p`. Region-carrying ops the importer does not know
raise :class:`UnsupportedModuleError`.

Each op is interpreted under its own source location (:mod:`moe_lowering.hlo.locations`), so the
traced eqns -- and ``explain``'s report -- name the user's ``file:line`` or op name from the
module's ``loc(...)`` (or an XLA dump's metadata), not this file.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax._src.core import ShapedArray
from jax.extend import core as jex_core
from jax.interpreters import mlir as jax_mlir
from jax._src.interpreters import mlir as jax_mlir_internal
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from moe_lowering import _compat
from moe_lowering.hlo import scan_loops
from moe_lowering.hlo.locations import Locations

log = logging.getLogger(__name__)


class UnsupportedModuleError(ValueError):
    """The module is valid but uses something the importer cannot express in JAX."""


@dataclass(frozen=True)
class ImportedProgram:
    """``fn(*args) -> list`` computing the module's entry function on JAX arrays."""

    name: str
    fn: Callable
    in_avals: tuple  # jax.ShapeDtypeStruct per entry argument
    out_avals: tuple
    needs_x64: bool
    # The module's op locations, as JAX records them on the traced eqns (see ``locations``);
    # ``locations.relabel(report)`` prints the ones a Python frame cannot say.
    locations: Locations = field(default_factory=Locations, compare=False)


_ELEMENT_TYPES = {
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
    "bf16": jnp.bfloat16,
    "i1": np.bool_,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "ui8": np.uint8,
    "ui16": np.uint16,
    "ui32": np.uint32,
    "ui64": np.uint64,
    "complex<f32>": np.complex64,
    "complex<f64>": np.complex128,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz,
}
# Narrow types of newer ml_dtypes/JAX: known when both have them (constants of them are re-emitted
# as printed when numpy cannot read them).
for _mlir_name, _ml_name in (("i4", "int4"), ("ui4", "uint4"), ("i2", "int2"), ("ui2", "uint2"),
                             ("f8E4M3", "float8_e4m3"), ("f8E3M4", "float8_e3m4"),
                             ("f8E8M0FNU", "float8_e8m0fnu"), ("f4E2M1FN", "float4_e2m1fn")):
    if hasattr(ml_dtypes, _ml_name) and hasattr(jnp, _ml_name):
        _ELEMENT_TYPES[_mlir_name] = getattr(ml_dtypes, _ml_name)
_WIDE_TYPES = {"f64", "i64", "ui64", "complex<f64>"}


def _dtype(element_type) -> np.dtype:
    name = str(element_type)
    if name not in _ELEMENT_TYPES:
        raise UnsupportedModuleError(f"unsupported element type {name}")
    return np.dtype(_ELEMENT_TYPES[name])


def _cast(cls, obj):
    """``cls(obj)`` when ``obj`` is one (``isinstance`` on MLIR handles varies by version)."""
    try:
        return cls(obj)
    except (ValueError, TypeError):
        return None


def _tensor_type(mlir_type) -> tuple[tuple[int, ...], np.dtype]:
    tensor = _cast(ir.RankedTensorType, mlir_type)
    if tensor is None:
        raise UnsupportedModuleError(f"unsupported type {mlir_type} (only static ranked tensors)")
    if not tensor.has_static_shape:
        raise UnsupportedModuleError(f"dynamic shape {mlir_type} is not supported")
    return tuple(tensor.shape), _dtype(tensor.element_type)


def _aval(mlir_type) -> jax.ShapeDtypeStruct:
    shape, dtype = _tensor_type(mlir_type)
    return jax.ShapeDtypeStruct(shape, dtype)


# --------------------------------------------------------------------------------------------
# Opaque pass-through: an op re-emitted verbatim in the lowered module.


def _passthrough_abstract_eval(*_, result_avals, **__):
    return [ShapedArray(a.shape, a.dtype) for a in result_avals]


def _passthrough_lowering(ctx, *operands, op_name, attributes, result_types, result_avals):
    del ctx, result_avals
    op = ir.Operation.create(
        op_name,
        results=[ir.Type.parse(t) for t in result_types],
        operands=list(operands),
        attributes={name: ir.Attribute.parse(text) for name, text in attributes},
    )
    return list(op.results)


stablehlo_passthrough_p = jex_core.Primitive("stablehlo_passthrough")
stablehlo_passthrough_p.multiple_results = True
stablehlo_passthrough_p.def_abstract_eval(_passthrough_abstract_eval)
_compat.def_compiled_impl(stablehlo_passthrough_p)  # run outside jit too (an imported program called as is)
jax_mlir.register_lowering(stablehlo_passthrough_p, _passthrough_lowering)


def _verbatim_lowering(ctx, *operands, asm, result_avals):
    """An operand-free op re-parsed from its generic printed form: no attribute passes through Python."""
    del operands, result_avals
    op = ir.Operation.parse(asm, context=ctx.module_context.context)
    ir.InsertionPoint.current.insert(op)
    return list(op.results)


stablehlo_verbatim_p = jex_core.Primitive("stablehlo_verbatim")
stablehlo_verbatim_p.multiple_results = True
stablehlo_verbatim_p.def_abstract_eval(_passthrough_abstract_eval)
_compat.def_compiled_impl(stablehlo_verbatim_p)  # run outside jit too (an imported program called as is)
jax_mlir.register_lowering(stablehlo_verbatim_p, _verbatim_lowering)


@dataclass(frozen=True)
class _AttributeText:
    """An MLIR attribute by its text: a ``lax.composite`` keyword argument re-emitted exactly as read."""

    text: str


jax_mlir_internal.register_attribute_handler(_AttributeText, lambda value: ir.Attribute.parse(value.text))


# --------------------------------------------------------------------------------------------
# Attribute helpers.


def _attr(op, name):
    return op.attributes[name] if name in op.attributes else None


def _ints(attr) -> list[int]:
    if attr is None:
        return []
    for cls in (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr):
        array = _cast(cls, attr)
        if array is not None:
            return [int(v) for v in array]
    dense = _cast(ir.DenseIntElementsAttr, attr)
    if dense is not None:
        return [int(v) for v in np.asarray(dense).reshape(-1)]
    array = _cast(ir.ArrayAttr, attr)
    if array is not None:
        return [int(ir.IntegerAttr(a).value) for a in array]
    integer = _cast(ir.IntegerAttr, attr)
    if integer is not None:
        return [int(integer.value)]
    raise UnsupportedModuleError(f"expected integers, got attribute {attr}")


def _int(op, name, default=None) -> int:
    attr = _attr(op, name)
    if attr is None:
        if default is None:
            raise UnsupportedModuleError(f"{op.name} lacks attribute {name!r}")
        return default
    return _ints(attr)[0]


def _bool(op, name, default=False) -> bool:
    attr = _attr(op, name)
    return default if attr is None else bool(ir.BoolAttr(attr).value)


def _dense_constant(attr, shape, dtype) -> np.ndarray:
    """A dense elements attribute as a numpy array (bf16 and fp8 have no buffer protocol)."""
    dense = ir.DenseElementsAttr(attr)
    if dense.is_splat:
        splat = dense.get_splat_value()
        value = ir.BoolAttr(splat).value if dtype == np.bool_ else _scalar_attr_value(splat)
        return np.full(shape, value, dtype)
    try:
        return np.array(attr, copy=True).astype(dtype).reshape(shape)
    except (ValueError, TypeError, RuntimeError):
        for cls, wide in ((ir.DenseFPElementsAttr, np.float64), (ir.DenseIntElementsAttr, np.int64)):
            flat = _cast(cls, attr)
            if flat is not None:
                return np.array([flat[i] for i in range(len(flat))], wide).astype(dtype).reshape(shape)
        raise UnsupportedModuleError(f"cannot read constant {str(attr)[:80]}") from None


_HEX_TOKEN = r"0x[0-9A-Fa-f]+"
_NUMBER_TOKEN = re.compile(_HEX_TOKEN + r"|[-+]?(?:inf|nan|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)|true|false")


def _constant_from_asm(asm: str, shape, dtype) -> np.ndarray | None:
    """A complex (or other) dense constant read from the op's printed form; None if unreadable.

    The bindings cannot hand complex dense attributes to Python. The printer writes them as
    ``dense<(re,im)>`` (a splat), ``dense<[(re,im), ...]>`` (nested per dimension; NaN and inf as
    hex bit patterns) or ``dense<"0x...">`` (the raw little-endian buffer).
    """
    dtype = np.dtype(dtype)
    match = re.search(r"dense<(.*)>\s*:\s*tensor<", asm, re.S)
    if match is None or dtype.kind not in "fc" or dtype.itemsize not in (4, 8, 16):
        return None
    body = match.group(1).strip()
    size = math.prod(shape)
    if body.startswith('"0x') and body.endswith('"'):
        try:
            flat = np.frombuffer(bytes.fromhex(body[3:-1]), dtype.newbyteorder("<")).astype(dtype)
        except ValueError:
            return None
    else:
        part = np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype
        bits = np.dtype(f"u{part.itemsize}")
        values = []
        for token in _NUMBER_TOKEN.findall(body):
            if token.startswith("0x"):
                values.append(np.array(int(token, 16), bits).view(part))
            elif token in ("true", "false"):
                return None
            else:
                values.append(np.array(float(token), part))
        flat = np.array(values, part)
        if dtype.kind == "c":
            if len(flat) % 2:
                return None
            pairs = flat
            flat = np.empty(len(pairs) // 2, dtype)
            flat.real, flat.imag = pairs[0::2], pairs[1::2]
    if flat.size == 1:
        return np.full(shape, flat[0], dtype)
    return flat.reshape(shape) if flat.size == size else None


def _scalar_attr_value(attr):
    for cls in (ir.FloatAttr, ir.IntegerAttr):
        scalar = _cast(cls, attr)
        if scalar is not None:
            return scalar.value
    raise UnsupportedModuleError(f"cannot read scalar {attr}")


def _enum_text(attr) -> str:
    """``#stablehlo<comparison_direction LT>`` -> ``LT``."""
    return str(attr).rstrip(">").split()[-1]


# --------------------------------------------------------------------------------------------
# Elementwise tables, keyed by op name without its dialect (stablehlo/chlo/mhlo agree on these).

_UNARY = {
    "abs": lax.abs,
    "negate": lax.neg,
    "exponential": lax.exp,
    "exponential_minus_one": lax.expm1,
    "log": lax.log,
    "log_plus_one": lax.log1p,
    "logistic": lax.logistic,
    "tanh": lax.tanh,
    "sqrt": lax.sqrt,
    "rsqrt": lax.rsqrt,
    "cbrt": lax.cbrt,
    "sine": lax.sin,
    "cosine": lax.cos,
    "tan": lax.tan,
    "floor": lax.floor,
    "ceil": lax.ceil,
    "sign": lax.sign,
    "not": lax.bitwise_not,
    "is_finite": lax.is_finite,
    "popcnt": lax.population_count,
    "count_leading_zeros": lax.clz,
    "real": lax.real,
    "imag": lax.imag,
    "round_nearest_afz": functools.partial(lax.round, rounding_method=lax.RoundingMethod.AWAY_FROM_ZERO),
    "round_nearest_even": functools.partial(lax.round, rounding_method=lax.RoundingMethod.TO_NEAREST_EVEN),
    "erf": lax.erf,
    "erfc": lax.erfc,
    "erf_inv": lax.erf_inv,
    "lgamma": lax.lgamma,
    "digamma": lax.digamma,
    "sinh": lax.sinh,
    "cosh": lax.cosh,
    "asin": lax.asin,
    "acos": lax.acos,
    "atan": lax.atan,
    "asinh": lax.asinh,
    "acosh": lax.acosh,
    "atanh": lax.atanh,
    "square": lax.square,
}

_BINARY = {
    "add": lax.add,
    "subtract": lax.sub,
    "multiply": lax.mul,
    "divide": lax.div,
    "remainder": lax.rem,
    "maximum": lax.max,
    "minimum": lax.min,
    "power": lax.pow,
    "atan2": lax.atan2,
    "and": lax.bitwise_and,
    "or": lax.bitwise_or,
    "xor": lax.bitwise_xor,
    "shift_left": lax.shift_left,
    "shift_right_arithmetic": lax.shift_right_arithmetic,
    "shift_right_logical": lax.shift_right_logical,
    "complex": lax.complex,
    "next_after": lax.nextafter,
}

_COMPARE = {"EQ": lax.eq, "NE": lax.ne, "LT": lax.lt, "LE": lax.le, "GT": lax.gt, "GE": lax.ge}

# Reductions whose body is one of these ops on the two block arguments.
_MONOID_REDUCERS = {
    "add": (lax.reduce_sum, lax.add),
    "multiply": (lax.reduce_prod, lax.mul),
    "maximum": (lax.reduce_max, lax.max),
    "minimum": (lax.reduce_min, lax.min),
    "and": (lax.reduce_and, lax.bitwise_and),
    "or": (lax.reduce_or, lax.bitwise_or),
    "xor": (lax.reduce_xor, lax.bitwise_xor),
}
_CUMULATIVE = {"add": lax.cumsum, "multiply": lax.cumprod, "maximum": lax.cummax, "minimum": lax.cummin}
_SCATTERS = {
    "add": lax.scatter_add,
    "multiply": lax.scatter_mul,
    "maximum": lax.scatter_max,
    "minimum": lax.scatter_min,
}

# Ops whose constant-only instances are folded when the result is a scalar, as JAX keeps them.
_FOLD_MAX_SIZE = 1


def _identity(kind: str, dtype) -> object:
    dtype = np.dtype(dtype)
    if kind in ("add", "or", "xor"):
        return np.zeros((), dtype)
    if kind in ("multiply", "and"):
        return np.ones((), dtype)
    if kind == "maximum":
        return np.array(-np.inf, dtype) if dtype.kind == "f" or dtype == jnp.bfloat16 else np.array(_iinfo(dtype).min, dtype)
    if kind == "minimum":
        return np.array(np.inf, dtype) if dtype.kind == "f" or dtype == jnp.bfloat16 else np.array(_iinfo(dtype).max, dtype)
    raise KeyError(kind)


def _iinfo(dtype):
    return np.iinfo(dtype) if dtype != np.bool_ else np.iinfo(np.uint8)


def _short_name(op_name: str) -> str:
    dialect, _, name = op_name.partition(".")
    return name if dialect in ("stablehlo", "chlo", "mhlo") else op_name


def _body_kind(region) -> str | None:
    """``add`` etc. when a 2-argument region returns that op on its two arguments, else None."""
    block = region.blocks[0]
    ops = list(block.operations)
    if len(ops) != 2 or len(block.arguments) != 2:
        return None
    body, ret = ops[0].operation, ops[1].operation
    if len(ret.operands) != 1 or len(body.results) != 1 or ret.operands[0] != body.results[0]:
        return None
    if set(body.operands) != set(block.arguments) or len(body.operands) != 2:
        return None
    kind = _short_name(body.name)
    return kind if kind in _MONOID_REDUCERS else None


def _returned_argument(region) -> int | None:
    """Index of the block argument a region returns unchanged (scatter's ``set``), else None."""
    block = region.blocks[0]
    ops = list(block.operations)
    if len(ops) != 1 or len(ops[0].operation.operands) != 1:
        return None
    returned = ops[0].operation.operands[0]
    for i, arg in enumerate(block.arguments):
        if returned == arg:
            return i
    return None


def _written_row(out: scan_loops.StackedOutput, env):
    """The row a scanned loop's body writes into its stacked buffer ``out`` (a ``ys`` slice)."""
    if out.row is not None:
        return _materialize(env[out.row])
    return lax.reshape(_materialize(env[out.unit]), _tensor_type(out.written.type)[0][1:])


def _is_concrete(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def _as_np_scalar(x):
    return np.asarray(x) if _is_concrete(x) else None


class _Interpreter:
    """Evaluates one module's functions on JAX values; one instance per import."""

    def __init__(self, module: ir.Module, *, keep_calls: bool):
        self.module = module  # op handles below are only valid while the module lives
        self.keep_calls = keep_calls
        self.functions = {}
        for op in module.body.operations:
            if op.operation.name == "func.func":
                self.functions[ir.StringAttr(op.attributes["sym_name"]).value] = op
        self._call_cache: dict[str, Callable] = {}
        self._jit_cache: dict[str, Callable] = {}
        self.locations = Locations()

    # -- functions and blocks ---------------------------------------------------------------

    def function(self, name: str) -> Callable:
        """``fn(*args) -> list`` for the function ``name`` (jit-wrapped when calls are kept)."""
        if name in self._call_cache:
            return self._call_cache[name]
        if name not in self.functions:
            raise UnsupportedModuleError(f"call to unknown function @{name}")
        func_op = self.functions[name]
        if not func_op.regions[0].blocks:
            raise UnsupportedModuleError(f"function @{name} has no body (external declaration)")

        def run(*args):
            return list(self.run_block(func_op.regions[0].blocks[0], args))

        run.__name__ = run.__qualname__ = name.replace(".", "_")
        self._call_cache[name] = run
        return run

    def run_block(self, block, args, parent: "_Env | None" = None) -> list:
        """Evaluate ``block``; ``parent`` holds the values its region may capture from above."""
        env, returned = self.block_env(block, args, parent)
        return [_materialize(env[v]) for v in returned]

    def block_env(self, block, args, parent: "_Env | None" = None, given: dict | None = None):
        """``(env, returned values)`` of ``block`` evaluated; ``given`` maps results to ``fn(env)``
        computing them instead of their op (the op is not evaluated: every result of it is given)."""
        if len(args) != len(block.arguments):
            raise UnsupportedModuleError("block argument count mismatch")
        env = _Env(parent)
        env.update(zip(block.arguments, args))
        logistics = _logistic_candidates(block)
        deferred = {step.results[0]: step for chain in logistics.values() for step in chain}
        for op in block.operations:
            op = op.operation
            if op.name in ("func.return", "stablehlo.return", "mhlo.return"):
                return env, list(op.operands)
            if given and len(op.results) and op.results[0] in given:
                env.update((result, given[result](env)) for result in op.results)
                continue
            if len(op.results) == 1 and op.results[0] in deferred:
                continue
            with self.locations.context(op):  # the eqns it traces name the op's source location
                chain = logistics.get(op.results[0]) if len(op.results) == 1 else None
                results = self.logistic(op, chain, env) if chain else self.eval_op(op, env)
            if len(results) != len(op.results):
                raise UnsupportedModuleError(f"{op.name}: produced {len(results)} values for {len(op.results)} results")
            for result, value in zip(op.results, results):
                env[result] = value
        raise UnsupportedModuleError("block without a terminator")

    def logistic(self, divide, chain, env) -> list:
        """``1 / (1 + exp(-x))`` as ``lax.logistic(x)``, the op JAX lowered it from: its derivative in a
        traced train step is logistic's (``s * (1 - s)``), which the derivative proof re-derives
        from the region. Ones that are not constant ones are evaluated op by op instead."""
        negate, exponential, add = chain
        ones = [env[divide.operands[0]]] + [env[v] for v in add.operands if v != exponential.results[0]]
        if all(isinstance(x, _Broadcast) and x.is_constant_scalar and np.all(x.value == 1) for x in ones):
            return [lax.logistic(_materialize(env[negate.operands[0]]))]
        for step in chain:
            env[step.results[0]] = self.eval_op(step, env)[0]
        return self.eval_op(divide, env)

    def region_fn(self, region, env) -> Callable:
        block = region.blocks[0]
        return lambda *args: self.run_block(block, args, env)

    # -- ops --------------------------------------------------------------------------------

    def eval_op(self, op, env) -> list:
        try:
            operands = [env[v] for v in op.operands]
        except KeyError:
            raise UnsupportedModuleError(f"{op.name}: operand defined outside its scope") from None
        name = _short_name(op.name)
        if any(isinstance(x, _Broadcast) for x in operands):
            operands = self._resolve_broadcasts(op, name, operands, env)
            if isinstance(operands, tuple):  # folded to a constant broadcast
                return list(operands)
        if (
            len(op.regions) == 0
            and operands
            and all(_is_concrete(x) for x in operands)
            and all(math.prod(_tensor_type(r.type)[0]) <= _FOLD_MAX_SIZE for r in op.results)
            and (name in _UNARY or name in _BINARY or name in _FOLDABLE)
        ):
            with jax.ensure_compile_time_eval():
                return [np.asarray(v) for v in self._dispatch(op, name, operands, env)]
        return self._dispatch(op, name, operands, env)

    def _resolve_broadcasts(self, op, name, operands, env):
        """Operands with pending broadcasts resolved the way a traced JAX program has them.

        Elementwise ops take the un-broadcast value (a scalar, or size-1 dimensions lax broadcasts
        implicitly); ops on constant scalars stay folded; anything else gets the full tensor.
        Returns a tuple of results instead when the whole op folded.
        """
        out_shape = _tensor_type(op.results[0].type)[0] if len(op.results) == 1 else None
        scalars = all(isinstance(x, _Broadcast) and x.is_constant_scalar for x in operands)
        if scalars and (name in _ELEMENTWISE or name == "broadcast_in_dim"):
            if name == "broadcast_in_dim":
                return (_Broadcast(operands[0].value, out_shape),)
            with jax.ensure_compile_time_eval():
                values = self._dispatch(op, name, [x.value for x in operands], env)
            return tuple(_Broadcast(np.asarray(v), _tensor_type(r.type)[0]) for v, r in zip(values, op.results))
        if name in _ELEMENTWISE and len(operands) > 1:
            values = [x.value if isinstance(x, _Broadcast) else x for x in operands]
            if name == "clamp":
                values = [v if i == 1 or np.ndim(v) == 0 else _materialize(operands[i]) for i, v in enumerate(values)]
                values[1] = _materialize(operands[1])
                return values
            try:
                if tuple(np.broadcast_shapes(*(np.shape(v) for v in values))) == out_shape:
                    return values
            except ValueError:
                pass
        return [_materialize(x) for x in operands]

    def _dispatch(self, op, name, operands, env) -> list:
        if name in _UNARY and len(operands) == 1:
            return [_UNARY[name](operands[0])]
        if name in _BINARY and len(operands) == 2:
            return [_BINARY[name](*operands)]
        handler = getattr(self, "op_" + name, None) if op.name.split(".")[0] in ("stablehlo", "chlo", "mhlo") else None
        if op.name == "func.call":
            handler = self.op_call
        elif op.name == "sdy.sharding_constraint":
            handler = self.op_sharding_constraint
        if handler is not None:
            return handler(op, operands, env)
        return self.passthrough(op, operands)

    def passthrough(self, op, operands) -> list:
        if len(op.regions):
            raise UnsupportedModuleError(f"unsupported op {op.name}")
        for attr_name in ("called_computations",):
            attr = _attr(op, attr_name)
            if attr is not None and len(ir.ArrayAttr(attr)):
                raise UnsupportedModuleError(f"{op.name} calls other functions; not supported")
        log.debug("re-emitting %s verbatim", op.name)
        try:
            attributes = tuple((name, str(op.attributes[name])) for name in _attribute_names(op))
        except TypeError:  # an attribute the bindings cannot hand to Python (complex elements...)
            return self.verbatim(op)
        result_types = tuple(str(r.type) for r in op.results)
        result_avals = tuple(_aval(r.type) for r in op.results)
        return stablehlo_passthrough_p.bind(
            *operands, op_name=op.name, attributes=attributes, result_types=result_types, result_avals=result_avals
        )

    def op_constant(self, op, operands, env):
        shape, dtype = _tensor_type(op.results[0].type)
        try:
            return [_dense_constant(op.attributes["value"], shape, dtype)]
        except (TypeError, ValueError, OverflowError, UnsupportedModuleError) as err:
            # Complex constants: the bindings raise TypeError handing the attribute to Python.
            value = _constant_from_asm(_generic_asm(op), shape, dtype)
            if value is not None:
                return [value]
            log.debug("constant %s is re-emitted as printed (%s)", op.results[0].type, err)
            return self.verbatim(op)

    def verbatim(self, op) -> list:
        """An operand-free op (a constant the bindings cannot read) re-emitted from its printed form."""
        if len(op.operands) or len(op.regions):
            raise UnsupportedModuleError(f"{op.name}: cannot read its attributes")
        result_avals = tuple(_aval(r.type) for r in op.results)
        return stablehlo_verbatim_p.bind(asm=_generic_asm(op), result_avals=result_avals)

    def op_iota(self, op, operands, env):
        shape, dtype = _tensor_type(op.results[0].type)
        return [lax.broadcasted_iota(dtype, shape, _int(op, "iota_dimension"))]

    def op_broadcast_in_dim(self, op, operands, env):
        shape, _ = _tensor_type(op.results[0].type)
        x = operands[0]
        dims = _ints(_attr(op, "broadcast_dimensions"))
        if _is_concrete(x) and np.ndim(x) == 0 and math.prod(shape) > _FOLD_MAX_SIZE:
            return [_Broadcast(np.asarray(x), shape)]
        if dims == sorted(dims) and len(set(dims)) == len(dims) and np.ndim(x) > 0:
            # Increasing dims: the broadcast is an expand_dims to rank(shape) then size-1 broadcasting.
            in_shape = np.shape(x)
            compact = [1] * len(shape)
            for d, size in zip(dims, in_shape):
                compact[d] = size
            if tuple(compact) != shape:
                source = _defining_op(op.operands[0])
                if source is not None and _short_name(source.name) == "iota" and np.ndim(x) == 1:
                    value = lax.broadcasted_iota(np.dtype(x.dtype), compact, dims[0])
                elif list(in_shape) == compact:
                    value = x
                else:
                    value = lax.broadcast_in_dim(x, compact, dims)
                return [_Broadcast(value, shape, lambda: lax.broadcast_in_dim(x, shape, dims))]
        return [lax.broadcast_in_dim(x, shape, dims)]

    def op_reshape(self, op, operands, env):
        shape, _ = _tensor_type(op.results[0].type)
        return [lax.reshape(operands[0], shape)]

    def op_transpose(self, op, operands, env):
        return [lax.transpose(operands[0], _ints(_attr(op, "permutation")))]

    def op_convert(self, op, operands, env):
        _, dtype = _tensor_type(op.results[0].type)
        return [lax.convert_element_type(operands[0], dtype)]

    def op_bitcast_convert(self, op, operands, env):
        _, dtype = _tensor_type(op.results[0].type)
        return [lax.bitcast_convert_type(operands[0], dtype)]

    def op_reduce_precision(self, op, operands, env):
        return [lax.reduce_precision(operands[0], _int(op, "exponent_bits"), _int(op, "mantissa_bits"))]

    def op_compare(self, op, operands, env):
        return [_COMPARE[_enum_text(op.attributes["comparison_direction"])](*operands)]

    def op_select(self, op, operands, env):
        pred, on_true, on_false = operands
        shape, _ = _tensor_type(op.results[0].type)
        if np.ndim(pred) == 0 and shape:
            pred = lax.broadcast(pred, shape)
        return [lax.select(pred, on_true, on_false)]

    def op_clamp(self, op, operands, env):
        low, x, high = operands
        return [lax.clamp(low, x, high)]

    def op_concatenate(self, op, operands, env):
        return [lax.concatenate(operands, _int(op, "dimension"))]

    def op_slice(self, op, operands, env):
        return [
            lax.slice(
                operands[0], _ints(_attr(op, "start_indices")), _ints(_attr(op, "limit_indices")), _ints(_attr(op, "strides"))
            )
        ]

    def op_dynamic_slice(self, op, operands, env):
        return [lax.dynamic_slice(operands[0], operands[1:], _ints(_attr(op, "slice_sizes")))]

    def op_dynamic_update_slice(self, op, operands, env):
        return [lax.dynamic_update_slice(operands[0], operands[1], operands[2:])]

    def op_pad(self, op, operands, env):
        config = list(zip(_ints(_attr(op, "edge_padding_low")), _ints(_attr(op, "edge_padding_high")), _ints(_attr(op, "interior_padding"))))
        return [lax.pad(operands[0], operands[1], config)]

    def op_reverse(self, op, operands, env):
        return [lax.rev(operands[0], _ints(_attr(op, "dimensions")))]

    def op_optimization_barrier(self, op, operands, env):
        return list(lax.optimization_barrier(tuple(operands)))

    def op_tuple(self, op, operands, env):
        return [tuple(operands)]

    def op_get_tuple_element(self, op, operands, env):
        return [operands[0][_int(op, "index")]]

    def op_sharding_constraint(self, op, operands, env):
        mesh = str(_attr(op, "sharding"))
        log.debug("dropping sharding constraint %s", mesh)
        return [operands[0]]

    # -- contractions ---------------------------------------------------------------------------

    def op_dot_general(self, op, operands, env):
        dims = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        contracting = (list(dims.lhs_contracting_dimensions), list(dims.rhs_contracting_dimensions))
        batch = (list(dims.lhs_batching_dimensions), list(dims.rhs_batching_dimensions))
        return [self._dot(op, operands, (contracting, batch))]

    def op_dot(self, op, operands, env):
        lhs, _ = operands
        dimension_numbers = (([np.ndim(lhs) - 1], [0]), ([], []))
        return [self._dot(op, operands, dimension_numbers)]

    def _dot(self, op, operands, dimension_numbers):
        _, out_dtype = _tensor_type(op.results[0].type)
        precision = None
        config = _attr(op, "precision_config")
        if config is not None:
            names = [_enum_text(a) for a in ir.ArrayAttr(config)]
            if any(n != "DEFAULT" for n in names):
                precision = tuple(lax.Precision[n] for n in names)
        lhs, rhs = operands
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=out_dtype)

    # -- routing ops ------------------------------------------------------------------------------

    def op_top_k(self, op, operands, env):
        return list(lax.top_k(operands[0], _int(op, "k")))

    def op_topk(self, op, operands, env):
        if not _bool(op, "largest", True):
            raise UnsupportedModuleError("mhlo.topk with largest=false is not supported")
        return self.op_top_k(op, operands, env)

    def op_sort(self, op, operands, env):
        dimension = _int(op, "dimension", -1) % np.ndim(operands[0])
        stable = _bool(op, "is_stable", False)
        key, descending = _sort_key(op.regions[0], len(operands))
        if descending:
            ordered = [_order_reversing(operands[key])] + list(operands)
            return list(lax.sort(ordered, dimension=dimension, is_stable=stable, num_keys=1))[1:]
        order = [key] + [i for i in range(len(operands)) if i != key]
        results = lax.sort([operands[i] for i in order], dimension=dimension, is_stable=stable, num_keys=1)
        by_position = dict(zip(order, results))
        return [by_position[i] for i in range(len(operands))]

    # -- reductions ----------------------------------------------------------------------------------

    def op_reduce(self, op, operands, env):
        n = len(operands) // 2
        inputs, inits = operands[:n], operands[n:]
        dims = tuple(_ints(_attr(op, "dimensions")))
        region = op.regions[0]
        if n == 1:
            kind = _body_kind(region)
            if kind is not None:
                reduce_fn, combine = _MONOID_REDUCERS[kind]
                out = reduce_fn(inputs[0], dims)
                init = _as_np_scalar(inits[0])
                if init is None or not np.array_equal(init, _identity(kind, init.dtype)):
                    out = combine(out, inits[0])
                return [out]
        if n == 2 and len(dims) == 1:
            arg = _arg_reduction(op, region, dims[0])
            if arg is not None:
                value_fn, index_fn = arg
                index = index_fn(inputs[0], dims[0], np.dtype(_tensor_type(op.results[1].type)[1]))
                value = value_fn(inputs[0], dims) if len(list(op.results[0].uses)) else None
                return [value, index]
        body = self.region_fn(region, env)

        def computation(xs, ys):
            xs = xs if isinstance(xs, tuple) else (xs,)
            ys = ys if isinstance(ys, tuple) else (ys,)
            out = body(*xs, *ys)
            return tuple(out) if n > 1 else out[0]

        out = lax.reduce(tuple(inputs) if n > 1 else inputs[0], tuple(inits) if n > 1 else inits[0], computation, dims)
        return list(out) if n > 1 else [out]

    def op_reduce_window(self, op, operands, env):
        if len(operands) != 2:
            raise UnsupportedModuleError("variadic reduce_window is not supported")
        x, init = operands
        shape = np.shape(x)
        rank = len(shape)
        window = _ints(_attr(op, "window_dimensions"))
        strides = _ints(_attr(op, "window_strides")) or [1] * rank
        base_dilation = _ints(_attr(op, "base_dilations")) or [1] * rank
        window_dilation = _ints(_attr(op, "window_dilations")) or [1] * rank
        padding_flat = _ints(_attr(op, "padding")) or [0] * (2 * rank)
        padding = [tuple(padding_flat[2 * i : 2 * i + 2]) for i in range(rank)]
        kind = _body_kind(op.regions[0])
        init_value = _as_np_scalar(init)
        identity_init = kind is not None and init_value is not None and np.array_equal(init_value, _identity(kind, init_value.dtype))
        if identity_init and kind in _CUMULATIVE and all(s == 1 for s in strides + base_dilation + window_dilation):
            long_axes = [i for i in range(rank) if window[i] != 1 or padding[i] != (0, 0)]
            if len(long_axes) == 1:
                axis = long_axes[0]
                n = shape[axis]
                if window[axis] == n and padding[axis] in ((n - 1, 0), (0, n - 1)):
                    return [_CUMULATIVE[kind](x, axis, reverse=padding[axis] == (0, n - 1))]
        computation = _MONOID_REDUCERS[kind][1] if kind is not None else (lambda a, b: self.region_fn(op.regions[0], env)(a, b)[0])
        return [lax.reduce_window(x, init, computation, window, strides, padding, base_dilation, window_dilation)]

    # -- indexing -------------------------------------------------------------------------------------

    def op_gather(self, op, operands, env):
        operand, indices = operands
        dims = stablehlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
        indices, batching = _index_vector_last(indices, dims.index_vector_dim, list(dims.start_indices_batching_dims))
        dimension_numbers = lax.GatherDimensionNumbers(
            offset_dims=tuple(dims.offset_dims),
            collapsed_slice_dims=tuple(dims.collapsed_slice_dims),
            start_index_map=tuple(dims.start_index_map),
            operand_batching_dims=tuple(dims.operand_batching_dims),
            start_indices_batching_dims=tuple(batching),
        )
        return [
            lax.gather(
                operand,
                indices,
                dimension_numbers,
                tuple(_ints(_attr(op, "slice_sizes"))),
                indices_are_sorted=_bool(op, "indices_are_sorted"),
                mode=lax.GatherScatterMode.CLIP,
            )
        ]

    def op_scatter(self, op, operands, env):
        if len(operands) != 3:
            raise UnsupportedModuleError("variadic scatter is not supported")
        operand, indices, updates = operands
        region = op.regions[0]
        kind = _body_kind(region)
        returned = _returned_argument(region)
        dims = stablehlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
        indices, batching = _index_vector_last(indices, dims.index_vector_dim, list(dims.scatter_indices_batching_dims))
        dimension_numbers = lax.ScatterDimensionNumbers(
            update_window_dims=tuple(dims.update_window_dims),
            inserted_window_dims=tuple(dims.inserted_window_dims),
            scatter_dims_to_operand_dims=tuple(dims.scattered_dims_to_operand_dims),
            operand_batching_dims=tuple(dims.input_batching_dims),
            scatter_indices_batching_dims=tuple(batching),
        )
        kwargs = dict(
            indices_are_sorted=_bool(op, "indices_are_sorted"),
            unique_indices=_bool(op, "unique_indices"),
            mode=lax.GatherScatterMode.FILL_OR_DROP,
        )
        if returned == 1:
            return [lax.scatter(operand, indices, updates, dimension_numbers, **kwargs)]
        if returned == 0:
            return [operand]
        if kind in _SCATTERS:
            return [_SCATTERS[kind](operand, indices, updates, dimension_numbers, **kwargs)]
        raise UnsupportedModuleError("scatter with a custom update computation is not supported")

    # -- control flow ------------------------------------------------------------------------------------

    def op_while(self, op, operands, env):
        loop = scan_loops.recognise(op, operands, outer=functools.partial(self._concrete_outer, env),
                                    fold=self._fold_scalars, functions=self.functions)
        if loop:
            log.info("a while loop is lax.scan of length %d%s", loop.length, " (reverse)" if loop.reverse else "")
            return self._scan(op, loop, operands, env)
        log.debug("a while loop stays a while loop: %s", loop.reason)
        cond_block = op.regions[0].blocks[0]
        body_block = op.regions[1].blocks[0]

        def cond_fun(carry):
            return self.run_block(cond_block, carry, env)[0]

        def body_fun(carry):
            return tuple(self.run_block(body_block, carry, env))

        return list(lax.while_loop(cond_fun, body_fun, tuple(operands)))

    def _scan(self, op, loop: scan_loops.ScanLoop, operands, env) -> list:
        """``lax.scan`` of the loop's body: each row read is the scan's slice of its array, each stacked
        buffer's written row a ``ys`` output; the counter and the row indices are not evaluated."""
        block = op.regions[1].blocks[0]
        arrays = list(dict.fromkeys(read.array for read in loop.reads))
        position = {arg: k for k, arg in enumerate(block.arguments)}
        xs = [_materialize(operands[position[a]] if a in position else env[a]) for a in arrays]
        init = [_materialize(operands[k]) for k in loop.carries]
        dropped = {loop.counter} | {out.position for out in loop.stacked}  # never read by what is evaluated

        def body(carry, slices):
            args = [None if k in dropped else value for k, value in enumerate(operands)]
            for k, value in zip(loop.carries, carry):
                args[k] = value
            row = dict(zip(arrays, slices))
            given = dict.fromkeys(loop.skipped, lambda _: None)
            for read in loop.reads:
                value = lax.reshape(row[read.array], _tensor_type(read.value.type)[0])
                given[read.value] = lambda _, value=value: value
            for out in loop.stacked:
                given[out.written] = functools.partial(_written_row, out)
            inner, returned = self.block_env(block, args, env, given)
            return ([_materialize(inner[returned[k]]) for k in loop.carries],
                    [inner[returned[out.position]] for out in loop.stacked])

        carry, stacked = lax.scan(body, init, xs, length=loop.length, reverse=loop.reverse)
        results = list(operands)
        results[loop.counter] = loop.final_counter
        for k, value in zip(loop.carries, carry):
            results[k] = value
        for out, value in zip(loop.stacked, stacked):
            results[out.position] = value
        return results

    def _concrete_outer(self, env, value):
        """A value from above a loop, when concrete (a constant); else None (``KeyError``: not from above)."""
        found = env[value]
        if isinstance(found, _Broadcast):
            return np.broadcast_to(found.value, found.shape) if _is_concrete(found.value) else None
        return found if _is_concrete(found) else None

    def _fold_scalars(self, op, operands) -> list | None:
        """``op``'s results on concrete operands when they are integer or boolean scalars (a loop's row indices)
        of an op folded as constants are."""
        name = _short_name(op.name)
        if len(op.regions) or not (name in _UNARY or name in _BINARY or name in _FOLDABLE or name == "constant"):
            return None
        if any(math.prod(_tensor_type(r.type)[0]) != 1 or _tensor_type(r.type)[1].kind not in "iub" for r in op.results):
            return None
        env = _Env()
        env.update(zip(op.operands, operands))
        with jax.ensure_compile_time_eval():
            results = self._dispatch(op, name, list(operands), env)
        return [np.broadcast_to(r.value, r.shape) if isinstance(r, _Broadcast) else np.asarray(r) for r in results]

    def op_case(self, op, operands, env):
        (index,) = operands
        branches = [functools.partial(self._run_branch, region, env) for region in op.regions]
        predicate = self._bool_behind_convert(op, env)
        if predicate is not None and len(branches) == 2:
            return list(lax.cond(predicate, branches[1], branches[0]))
        n = len(branches)
        index = jnp.where((index < 0) | (index >= n), n - 1, index)
        return list(lax.switch(index, branches))

    def op_if(self, op, operands, env):
        (pred,) = operands
        true_branch = functools.partial(self._run_branch, op.regions[0], env)
        false_branch = functools.partial(self._run_branch, op.regions[1], env)
        return list(lax.cond(pred, true_branch, false_branch))

    def _run_branch(self, region, env):
        return tuple(self.run_block(region.blocks[0], (), env))

    def _bool_behind_convert(self, op, env):
        """The ``i1`` behind ``case(convert(pred))``: JAX lowers ``lax.cond`` to exactly that."""
        defining = _defining_op(op.operands[0])
        if defining is None or _short_name(defining.name) != "convert":
            return None
        source = defining.operands[0]
        if str(ir.RankedTensorType(source.type).element_type) != "i1":
            return None
        return env[source]

    def op_call(self, op, operands, env):
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        fn = self.function(callee)
        if self.keep_calls:
            if callee not in self._jit_cache:
                self._jit_cache[callee] = jax.jit(fn)
            fn = self._jit_cache[callee]
        return list(fn(*operands))

    def op_composite(self, op, operands, env):
        """``lax.composite`` with the same name, version and attributes, and this decomposition."""
        extra = set(_attribute_names(op)) - {"name", "decomposition", "version", "composite_attributes"}
        if extra:
            raise UnsupportedModuleError(f"stablehlo.composite with attributes {sorted(extra)} is not supported")
        name = ir.StringAttr(op.attributes["name"]).value
        callee = ir.FlatSymbolRefAttr(op.attributes["decomposition"]).value
        version = _int(op, "version", 0)
        attributes = _composite_attributes(op)
        top_k = _composite_top_k(name, attributes, op)
        if top_k is not None:
            return list(lax.top_k(operands[0], top_k))
        body = self.function(callee)

        def decomposition(*args, **_):  # the attributes are the op's; the body does not read them
            return body(*args)

        decomposition.__name__ = decomposition.__qualname__ = callee.replace(".", "_")
        return list(lax.composite(decomposition, name=name, version=version)(*operands, **attributes))

    def op_custom_call(self, op, operands, env):
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if target in ("mhlo.topk", "TopK") and len(op.results) == 2:
            k = _tensor_type(op.results[0].type)[0][-1]
            return list(lax.top_k(operands[0], k))
        if target == "ApproxTopK" and len(op.results) == 2:
            approx = self._approx_top_k(op, operands)
            if approx is not None:
                return approx
        return self.passthrough(op, operands)

    def _approx_top_k(self, op, operands):
        """``lax.approx_max_k`` / ``approx_min_k`` as JAX lowers them: an ``ApproxTopK`` custom call on
        (scores, iota, init value, -1) whose comparator is one ``compare GT`` (max) or ``LT`` (min) of the
        two scores; its parameters from ``mhlo.backend_config``. ``None`` for any other form."""
        try:
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            [callee] = [ir.FlatSymbolRefAttr(a).value for a in ir.ArrayAttr(op.attributes["called_computations"])]
        except (KeyError, ValueError, TypeError):
            return None
        body = self.functions.get(callee)
        ops = list(body.regions[0].blocks[0].operations) if body is not None else []
        block_args = list(body.regions[0].blocks[0].arguments) if body is not None else []
        if len(ops) != 2 or ops[0].operation.name != "stablehlo.compare" or len(block_args) != 4:
            return None
        if list(ops[0].operands) != block_args[:2]:
            return None
        direction = str(ops[0].attributes["comparison_direction"])
        if "GT" not in direction and "LT" not in direction:
            return None
        approx = lax.approx_max_k if "GT" in direction else lax.approx_min_k
        return list(approx(
            operands[0], ir.IntegerAttr(config["top_k"]).value,
            reduction_dimension=ir.IntegerAttr(config["reduction_dim"]).value,
            recall_target=ir.FloatAttr(config["recall_target"]).value,
            aggregate_to_topk=ir.BoolAttr(config["aggregate_to_topk"]).value,
            reduction_input_size_override=ir.IntegerAttr(config["reduction_input_size_override"]).value))


# Ops lax lets take a scalar (or size-1 dimensions) for a full tensor operand.
_ELEMENTWISE = set(_UNARY) | set(_BINARY) | {"compare", "clamp", "convert"}

_FOLDABLE = {
    "broadcast_in_dim",
    "reshape",
    "convert",
    "compare",
    "select",
    "clamp",
    "slice",
    "transpose",
}


def _attribute_names(op) -> list[str]:
    """Attribute names; iterating ``op.attributes`` yields names or NamedAttributes by version."""
    keys = getattr(op.attributes, "keys", None)
    if keys is not None:  # names only: building a NamedAttribute can abort on an unreadable value
        return list(keys())
    return [item if isinstance(item, str) else item.name for item in op.attributes]


def _generic_asm(op) -> str:
    """``"dialect.op"(...) <{...}> : (...) -> ...`` without the ``%name =`` of its results."""
    asm = op.get_asm(print_generic_op_form=True).strip()
    return re.sub(r"^%[^=]*=\s*", "", asm) if asm.startswith("%") else asm


def _composite_top_k(name: str, attributes: dict, op) -> int | None:
    """``k`` of the ``chlo.top_k`` composite ``jax.export`` serializes ``lax.top_k`` as (portable
    artifacts hold no chlo ops): a largest-first top k of the last axis, as ``lax.top_k``;
    ``None`` for any other composite, or a ``largest = false`` one (kept as a composite)."""
    if name != "chlo.top_k" or len(op.operands) != 1 or len(op.results) != 2:
        return None
    values = {key: attribute.text.split(":")[0].strip() for key, attribute in attributes.items()}
    if values.get("largest", "true") != "true" or not values.get("k", "").isdigit():
        return None
    return int(values["k"])


def _composite_attributes(op) -> dict:
    """``composite_attributes`` as ``{name: _AttributeText}``, each checked to re-parse."""
    attr = _attr(op, "composite_attributes")
    if attr is None:
        return {}
    dictionary = ir.DictAttr(attr)
    names = _dict_attr_names(str(attr))
    if len(names) != len(dictionary) or not all(n in dictionary for n in names):
        raise UnsupportedModuleError(f"cannot read the composite attributes {str(attr)[:80]}")
    out = {}
    for name in names:
        try:
            text = str(dictionary[name])
            ir.Attribute.parse(text, context=op.context)
        except (TypeError, ValueError, ir.MLIRError) as err:
            raise UnsupportedModuleError(f"composite attribute {name!r} cannot be re-emitted ({err})") from None
        out[name] = _AttributeText(text)
    return out


def _dict_attr_names(text: str) -> list[str]:
    """The keys of a printed dictionary attribute ``{a = 1 : i32, "b.c" = [..], unit_key}``."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        return []
    body = body[1:-1]
    entries, depth, start, i, quoted = [], 0, 0, 0, False
    while i < len(body):
        c = body[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "([{<":
            depth += 1
        elif c in ")]}>" and not (c == ">" and body[i - 1 : i] == "-"):
            depth -= 1
        elif c == "," and depth == 0:
            entries.append(body[start:i])
            start = i + 1
        i += 1
    entries.append(body[start:])
    names = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        key = entry.split("=", 1)[0].strip() if not entry.startswith('"') else entry[: _closing_quote(entry) + 1]
        if key.startswith('"'):
            key = bytes(key[1:-1], "utf-8").decode("unicode_escape")
        names.append(key)
    return names


def _closing_quote(text: str) -> int:
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return len(text) - 1


@dataclass(frozen=True)
class _Broadcast:
    """``value`` (a constant scalar, or a tensor with size-1 dimensions) pending a broadcast to ``shape``.

    StableHLO spells out every broadcast; a traced JAX program lets elementwise ops take a
    scalar or size-1 dimensions (``mul x 0.5:f32[]``, ``eq idx[T,k,1] iota[1,1,E]``). Deferring
    the broadcast to the consumer reproduces that form, which is the one the matcher knows.
    """

    value: object
    shape: tuple[int, ...]
    full: Callable | None = None  # builds the broadcast tensor itself, when not consumed elementwise

    @property
    def is_constant_scalar(self) -> bool:
        return _is_concrete(self.value) and np.ndim(self.value) == 0


def _materialize(x):
    if not isinstance(x, _Broadcast):
        return x
    if x.full is not None:
        return x.full()
    if np.ndim(x.value) == 0:
        return lax.broadcast_in_dim(x.value, x.shape, ())
    return lax.broadcast_in_dim(x.value, x.shape, tuple(range(len(x.shape))))


class _Env(dict):
    """Values by MLIR value; a region sees its enclosing block's values through ``parent``."""

    def __init__(self, parent=None):
        super().__init__()
        self.parent = parent

    def __missing__(self, key):
        if self.parent is None:
            raise KeyError(key)
        return self.parent[key]


def _defining_op(value):
    """The operation producing ``value``, or None for a block argument."""
    owner = value.owner
    return None if isinstance(owner, ir.Block) else getattr(owner, "operation", owner)


def _sole_user(value, name: str):
    """The one op using ``value``, when it is the stablehlo op ``name``."""
    users = [use.owner for use in value.uses]
    if len(users) != 1 or getattr(users[0], "operation", users[0]).name != f"stablehlo.{name}":
        return None
    return getattr(users[0], "operation", users[0])


def _logistic_candidates(block) -> dict:
    """Divides of the form ``c / (c' + exp(-x))`` in ``block``, by result: ``(negate, exponential, add)``,
    each used only by the next (whether ``c`` and ``c'`` are ones is known only when evaluated)."""
    found = {}
    for op in block.operations:
        op = op.operation
        if op.name != "stablehlo.negate":
            continue
        exponential = _sole_user(op.results[0], "exponential")
        add = exponential and _sole_user(exponential.results[0], "add")
        divide = add and _sole_user(add.results[0], "divide")
        if divide and divide.operands[1] == add.results[0] and add.operands[0] != add.operands[1]:
            found[divide.results[0]] = (op, exponential, add)
    return found


def _index_vector_last(indices, index_vector_dim: int, batching: list[int]):
    """Indices with the index vector in the last dimension, as ``lax.gather``/``scatter`` require."""
    rank = np.ndim(indices)
    if index_vector_dim == rank:
        return lax.expand_dims(indices, (rank,)), batching
    if index_vector_dim == rank - 1:
        return indices, batching
    perm = [d for d in range(rank) if d != index_vector_dim] + [index_vector_dim]
    remapped = [d - 1 if d > index_vector_dim else d for d in batching]
    return lax.transpose(indices, perm), remapped


def _block_argument_index(value) -> int | None:
    return value.arg_number if isinstance(value, ir.BlockArgument) else None


def _depends_on(value) -> set[int]:
    """Indices of the comparator block arguments ``value`` is computed from."""
    index = _block_argument_index(value)
    if index is not None:
        return {index}
    owner = _defining_op(value)
    found: set[int] = set()
    for operand in owner.operands:
        found |= _depends_on(operand)
    return found


def _sort_key(region, num_operands: int) -> tuple[int, bool]:
    """``(operand index, descending)`` of a single-key sort comparator; else unsupported.

    JAX's comparators canonicalise floats (``-0 -> 0``, NaNs) with selects before one ``LT``;
    ``lax.sort`` emits the same canonicalisation, so only the compared pair and direction matter.
    """
    block = region.blocks[0]
    terminator = list(block.operations)[-1].operation
    result = terminator.operands[0]
    compare = _defining_op(result)
    if compare is None or _short_name(compare.name) != "compare":
        raise UnsupportedModuleError("sort comparator is not a single comparison (multi-key sorts unsupported)")
    direction = _enum_text(compare.attributes["comparison_direction"])
    lhs, rhs = (_depends_on(v) for v in compare.operands)
    if len(lhs) != 1 or len(rhs) != 1 or direction not in ("LT", "GT"):
        raise UnsupportedModuleError("unsupported sort comparator")
    (a,), (b,) = lhs, rhs
    if a // 2 != b // 2 or a == b or a // 2 >= num_operands:
        raise UnsupportedModuleError("unsupported sort comparator")
    ascending = (a < b) == (direction == "LT")
    return a // 2, not ascending


def _order_reversing(keys):
    """A key whose ascending order is ``keys``' descending order (stable ties preserved)."""
    dtype = np.dtype(keys.dtype)
    if dtype.kind in "iu":
        return lax.bitwise_not(keys)
    if dtype == np.bool_:
        return lax.bitwise_not(keys)
    return lax.neg(keys)


def _arg_reduction(op, region, axis: int):
    """``(value_fn, index_fn)`` when ``op`` is JAX's argmax/argmin lowering over ``axis``."""
    index_source = op.operands[1]
    if not _is_iota_along(index_source, axis):
        return None
    kinds = {
        _enum_text(o.operation.attributes["comparison_direction"])
        for o in region.blocks[0].operations
        if _short_name(o.operation.name) == "compare"
        and {_block_argument_index(v) for v in o.operation.operands} == {0, 2}
    } - {"EQ", "NE"}
    if kinds == {"GT"}:
        return (lax.reduce_max, lambda x, a, dt: lax.argmax(x, a, dt))
    if kinds == {"LT"}:
        return (lax.reduce_min, lambda x, a, dt: lax.argmin(x, a, dt))
    return None


def _is_iota_along(value, axis: int) -> bool:
    owner = _defining_op(value)
    if owner is None:
        return False
    name = _short_name(owner.name)
    if name == "iota":
        return _int(owner, "iota_dimension") == axis
    if name == "broadcast_in_dim":
        dims = _ints(_attr(owner, "broadcast_dimensions"))
        source = owner.operands[0]
        source_owner = _defining_op(source)
        if source_owner is not None and _short_name(source_owner.name) == "iota":
            return dims[_int(source_owner, "iota_dimension")] == axis
    return False


def import_module(module: ir.Module, *, entry: str = "main", keep_calls: bool = True) -> ImportedProgram:
    """The module's ``entry`` function as a JAX callable (see the module docstring)."""
    interpreter = _Interpreter(module, keep_calls=keep_calls)
    if entry not in interpreter.functions:
        raise UnsupportedModuleError(f"module has no @{entry} function")
    func_type = ir.FunctionType(ir.TypeAttr(interpreter.functions[entry].attributes["function_type"]).value)
    in_avals = tuple(_aval(t) for t in func_type.inputs)
    out_avals = tuple(_aval(t) for t in func_type.results)
    body = interpreter.function(entry)
    default_location = interpreter.locations.default

    def fn(*args):
        with default_location():  # for ops without a location of their own
            return body(*args)

    fn.__name__ = fn.__qualname__ = _module_name(module)
    needs_x64 = any(str(a.dtype) in ("float64", "int64", "uint64", "complex128") for a in in_avals + out_avals) or (
        any(t in str(module.operation) for t in ("xi64>", "xf64>", "xui64>", "<i64>", "<f64>", "<ui64>"))
    )
    return ImportedProgram(entry, fn, in_avals, out_avals, needs_x64, interpreter.locations)


def _module_name(module: ir.Module) -> str:
    attr = _attr(module.operation, "sym_name")
    name = ir.StringAttr(attr).value if attr is not None else "module"
    name = name[4:] if name.startswith("jit_") else name
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "module"
