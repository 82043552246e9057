"""The sparse MoE's linear and bilinear pieces as JAX primitives: differentiable in both modes.

``jax.custom_vjp`` gives reverse mode only: ``jax.jvp``, ``jacfwd``, ``hessian`` and ``linearize``
refuse it. So the pieces are primitives, built the way ``lax.ragged_dot`` is:

* the implementation is the existing code: the backend's kernels (``gmm``, ``tgmm``, ``gmm_pair``,
  ``swiglu_gmm``) or the jnp permutations, lowered by tracing it (``mlir.lower_fun``), so a
  forward pass compiles to what it compiled to before;
* a JVP rule: a bilinear piece differentiates into itself (``gmm(dx, w) + gmm(x, dw)``); the fused
  SwiGLU product into its pre-activations' tangents and ``swiglu_tangent``;
* a transpose rule that is the hand-written backward: ``gmm`` in its rows transposes to ``gmm``
  with transposed weights, in its weights to ``tgmm``; ``permute`` and ``unpermute`` transpose
  into each other, ``combine`` into ``spread`` (rows) and ``combine_weights_ct`` (weights), and
  these three into one another; ``swiglu_tangent`` into ``swiglu_grads``, ``swiglu_rows_tangent``
  and ``swiglu_rows_grads`` into each other. So ``jax.grad`` runs
  exactly the kernels the former ``custom_vjp`` backward ran, with the same options, and the set
  is closed under differentiation and transposition (any order, forward or reverse);
* batching: every primitive carries ``batch``, one tuple per enclosing ``vmap`` (outermost
  first) telling which operands have that axis in front. The implementation ``vmap``s the
  unbatched code (XLA batching for jnp and the XLA tile loop, ``sequential_vmap`` for the Triton
  kernels: what ``vmap`` of the ``custom_vjp`` ran), and transposes and tangents of a batched
  primitive are again batched primitives, summed over the axes their operand lacks.

Each primitive takes the ``KernelBackend`` object itself as a parameter (hashable), so the
backward uses the kernels the forward was given.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from moe_lowering import _compat
from moe_lowering.kernels.swiglu_gmm import swiglu_gmm_reference, swiglu_grads
from moe_lowering.kernels.swiglu_rows import swiglu_rows_grads_reference, swiglu_rows_reference

Zero = _compat.Zero
ALL = "all"  # in ``_levels``: an operand batched at every level (a cotangent of a batched output)


def accumulation_dtype(*dtypes):
    """The wider of float32 and the operands' type: bf16 and f32 accumulate in f32, f64 in f64."""
    return jnp.promote_types(jnp.float32, jnp.result_type(*dtypes))


# --------------------------------------------------------------------------- batching levels


def _call_batched(fn, batch, *args):
    """``fn`` on ``args`` where ``args[i]`` has one leading axis per level with ``level[i]``."""
    for level in reversed(batch):
        fn = jax.vmap(fn, in_axes=tuple(0 if batched else None for batched in level))
    return fn(*args)


def _levels(batch, *sources):
    """The ``batch`` of a derived primitive whose operand ``j`` is operand ``sources[j]`` of this
    one (an index) or ``ALL`` (a value with every level's axis: a cotangent, a tangent output)."""
    return tuple(tuple(True if s is ALL else level[s] for s in sources) for level in batch)


def _batch_ndim(batch, i) -> int:
    return sum(1 for level in batch if level[i])


def _sum_unbatched(x, batch, i):
    """``x`` (every level's axis in front) summed over the levels operand ``i`` does not have."""
    axes = tuple(j for j, level in enumerate(batch) if not level[i])
    return x.sum(axis=axes) if axes else x


def _core_shape(aval, batch, i):
    return tuple(aval.shape[_batch_ndim(batch, i):])


def _sum(terms, like):
    """The sum of the non-zero tangent ``terms`` (a symbolic zero like ``like`` where none)."""
    terms = [t for t in terms if t is not None and type(t) is not Zero]
    if not terms:
        return _compat.zero_tangent(like)
    return functools.reduce(operator.add, terms)


def _nonzero(t) -> bool:
    return type(t) is not Zero


# --------------------------------------------------------------------------- definition


def _define(name, impl, shape_rule, *, multiple_results=False, jvp=None, transpose=None):
    """A primitive running ``impl(*operands, **params)`` (unbatched operands), whose outputs
    ``shape_rule(*operand_avals, **params)`` describes as ``[(shape, dtype), ...]``. ``jvp`` is a
    JVP rule, or ``"linear"`` / ``"bilinear"`` (in the first one / two operands, the rest indices)."""
    primitive = _compat.Primitive(name)
    primitive.multiple_results = multiple_results

    def run(*operands, batch, **params):
        out = _call_batched(functools.partial(impl, **params), batch, *operands)
        return list(out) if multiple_results else out

    def abstract_eval(*avals, batch, **params):
        sizes, core = {}, []
        for i, aval in enumerate(avals):
            leading = iter(aval.shape)
            for j, level in enumerate(batch):
                if level[i]:
                    sizes[j] = next(leading)
            core.append(_compat.ShapedArray(_core_shape(aval, batch, i), aval.dtype))
        prefix = tuple(sizes[j] for j in range(len(batch)))
        outs = [_compat.shaped_array_varying_like(prefix + tuple(shape), dtype, avals)
                for shape, dtype in shape_rule(*core, **params)]
        return outs if multiple_results else outs[0]

    def batch_rule(operands, dims, *, batch, **params):
        level = tuple(d is not None for d in dims)
        operands = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims)]
        out = primitive.bind(*operands, batch=(level,) + tuple(batch), **params)
        return out, ([0] * len(out) if multiple_results else 0)

    primitive.def_impl(run)
    primitive.def_abstract_eval(abstract_eval)
    _compat.register_lowering(primitive, run, multiple_results)
    _compat.primitive_batchers[primitive] = batch_rule
    if isinstance(jvp, str):
        jvp = {"linear": _linear_jvp, "bilinear": _bilinear_jvp}[jvp](primitive)
    if jvp is not None:
        _compat.primitive_jvps[primitive] = jvp
    if transpose is not None:
        _compat.primitive_transposes[primitive] = transpose
    return primitive


def _bilinear_jvp(primitive):
    """JVP of a primitive bilinear in its first two operands (the rest integer indices)."""

    def jvp(primals, tangents, **params):
        a, b, *rest = primals
        out = primitive.bind(*primals, **params)
        terms = [primitive.bind(tangents[0], b, *rest, **params) if _nonzero(tangents[0]) else None,
                 primitive.bind(a, tangents[1], *rest, **params) if _nonzero(tangents[1]) else None]
        return out, _sum(terms, out)

    return jvp


def _linear_jvp(primitive):
    """JVP of a primitive linear in its first operand (the rest integer indices)."""

    def jvp(primals, tangents, **params):
        out = primitive.bind(*primals, **params)
        if not _nonzero(tangents[0]):
            return out, _compat.zero_tangent(out)
        return out, primitive.bind(tangents[0], *primals[1:], **params)

    return jvp


# --------------------------------------------------------------------------- grouped products


def _out_dtype(preferred_element_type, *dtypes):
    return jnp.dtype(preferred_element_type or jnp.result_type(*dtypes))


def _gmm_impl(lhs, rhs, group_sizes, *, kernels, group_offset, transpose_rhs, preferred_element_type, zero_outside,
              expected_rows):
    return kernels.gmm(lhs, rhs, group_sizes, group_offset=group_offset, transpose_rhs=transpose_rhs,
                       preferred_element_type=preferred_element_type, zero_outside=zero_outside,
                       expected_rows=expected_rows)


def _gmm_shape(lhs, rhs, group_sizes, *, transpose_rhs, preferred_element_type, **_):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return [((lhs.shape[0], n), _out_dtype(preferred_element_type, lhs.dtype, rhs.dtype))]


def _gmm_transpose(ct, lhs, rhs, group_sizes, *, kernels, group_offset, transpose_rhs, preferred_element_type,
                   zero_outside, expected_rows, batch):
    del preferred_element_type, zero_outside  # the backward reads only the groups' rows
    if not _nonzero(ct):
        return [None, None, None]
    if _compat.is_undefined_primal(lhs):  # d_lhs = d_out @ rhs^T: gmm with the weights transposed
        d_lhs = gmm_p.bind(ct, rhs, group_sizes, kernels=kernels, group_offset=group_offset,
                           transpose_rhs=not transpose_rhs, preferred_element_type=lhs.aval.dtype, zero_outside=True,
                           expected_rows=expected_rows, batch=_levels(batch, ALL, 1, 2))
        return [_sum_unbatched(d_lhs, batch, 0), None, None]
    # d_rhs[g] = lhs_g^T @ d_out_g (or its transpose for transposed weights): tgmm
    operands, sources = ((ct, lhs), (ALL, 0)) if transpose_rhs else ((lhs, ct), (0, ALL))
    d_rhs = tgmm_p.bind(*operands, group_sizes, kernels=kernels, num_groups=_core_shape(rhs.aval, batch, 1)[0],
                        group_offset=group_offset, preferred_element_type=rhs.aval.dtype, expected_rows=expected_rows,
                        batch=_levels(batch, *sources, 2))
    return [None, _sum_unbatched(d_rhs, batch, 1), None]


def _tgmm_impl(lhs, grad, group_sizes, *, kernels, num_groups, group_offset, preferred_element_type, expected_rows):
    return kernels.tgmm(lhs, grad, group_sizes, num_groups=num_groups, group_offset=group_offset,
                        preferred_element_type=preferred_element_type, expected_rows=expected_rows)


def _tgmm_shape(lhs, grad, group_sizes, *, num_groups, preferred_element_type, **_):
    return [((num_groups, lhs.shape[1], grad.shape[1]), _out_dtype(preferred_element_type, lhs.dtype, grad.dtype))]


def _tgmm_transpose(ct, lhs, grad, group_sizes, *, kernels, num_groups, group_offset, preferred_element_type,
                    expected_rows, batch):
    del num_groups, preferred_element_type
    if not _nonzero(ct):
        return [None, None, None]
    options = dict(kernels=kernels, group_offset=group_offset, zero_outside=True, expected_rows=expected_rows)
    if _compat.is_undefined_primal(lhs):  # d_lhs[r] = grad[r] @ ct[g]^T
        d_lhs = gmm_p.bind(grad, ct, group_sizes, transpose_rhs=True, preferred_element_type=lhs.aval.dtype,
                           batch=_levels(batch, 1, ALL, 2), **options)
        return [_sum_unbatched(d_lhs, batch, 0), None, None]
    d_grad = gmm_p.bind(lhs, ct, group_sizes, transpose_rhs=False, preferred_element_type=grad.aval.dtype,
                        batch=_levels(batch, 0, ALL, 2), **options)  # d_grad[r] = lhs[r] @ ct[g]
    return [None, _sum_unbatched(d_grad, batch, 1), None]


def _gmm_pair_impl(lhs, rhs_a, rhs_b, group_sizes, *, kernels, group_offset, preferred_element_type, zero_outside,
                   expected_rows):
    options = dict(group_offset=group_offset, preferred_element_type=preferred_element_type,
                   zero_outside=zero_outside, expected_rows=expected_rows)
    if kernels.gmm_pair is not None:
        return tuple(kernels.gmm_pair(lhs, rhs_a, rhs_b, group_sizes, **options))
    return tuple(kernels.gmm(lhs, rhs, group_sizes, **options) for rhs in (rhs_a, rhs_b))


def _gmm_pair_shape(lhs, rhs_a, rhs_b, group_sizes, *, preferred_element_type, **_):
    return [((lhs.shape[0], rhs.shape[2]), _out_dtype(preferred_element_type, lhs.dtype, rhs.dtype))
            for rhs in (rhs_a, rhs_b)]


def _gmm_pair_jvp(primals, tangents, *, kernels, group_offset, preferred_element_type, zero_outside, expected_rows,
                  batch):
    lhs, rhs_a, rhs_b, group_sizes = primals
    options = dict(kernels=kernels, group_offset=group_offset, preferred_element_type=preferred_element_type,
                   zero_outside=zero_outside, expected_rows=expected_rows)
    outs = gmm_pair_p.bind(*primals, batch=batch, **options)
    terms_a, terms_b = _pair_tangent_terms(lhs, rhs_a, rhs_b, group_sizes, tangents, batch, options)
    return outs, [_sum(terms_a, outs[0]), _sum(terms_b, outs[1])]


def _pair_tangent_terms(lhs, rhs_a, rhs_b, group_sizes, tangents, batch, options):
    """The tangents of ``(lhs @ rhs_a, lhs @ rhs_b)`` as lists of terms: one pair product of the rows'
    tangent, and a product of the rows with each weight's tangent."""
    terms_a, terms_b = [], []
    if _nonzero(tangents[0]):
        t_a, t_b = gmm_pair_p.bind(tangents[0], rhs_a, rhs_b, group_sizes, batch=batch, **options)
        terms_a.append(t_a)
        terms_b.append(t_b)
    for terms, index in ((terms_a, 1), (terms_b, 2)):
        if _nonzero(tangents[index]):
            terms.append(gmm_p.bind(lhs, tangents[index], group_sizes, transpose_rhs=False,
                                    batch=_levels(batch, 0, index, 3), **options))
    return terms_a, terms_b


# Up to this expert width (the products' contraction) one gmm_sum beats two gmm calls and an add;
# wider, the two calls win: H200 same-run A/B, Mixtral (width 14336) 31.1 -> 32.6 ms forward+backward
# with gmm_sum, and SonicMoE's 120B-n2048 shape 3% slower on an H100 (benchmarks/NOTES.md).
GMM_SUM_MAX_WIDTH = 1024


def _gmm_pair_transpose(cts, lhs, rhs_a, rhs_b, group_sizes, *, kernels, group_offset, preferred_element_type,
                        zero_outside, expected_rows, batch):
    del preferred_element_type, zero_outside
    options = dict(kernels=kernels, group_offset=group_offset, expected_rows=expected_rows)
    pairs = [(ct, rhs, index) for ct, rhs, index in zip(cts, (rhs_a, rhs_b), (1, 2)) if _nonzero(ct)]
    if (_compat.is_undefined_primal(lhs) and len(pairs) == 2 and kernels.gmm_sum is not None
            and cts[0].shape[-1] <= GMM_SUM_MAX_WIDTH):
        # both products' d_lhs in one pass: gmm_sum accumulates both in float32 and writes once
        d_lhs = gmm_sum_p.bind(cts[0], cts[1], rhs_a, rhs_b, group_sizes, preferred_element_type=lhs.aval.dtype,
                               batch=_levels(batch, ALL, ALL, 1, 2, 3), **options)
        return [_sum_unbatched(d_lhs, batch, 0), None, None, None]
    if _compat.is_undefined_primal(lhs):  # both products' d_lhs, added in float32 (or wider)
        parts = [gmm_p.bind(ct, rhs, group_sizes, transpose_rhs=True, preferred_element_type=lhs.aval.dtype,
                            zero_outside=True, batch=_levels(batch, ALL, index, 3), **options)
                 for ct, rhs, index in pairs]
        if not parts:
            return [None] * 4
        acc = accumulation_dtype(lhs.aval.dtype)
        d_lhs = parts[0] if len(parts) == 1 else (parts[0].astype(acc) + parts[1].astype(acc)).astype(lhs.aval.dtype)
        return [_sum_unbatched(d_lhs, batch, 0), None, None, None]
    out = [None] * 4
    for ct, rhs, index in pairs:
        if _compat.is_undefined_primal(rhs):
            d_rhs = tgmm_p.bind(lhs, ct, group_sizes, num_groups=_core_shape(rhs.aval, batch, index)[0],
                                preferred_element_type=rhs.aval.dtype, batch=_levels(batch, 0, ALL, 3), **options)
            out[index] = _sum_unbatched(d_rhs, batch, index)
    return out


# ``gmm_sum(a, b, rhs_a, rhs_b) = a @ rhs_a[g]^T + b @ rhs_b[g]^T``: the rows' cotangent of
# ``gmm_pair``, in one kernel where the backend has one. Bilinear in ``(a, b)`` and ``(rhs_a, rhs_b)``;
# it transposes into ``gmm_pair`` (rows) and ``tgmm`` (weights).


def _gmm_sum_impl(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, kernels, group_offset, preferred_element_type,
                  expected_rows):
    options = dict(group_offset=group_offset, preferred_element_type=preferred_element_type,
                   expected_rows=expected_rows)
    if kernels.gmm_sum is not None:
        return kernels.gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, **options)
    from moe_lowering.kernels.grouped_matmul.reference import gmm_sum

    return gmm_sum(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, **options)


def _gmm_sum_shape(lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, preferred_element_type, **_):
    return [((lhs_a.shape[0], rhs_a.shape[1]), _out_dtype(preferred_element_type, lhs_a.dtype, rhs_a.dtype))]


def _gmm_sum_jvp(primals, tangents, **params):
    out = gmm_sum_p.bind(*primals, **params)
    lhs_a, lhs_b, rhs_a, rhs_b, group_sizes = primals
    terms = []
    if _nonzero(tangents[0]) or _nonzero(tangents[1]):
        terms.append(gmm_sum_p.bind(*(_compat.instantiate_zeros(t) for t in tangents[:2]), rhs_a, rhs_b, group_sizes,
                                    **params))
    if _nonzero(tangents[2]) or _nonzero(tangents[3]):
        terms.append(gmm_sum_p.bind(lhs_a, lhs_b, *(_compat.instantiate_zeros(t) for t in tangents[2:4]), group_sizes,
                                    **params))
    return out, _sum(terms, out)


def _gmm_sum_transpose(ct, lhs_a, lhs_b, rhs_a, rhs_b, group_sizes, *, kernels, group_offset, preferred_element_type,
                       expected_rows, batch):
    del preferred_element_type
    if not _nonzero(ct):
        return [None] * 5
    options = dict(kernels=kernels, group_offset=group_offset, expected_rows=expected_rows)
    out = [None] * 5
    if _compat.is_undefined_primal(lhs_a) or _compat.is_undefined_primal(lhs_b):
        # d_lhs_a = ct @ rhs_a[g], d_lhs_b = ct @ rhs_b[g]: a gmm_pair of the cotangent
        d_a, d_b = gmm_pair_p.bind(ct, rhs_a, rhs_b, group_sizes, preferred_element_type=lhs_a.aval.dtype,
                                   zero_outside=True, batch=_levels(batch, ALL, 2, 3, 4), **options)
        for index, (lhs, d) in enumerate(((lhs_a, d_a), (lhs_b, d_b))):
            if _compat.is_undefined_primal(lhs):
                out[index] = _sum_unbatched(d.astype(lhs.aval.dtype), batch, index)
    for index, (lhs, rhs) in ((2, (lhs_a, rhs_a)), (3, (lhs_b, rhs_b))):
        if _compat.is_undefined_primal(rhs):  # d_rhs[g] = ct_g^T @ lhs_g ([N, K], as the weights)
            d_rhs = tgmm_p.bind(ct, lhs, group_sizes, num_groups=_core_shape(rhs.aval, batch, index)[0],
                                preferred_element_type=rhs.aval.dtype, batch=_levels(batch, ALL, index - 2, 4),
                                **options)
            out[index] = _sum_unbatched(d_rhs, batch, index)
    return out


gmm_p = _define("moe_gmm", _gmm_impl, _gmm_shape, jvp="bilinear", transpose=_gmm_transpose)
tgmm_p = _define("moe_tgmm", _tgmm_impl, _tgmm_shape, jvp="bilinear", transpose=_tgmm_transpose)
gmm_pair_p = _define("moe_gmm_pair", _gmm_pair_impl, _gmm_pair_shape, multiple_results=True, jvp=_gmm_pair_jvp,
                     transpose=_gmm_pair_transpose)
gmm_sum_p = _define("moe_gmm_sum", _gmm_sum_impl, _gmm_sum_shape, jvp=_gmm_sum_jvp, transpose=_gmm_sum_transpose)


# --------------------------------------------------------------------------- fused SwiGLU product


def _swiglu_gmm_impl(lhs, gate_rhs, up_rhs, group_sizes, *, kernels, group_offset, preferred_element_type,
                     with_preactivations):
    kernel = kernels.swiglu_gmm or swiglu_gmm_reference
    options = dict(group_offset=group_offset, preferred_element_type=preferred_element_type)
    if with_preactivations:
        return tuple(kernel(lhs, gate_rhs, up_rhs, group_sizes, with_preactivations=True, **options))
    return (kernel(lhs, gate_rhs, up_rhs, group_sizes, **options),)


def _swiglu_gmm_shape(lhs, gate_rhs, up_rhs, group_sizes, *, preferred_element_type, with_preactivations, **_):
    out = ((lhs.shape[0], gate_rhs.shape[2]),
           _out_dtype(preferred_element_type, lhs.dtype, gate_rhs.dtype, up_rhs.dtype))
    return [out] * (3 if with_preactivations else 1)


def _swiglu_gmm_jvp(primals, tangents, *, kernels, group_offset, preferred_element_type, with_preactivations, batch):
    """``silu(g) * u`` with ``g = lhs @ Wg``, ``u = lhs @ Wu``: the forward also returns both
    pre-activations (as the ``custom_vjp`` forward did, for the backward), their tangents are
    grouped products, and ``swiglu_tangent`` combines them."""
    lhs, gate_rhs, up_rhs, group_sizes = primals
    out, gate, up = swiglu_gmm_p.bind(*primals, kernels=kernels, group_offset=group_offset,
                                      preferred_element_type=preferred_element_type, with_preactivations=True,
                                      batch=batch)
    primal_outs = [out, gate, up] if with_preactivations else [out]
    if not any(_nonzero(t) for t in tangents[:3]):
        return primal_outs, [_compat.zero_tangent(v) for v in primal_outs]
    options = dict(kernels=kernels, group_offset=group_offset, preferred_element_type=out.dtype, zero_outside=True,
                   expected_rows=None)
    gate_terms, up_terms = _pair_tangent_terms(lhs, gate_rhs, up_rhs, group_sizes, tangents, batch, options)
    return primal_outs, _swiglu_out_tangents(gate, up, gate_terms, up_terms, with_preactivations, batch)


def _swiglu_out_tangents(gate, up, gate_terms, up_terms, with_preactivations, batch):
    """The tangents of ``silu(gate) * up`` (and, ``with_preactivations``, of both products) from the
    products' tangent terms."""
    gate_dot = _compat.instantiate_zeros(_sum(gate_terms, gate))
    up_dot = _compat.instantiate_zeros(_sum(up_terms, up))
    out_dot = swiglu_tangent_p.bind(gate_dot, up_dot, gate, up, batch=_levels(batch, ALL, ALL, ALL, ALL))
    return [out_dot, gate_dot, up_dot] if with_preactivations else [out_dot]


def _swiglu_tangent_impl(gate_dot, up_dot, gate, up):
    """The tangent of ``silu(gate) * up``, in float32 (or wider), rounded to ``gate``'s type."""
    acc = accumulation_dtype(gate.dtype)
    g, u = gate.astype(acc), up.astype(acc)
    sigmoid = jax.nn.sigmoid(g)
    d_gate = u * sigmoid * (1.0 + g * (1.0 - sigmoid))
    return (gate_dot.astype(acc) * d_gate + up_dot.astype(acc) * (g * sigmoid)).astype(gate.dtype)


def _swiglu_tangent_shape(gate_dot, up_dot, gate, up):
    return [(gate.shape, gate.dtype)]


def _swiglu_tangent_jvp(primals, tangents, *, batch):
    out = swiglu_tangent_p.bind(*primals, batch=batch)
    terms = []
    if _nonzero(tangents[0]) or _nonzero(tangents[1]):
        linear = [_compat.instantiate_zeros(t) for t in tangents[:2]]
        terms.append(swiglu_tangent_p.bind(*linear, *primals[2:], batch=batch))
    if _nonzero(tangents[2]) or _nonzero(tangents[3]):
        terms.append(_along_preactivations(_swiglu_tangent_impl, primals[:2], primals[2:4], tangents[2:4],
                                           _levels(batch, 0, 1, 2, 3, 2, 3)))
    return out, _sum(terms, out)


def _along_preactivations(fn, fixed, preactivations, tangents, batch):
    """JAX's JVP of ``fn(*fixed, gate, up)`` along the pre-activations' ``tangents``, in plain jnp:
    only forward mode and higher orders differentiate there. ``batch``: the levels of ``fixed``,
    ``gate``, ``up`` and the two tangents, in that order."""

    def along(*operands):
        *head, gate, up, t_gate, t_up = operands
        return jax.jvp(functools.partial(fn, *head), (gate, up), (t_gate, t_up))[1]

    moved = [_compat.instantiate_zeros(t) for t in tangents]
    return _call_batched(along, batch, *fixed, *preactivations, *moved)


def _swiglu_tangent_transpose(ct, gate_dot, up_dot, gate, up, *, batch):
    """The former ``custom_vjp`` backward's elementwise step: ``swiglu_grads``."""
    if not _nonzero(ct):
        return [None] * 4
    d_gate, d_up = _call_batched(swiglu_grads, _levels(batch, ALL, 2, 3), ct, gate, up)
    return [_sum_unbatched(d_gate, batch, 0) if _compat.is_undefined_primal(gate_dot) else None,
            _sum_unbatched(d_up, batch, 1) if _compat.is_undefined_primal(up_dot) else None, None, None]


swiglu_gmm_p = _define("moe_swiglu_gmm", _swiglu_gmm_impl, _swiglu_gmm_shape, multiple_results=True,
                       jvp=_swiglu_gmm_jvp)
swiglu_tangent_p = _define("moe_swiglu_tangent", _swiglu_tangent_impl, _swiglu_tangent_shape,
                           jvp=_swiglu_tangent_jvp, transpose=_swiglu_tangent_transpose)


# --------------------------------------------------------------------------- SwiGLU on leading rows
# ``swiglu_rows(gate, up, num_rows)``: SwiGLU's elementwise part on a buffer's leading rows (later
# rows unspecified), for expert-parallel receive buffers sized for the worst case. Its tangent
# ``swiglu_rows_tangent`` transposes into ``swiglu_rows_grads`` (the backend's row kernel, the
# backward the former ``custom_vjp`` ran) and that back into the tangent, so reverse mode costs the
# rows that arrived and forward mode and every higher order (Hessian-vector products) work too.


def _swiglu_rows_impl(gate, up, num_rows, *, kernels):
    return (kernels.swiglu_rows or swiglu_rows_reference)(gate, up, num_rows)


def _swiglu_rows_shape(gate, up, num_rows, **_):
    return [(gate.shape, gate.dtype)]


def _swiglu_rows_jvp(primals, tangents, *, kernels, batch):
    out = swiglu_rows_p.bind(*primals, kernels=kernels, batch=batch)
    if not (_nonzero(tangents[0]) or _nonzero(tangents[1])):
        return out, _compat.zero_tangent(out)
    linear = [_compat.instantiate_zeros(t) for t in tangents[:2]]
    return out, swiglu_rows_tangent_p.bind(*linear, *primals, kernels=kernels, batch=_levels(batch, 0, 1, 0, 1, 2))


def _swiglu_rows_tangent_impl(gate_dot, up_dot, gate, up, num_rows, *, kernels):
    """Forward mode's tangent: every row, in jnp (rows from ``num_rows`` on are unspecified)."""
    return _swiglu_tangent_impl(gate_dot, up_dot, gate, up)


def _swiglu_rows_tangent_shape(gate_dot, up_dot, gate, up, num_rows, **_):
    return [(gate.shape, gate.dtype)]


def _swiglu_rows_tangent_jvp(primals, tangents, *, kernels, batch):
    out = swiglu_rows_tangent_p.bind(*primals, kernels=kernels, batch=batch)
    terms = []
    if _nonzero(tangents[0]) or _nonzero(tangents[1]):
        linear = [_compat.instantiate_zeros(t) for t in tangents[:2]]
        terms.append(swiglu_rows_tangent_p.bind(*linear, *primals[2:], kernels=kernels, batch=batch))
    if _nonzero(tangents[2]) or _nonzero(tangents[3]):
        terms.append(_along_preactivations(_swiglu_tangent_impl, primals[:2], primals[2:4], tangents[2:4],
                                           _levels(batch, 0, 1, 2, 3, 2, 3)))
    return out, _sum(terms, out)


def _swiglu_rows_tangent_transpose(ct, gate_dot, up_dot, gate, up, num_rows, *, kernels, batch):
    """Reverse mode: the backend's ``swiglu_rows_grads`` on the rows that count."""
    if not _nonzero(ct):
        return [None] * 5
    d_gate, d_up = swiglu_rows_grads_p.bind(ct, gate, up, num_rows, kernels=kernels,
                                            batch=_levels(batch, ALL, 2, 3, 4))
    return [_sum_unbatched(d_gate, batch, 0) if _compat.is_undefined_primal(gate_dot) else None,
            _sum_unbatched(d_up, batch, 1) if _compat.is_undefined_primal(up_dot) else None, None, None, None]


def _swiglu_rows_grads_impl(d_out, gate, up, num_rows, *, kernels):
    return tuple((kernels.swiglu_rows_grads or swiglu_rows_grads_reference)(d_out, gate, up, num_rows))


def _swiglu_rows_grads_shape(d_out, gate, up, num_rows, **_):
    return [(gate.shape, gate.dtype), (up.shape, up.dtype)]


def _swiglu_rows_grads_jvp(primals, tangents, *, kernels, batch):
    """Linear in ``d_out`` (itself again); along the pre-activations, jnp (second order and up)."""
    outs = swiglu_rows_grads_p.bind(*primals, kernels=kernels, batch=batch)
    terms = []
    if _nonzero(tangents[0]):
        terms.append(swiglu_rows_grads_p.bind(tangents[0], *primals[1:], kernels=kernels, batch=batch))
    if _nonzero(tangents[1]) or _nonzero(tangents[2]):
        terms.append(_along_preactivations(swiglu_grads, primals[:1], primals[1:3], tangents[1:3],
                                           _levels(batch, 0, 1, 2, 1, 2)))
    return outs, [_sum([term[i] for term in terms], out) for i, out in enumerate(outs)]


def _swiglu_rows_grads_transpose(cts, d_out, gate, up, num_rows, *, kernels, batch):
    """Third order (reverse over a Hessian-vector product): the tangent again."""
    if not any(_nonzero(ct) for ct in cts):
        return [None] * 4
    ct_gate, ct_up = (_compat.instantiate_zeros(ct) for ct in cts)
    d_d_out = swiglu_rows_tangent_p.bind(ct_gate, ct_up, gate, up, num_rows, kernels=kernels,
                                         batch=_levels(batch, ALL, ALL, 1, 2, 3))
    return [_sum_unbatched(d_d_out, batch, 0), None, None, None]


swiglu_rows_p = _define("moe_swiglu_rows", _swiglu_rows_impl, _swiglu_rows_shape, jvp=_swiglu_rows_jvp)
swiglu_rows_tangent_p = _define("moe_swiglu_rows_tangent", _swiglu_rows_tangent_impl, _swiglu_rows_tangent_shape,
                                jvp=_swiglu_rows_tangent_jvp, transpose=_swiglu_rows_tangent_transpose)
swiglu_rows_grads_p = _define("moe_swiglu_rows_grads", _swiglu_rows_grads_impl, _swiglu_rows_grads_shape,
                              multiple_results=True, jvp=_swiglu_rows_grads_jvp,
                              transpose=_swiglu_rows_grads_transpose)


# --------------------------------------------------------------------------- permutations
# ``token_of_row [N]``, ``inverse [T, k]`` ((token, choice) -> row) and ``order [N]`` (row ->
# token * k + choice) describe the sort; every row is one (token, choice) copy.


def _take_rows(values, index):
    """``values[index]`` along axis 0: ``index``'s shape, then ``values``' trailing dims (``jnp.take``
    drops the index's dims when ``values`` is empty: no tokens)."""
    if values.shape[0] == 0 or index.size == 0:
        return jnp.zeros(index.shape + values.shape[1:], values.dtype)
    return jnp.take(values, index, axis=0)


def _permute_impl(tokens, token_of_row, inverse):
    return _take_rows(tokens, token_of_row)


def _permute_shape(tokens, token_of_row, inverse):
    return [((token_of_row.shape[0], *tokens.shape[1:]), tokens.dtype)]


def _permute_transpose(ct, tokens, token_of_row, inverse, *, batch):
    if not _nonzero(ct):
        return [None] * 3
    d_tokens = unpermute_p.bind(ct, token_of_row, inverse, dtype=tokens.aval.dtype, batch=_levels(batch, ALL, 1, 2))
    return [_sum_unbatched(d_tokens, batch, 0), None, None]


def _unpermute_impl(rows, token_of_row, inverse, *, dtype):
    """``out[t] = sum_j rows[inverse[t, j]]``: the copies of each token added up."""
    copies = _take_rows(rows, inverse)  # [T, k, D]
    return copies.sum(axis=1, dtype=accumulation_dtype(rows.dtype)).astype(dtype)


def _unpermute_shape(rows, token_of_row, inverse, *, dtype):
    return [((inverse.shape[0], *rows.shape[1:]), jnp.dtype(dtype))]


def _unpermute_transpose(ct, rows, token_of_row, inverse, *, dtype, batch):
    del dtype
    if not _nonzero(ct):
        return [None] * 3
    d_rows = permute_p.bind(ct, token_of_row, inverse, batch=_levels(batch, ALL, 1, 2)).astype(rows.aval.dtype)
    return [_sum_unbatched(d_rows, batch, 0), None, None]


permute_p = _define("moe_permute", _permute_impl, _permute_shape, jvp="linear", transpose=_permute_transpose)
unpermute_p = _define("moe_unpermute", _unpermute_impl, _unpermute_shape, jvp="linear",
                      transpose=_unpermute_transpose)


# ``combine(rows, weights)``, ``spread(x, weights)`` and ``combine_weights_ct(x, rows)`` are bilinear
# and transpose into one another; operands ``(a, b, inverse, token_of_row, order, num_valid)``. Rows
# ``[num_valid, N)`` are dropped copies (they sort last): ``combine`` ignores them (whatever they
# hold, non-finite values included), ``spread`` writes zeros there and ``combine_weights_ct`` gives
# their copies a zero cotangent, so no separate mask (a select over all ``[N, D]`` rows, forward
# and backward) is needed.


def _copy_is_valid(inverse, num_valid):
    return inverse < num_valid  # [T, k]


def _combine_impl(rows, weights, inverse, token_of_row, order, num_valid, *, dtype):
    """``out[t] = sum_j weights[t, j] * rows[inverse[t, j]]`` over the copies that are not dropped,
    accumulated in float32 (or wider)."""
    acc = accumulation_dtype(rows.dtype, weights.dtype)
    valid = _copy_is_valid(inverse, num_valid)
    copies = jnp.where(valid[..., None], _take_rows(rows, inverse).astype(acc), 0)  # [T, k, D]
    return jnp.einsum("tk,tkd->td", jnp.where(valid, weights.astype(acc), 0), copies).astype(dtype)


def _spread_row_weights(weights, order, num_valid, dtype):
    """Each row's routing weight, zero for the dropped rows."""
    rows = jnp.arange(order.shape[0], dtype=order.dtype)
    return jnp.where(rows < num_valid, weights.reshape(-1)[order].astype(dtype), 0)


def _spread_impl(x, weights, inverse, token_of_row, order, num_valid, *, dtype):
    """``out[r] = x[token_of_row[r]] * weights[copy r]`` (zero for dropped rows): ``combine``'s
    cotangent in its rows."""
    acc = accumulation_dtype(x.dtype, weights.dtype)
    row_weights = _spread_row_weights(weights, order, num_valid, acc)
    return (_take_rows(x.astype(acc), token_of_row) * row_weights[:, None]).astype(dtype)


def _combine_weights_ct_impl(x, rows, inverse, token_of_row, order, num_valid, *, dtype):
    """``out[t, j] = x[t] . rows[inverse[t, j]]`` (zero for dropped copies): ``combine``'s
    cotangent in its weights."""
    acc = accumulation_dtype(x.dtype, rows.dtype)
    valid = _copy_is_valid(inverse, num_valid)
    copies = jnp.where(valid[..., None], _take_rows(rows, inverse).astype(acc), 0)
    return jnp.einsum("td,tkd->tk", x.astype(acc), copies).astype(dtype)


def _combine_shape(rows, weights, inverse, token_of_row, order, num_valid, *, dtype):
    return [((inverse.shape[0], rows.shape[1]), jnp.dtype(dtype))]


def _spread_shape(x, weights, inverse, token_of_row, order, num_valid, *, dtype):
    return [((token_of_row.shape[0], x.shape[1]), jnp.dtype(dtype))]


def _combine_weights_ct_shape(x, rows, inverse, token_of_row, order, num_valid, *, dtype):
    return [(inverse.shape, jnp.dtype(dtype))]


# (primitive, which operand is linear) -> (the transpose's primitive, its two operands: the
# cotangent and the other operand, by name)
_COMBINE_TRANSPOSES = {
    ("combine", 0): ("spread", ("ct", 1)),  # d_rows = spread(ct, weights)
    ("combine", 1): ("combine_weights_ct", ("ct", 0)),  # d_weights = combine_weights_ct(ct, rows)
    ("spread", 0): ("combine", ("ct", 1)),  # d_x = combine(ct, weights)
    ("spread", 1): ("combine_weights_ct", (0, "ct")),  # d_weights = combine_weights_ct(x, ct)
    ("combine_weights_ct", 0): ("combine", (1, "ct")),  # d_x = combine(rows, ct)
    ("combine_weights_ct", 1): ("spread", (0, "ct")),  # d_rows = spread(x, ct)
}


def _combine_family_transpose(name):
    def transpose(ct, a, b, inverse, token_of_row, order, num_valid, *, dtype, batch):
        del dtype
        if not _nonzero(ct):
            return [None] * 6
        linear = 0 if _compat.is_undefined_primal(a) else 1
        target, sources = _COMBINE_TRANSPOSES[(name, linear)]
        operands = [ct if s == "ct" else (a, b)[s] for s in sources]
        levels = _levels(batch, *(ALL if s == "ct" else s for s in sources), 2, 3, 4, 5)
        undefined = (a, b)[linear]
        out = _COMBINE_FAMILY[target].bind(*operands, inverse, token_of_row, order, num_valid,
                                           dtype=undefined.aval.dtype, batch=levels)
        cts = [None] * 6
        cts[linear] = _sum_unbatched(out, batch, linear)
        return cts

    return transpose


_COMBINE_FAMILY = {}
for _name, _impl, _shape in (("combine", _combine_impl, _combine_shape), ("spread", _spread_impl, _spread_shape),
                             ("combine_weights_ct", _combine_weights_ct_impl, _combine_weights_ct_shape)):
    _COMBINE_FAMILY[_name] = _define(f"moe_{_name}", _impl, _shape, jvp="bilinear",
                                     transpose=_combine_family_transpose(_name))
combine_p, spread_p, combine_weights_ct_p = (_COMBINE_FAMILY[n] for n in ("combine", "spread", "combine_weights_ct"))


# --------------------------------------------------------------------------- the up projection of the token rows
# ``gather_swiglu_gmm(tokens, gate, up, group_sizes, token_of_row, inverse)`` is
# ``swiglu_gmm(permute(tokens), gate, up)``, the rows read from the tokens as the kernel loads them, so
# no pass writes the permuted ``[N, D]`` copy. Its tangent in the weights is ``token_gmm(tokens,
# d_weight)``, the product of the permuted rows kept as the tokens and their row indices; that
# transposes into ``gather_lhs_tgmm``, the weight gradient reading the tokens by index (the gathered
# rows are the kernel's wide operand: gathering them as the transposed one ran 47% slower than the
# copy costs, ``benchmarks/NOTES.md``). ``token_gmm`` and ``gather_lhs_tgmm`` are bilinear and
# transpose into each other (and into ``gmm`` followed by ``unpermute`` in the tokens), as ``gmm``
# and ``tgmm`` do. A backend without ``gather_lhs_tgmm`` differentiates the permuted rows' program.


def _gather_swiglu_gmm_impl(tokens, gate_rhs, up_rhs, group_sizes, token_of_row, inverse, *, kernels,
                            preferred_element_type, with_preactivations):
    out = kernels.gather_swiglu_gmm(tokens, gate_rhs, up_rhs, token_of_row, group_sizes, group_offset=0,
                                    preferred_element_type=preferred_element_type,
                                    with_preactivations=with_preactivations)
    return tuple(out) if with_preactivations else (out,)


def _gather_swiglu_gmm_shape(tokens, gate_rhs, up_rhs, group_sizes, token_of_row, inverse, *, preferred_element_type,
                             with_preactivations, **_):
    out = ((token_of_row.shape[0], gate_rhs.shape[2]),
           _out_dtype(preferred_element_type, tokens.dtype, gate_rhs.dtype, up_rhs.dtype))
    return [out] * (3 if with_preactivations else 1)


def _gather_swiglu_gmm_jvp(primals, tangents, *, kernels, preferred_element_type, with_preactivations, batch):
    tokens, gate_rhs, up_rhs, group_sizes, token_of_row, inverse = primals

    def permuted(x):
        return permute_p.bind(x, token_of_row, inverse, batch=_levels(batch, 0, 4, 5))

    rows_dot = permuted(tangents[0]) if _nonzero(tangents[0]) else tangents[0]
    if kernels.gather_lhs_tgmm is None:
        return _swiglu_gmm_jvp((permuted(tokens), gate_rhs, up_rhs, group_sizes), (rows_dot, *tangents[1:4]),
                               kernels=kernels, group_offset=0, preferred_element_type=preferred_element_type,
                               with_preactivations=with_preactivations, batch=_levels(batch, ALL, 1, 2, 3))
    out, gate, up = gather_swiglu_gmm_p.bind(*primals, kernels=kernels, preferred_element_type=preferred_element_type,
                                             with_preactivations=True, batch=batch)
    primal_outs = [out, gate, up] if with_preactivations else [out]
    if not any(_nonzero(t) for t in tangents[:3]):
        return primal_outs, [_compat.zero_tangent(v) for v in primal_outs]
    options = dict(kernels=kernels, preferred_element_type=out.dtype)
    gate_terms, up_terms = [], []
    if _nonzero(rows_dot):
        t_gate, t_up = gmm_pair_p.bind(rows_dot, gate_rhs, up_rhs, group_sizes, group_offset=0, zero_outside=True,
                                       expected_rows=None, batch=_levels(batch, ALL, 1, 2, 3), **options)
        gate_terms.append(t_gate)
        up_terms.append(t_up)
    for terms, index in ((gate_terms, 1), (up_terms, 2)):
        if _nonzero(tangents[index]):
            terms.append(token_gmm_p.bind(tokens, tangents[index], group_sizes, token_of_row, inverse,
                                          batch=_levels(batch, 0, index, 3, 4, 5), **options))
    return primal_outs, _swiglu_out_tangents(gate, up, gate_terms, up_terms, with_preactivations, batch)


def _token_gmm_impl(tokens, rhs, group_sizes, token_of_row, inverse, *, kernels, preferred_element_type):
    return kernels.gmm(_take_rows(tokens, token_of_row), rhs, group_sizes, group_offset=0, transpose_rhs=False,
                       preferred_element_type=preferred_element_type, zero_outside=True, expected_rows=None)


def _token_gmm_shape(tokens, rhs, group_sizes, token_of_row, inverse, *, preferred_element_type, **_):
    return [((token_of_row.shape[0], rhs.shape[2]), _out_dtype(preferred_element_type, tokens.dtype, rhs.dtype))]


def _unpermuted_gmm(lhs, rhs, group_sizes, token_of_row, inverse, dtype, *, kernels, transpose_rhs, batch, sources):
    """``unpermute(gmm(lhs, rhs))``: a cotangent in the tokens of a product of their permuted rows
    (``sources``: the operands' positions, as ``_levels`` takes them)."""
    rows = gmm_p.bind(lhs, rhs, group_sizes, kernels=kernels, group_offset=0, transpose_rhs=transpose_rhs,
                      preferred_element_type=dtype, zero_outside=True, expected_rows=None,
                      batch=_levels(batch, *sources[:3]))
    return unpermute_p.bind(rows, token_of_row, inverse, dtype=dtype, batch=_levels(batch, ALL, *sources[3:]))


def _token_gmm_transpose(ct, tokens, rhs, group_sizes, token_of_row, inverse, *, kernels, preferred_element_type,
                         batch):
    del preferred_element_type
    if not _nonzero(ct):
        return [None] * 5
    if _compat.is_undefined_primal(tokens):  # d_tokens = unpermute(ct @ rhs[g]^T)
        d_tokens = _unpermuted_gmm(ct, rhs, group_sizes, token_of_row, inverse, tokens.aval.dtype, kernels=kernels,
                                   transpose_rhs=True, batch=batch, sources=(ALL, 1, 2, 3, 4))
        return [_sum_unbatched(d_tokens, batch, 0), None, None, None, None]
    d_rhs = gather_lhs_tgmm_p.bind(tokens, ct, group_sizes, token_of_row, inverse, kernels=kernels,
                                   num_groups=_core_shape(rhs.aval, batch, 1)[0], preferred_element_type=rhs.aval.dtype,
                                   batch=_levels(batch, 0, ALL, 2, 3, 4))
    return [None, _sum_unbatched(d_rhs, batch, 1), None, None, None]


def _gather_lhs_tgmm_impl(tokens, grad, group_sizes, token_of_row, inverse, *, kernels, num_groups,
                          preferred_element_type):
    return kernels.gather_lhs_tgmm(tokens, grad, token_of_row, group_sizes, num_groups=num_groups, group_offset=0,
                                   preferred_element_type=preferred_element_type)


def _gather_lhs_tgmm_shape(tokens, grad, group_sizes, token_of_row, inverse, *, num_groups, preferred_element_type,
                           **_):
    return [((num_groups, tokens.shape[1], grad.shape[1]), _out_dtype(preferred_element_type, tokens.dtype,
                                                                         grad.dtype))]


def _gather_lhs_tgmm_transpose(ct, tokens, grad, group_sizes, token_of_row, inverse, *, kernels, num_groups,
                               preferred_element_type, batch):
    del num_groups, preferred_element_type
    if not _nonzero(ct):
        return [None] * 5
    if _compat.is_undefined_primal(tokens):  # d_tokens = unpermute(grad[r] @ ct[g]^T)
        d_tokens = _unpermuted_gmm(grad, ct, group_sizes, token_of_row, inverse, tokens.aval.dtype, kernels=kernels,
                                   transpose_rhs=True, batch=batch, sources=(1, ALL, 2, 3, 4))
        return [_sum_unbatched(d_tokens, batch, 0), None, None, None, None]
    d_grad = token_gmm_p.bind(tokens, ct, group_sizes, token_of_row, inverse, kernels=kernels,  # tokens[r] @ ct[g]
                              preferred_element_type=grad.aval.dtype, batch=_levels(batch, 0, ALL, 2, 3, 4))
    return [None, _sum_unbatched(d_grad, batch, 1), None, None, None]


gather_swiglu_gmm_p = _define("moe_gather_swiglu_gmm", _gather_swiglu_gmm_impl, _gather_swiglu_gmm_shape,
                              multiple_results=True, jvp=_gather_swiglu_gmm_jvp)
token_gmm_p = _define("moe_token_gmm", _token_gmm_impl, _token_gmm_shape, jvp="bilinear",
                      transpose=_token_gmm_transpose)
gather_lhs_tgmm_p = _define("moe_gather_lhs_tgmm", _gather_lhs_tgmm_impl, _gather_lhs_tgmm_shape, jvp="bilinear",
                            transpose=_gather_lhs_tgmm_transpose)


# --------------------------------------------------------------------------- the last product and the combine
# ``expert_combine(rows, weight, weights, group_sizes, inverse, token_of_row, order, num_valid)`` is
# ``combine(gmm(rows, weight), weights)``: the expert program's last product and the weighted combine
# as one piece, so that its backward is computed the way SonicMoE does it. Apart, the combine's
# transpose writes ``spread(ct, weights)`` (an ``[N, D]`` scaled copy of the output's cotangent) for
# the product's two transposes to read, and its weights' cotangent re-reads the product's ``[N, D]``
# output. Here the tangent is one primitive, linear in the three tangents together, whose transpose
# gathers the cotangent's rows inside the products' loads (``gather_gmm``, ``gather_tgmm``) and gets
# the weights' cotangent from the same product in ``gather_gmm``'s epilogue:
# ``d_weights[t, j] = ct[t] . (rows[r] @ weight[e]) = (ct[t] @ weight[e]^T) . rows[r]``.
# The fused backward pieces differentiate (forward mode, higher orders) through their unfused
# composition of the primitives above, so the set stays closed under differentiation.


def _expert_combine_impl(rows, weight, route_weights, group_sizes, inverse, token_of_row, order, num_valid, *,
                         kernels, preferred_element_type):
    # The dropped rows (past num_valid, outside the groups) are never read by combine: not zeroed.
    out_rows = kernels.gmm(rows, weight, group_sizes, group_offset=0, transpose_rhs=False,
                           preferred_element_type=preferred_element_type, zero_outside=False, expected_rows=None)
    return _combine_impl(out_rows, route_weights, inverse, token_of_row, order, num_valid, dtype=out_rows.dtype)


def _expert_combine_unfused(rows, weight, route_weights, group_sizes, inverse, token_of_row, order, num_valid, *,
                            kernels, preferred_element_type):
    """``expert_combine`` as the two primitives it fuses (what its pieces differentiate through)."""
    out_rows = gmm_p.bind(rows, weight, group_sizes, kernels=kernels, group_offset=0, transpose_rhs=False,
                          preferred_element_type=preferred_element_type, zero_outside=True, expected_rows=None,
                          batch=())
    return combine_p.bind(out_rows, route_weights, inverse, token_of_row, order, num_valid, dtype=out_rows.dtype,
                          batch=())


def _expert_combine_shape(rows, weight, route_weights, group_sizes, inverse, token_of_row, order, num_valid, *,
                          preferred_element_type, **_):
    return [((inverse.shape[0], weight.shape[2]), _out_dtype(preferred_element_type, rows.dtype, weight.dtype))]


def _expert_combine_jvp(primals, tangents, *, batch, **params):
    out = expert_combine_p.bind(*primals, batch=batch, **params)
    present = tuple(_nonzero(t) for t in tangents[:3])
    if not any(present):
        return out, _compat.zero_tangent(out)
    linear = [t for t, given in zip(tangents[:3], present) if given]
    sources = [i for i, given in enumerate(present) if given]
    t_out = expert_combine_tangent_p.bind(*linear, *primals, present=present,
                                          batch=_levels(batch, *sources, *range(8)), **params)
    return out, t_out


def _tangent_terms(combine_fn, operands, present, params):
    """The tangent of the trilinear ``combine_fn(rows, weight, weights, ...)``: one term per given tangent."""
    tangents = iter(operands[:sum(present)])
    primals = list(operands[sum(present):])
    terms = []
    for position, given in enumerate(present):
        if given:
            substituted = list(primals)
            substituted[position] = next(tangents)
            terms.append(combine_fn(*substituted, **params))
    return functools.reduce(operator.add, terms)


def _expert_combine_tangent_impl(*operands, present, **params):
    return _tangent_terms(_expert_combine_impl, operands, present, params)


def _expert_combine_tangent_unfused(*operands, present, **params):
    return _tangent_terms(_expert_combine_unfused, operands, present, params)


def _expert_combine_tangent_shape(*operands, present, **params):
    return _expert_combine_shape(*operands[sum(present):], **params)


def _expert_combine_tangent_transpose(ct, *operands, kernels, preferred_element_type, present, batch):
    """All the tangents' cotangents at once: ``gather_gmm`` gives the rows' (the cotangent's rows
    gathered by token, scaled by their routing weight) and, in its epilogue, the routing weights';
    ``gather_tgmm`` the weight's."""
    num_linear = sum(present)
    if not _nonzero(ct):
        return [None] * len(operands)
    linear = dict(zip((i for i, given in enumerate(present) if given), operands[:num_linear]))
    wanted = {i: i in linear and _compat.is_undefined_primal(linear[i]) for i in range(3)}
    rows, weight, route_weights = operands[num_linear:num_linear + 3]
    num_groups = _core_shape(weight.aval, batch, num_linear + 1)[0]
    rows_dtype, weight_dtype, weights_dtype = rows.aval.dtype, weight.aval.dtype, route_weights.aval.dtype

    def cotangents(ct, rows, weight, route_weights, group_sizes, inverse, token_of_row, order, num_valid):
        row_scale = _spread_row_weights(route_weights, order, num_valid, accumulation_dtype(ct.dtype))
        d_rows = d_weight = d_weights = None
        if wanted[0] or wanted[2]:
            d_rows, dots = gather_gmm_p.bind(ct, weight, row_scale, rows, token_of_row, group_sizes, kernels=kernels,
                                             transpose_rhs=True, preferred_element_type=rows_dtype,
                                             with_dots=wanted[2], batch=())
            if wanted[2]:
                valid = _copy_is_valid(inverse, num_valid)
                d_weights = jnp.where(valid, _take_rows(dots, inverse), 0).astype(weights_dtype)
        if wanted[1]:
            d_weight = gather_tgmm_p.bind(rows, ct, row_scale, token_of_row, group_sizes, kernels=kernels,
                                          num_groups=num_groups, preferred_element_type=weight_dtype, batch=())
        return d_rows if wanted[0] else None, d_weight, d_weights

    primal_levels = _levels(batch, ALL, *range(num_linear, num_linear + 8))
    found = _call_batched(cotangents, primal_levels, ct, *operands[num_linear:])
    out = [None] * len(operands)
    for index, position in enumerate(sorted(linear)):
        if wanted[position]:
            out[index] = _sum_unbatched(found[position], batch, index)
    return out


def _composition_jvp(primitive, composition, num_differentiable: int):
    """JVP of a fused primitive through ``composition`` (the same function as primitives with rules of
    their own), differentiating its first ``num_differentiable`` operands: forward mode and higher
    orders need no rules of the fused kernels' own."""

    def jvp(primals, tangents, *, batch, **params):
        out = primitive.bind(*primals, batch=batch, **params)
        n = num_differentiable(params) if callable(num_differentiable) else num_differentiable
        rest = primals[n:]

        def composed(*differentiable):
            return _call_batched(functools.partial(composition, **params), batch, *differentiable, *rest)

        tangents_in = [_compat.instantiate_zeros(t) for t in tangents[:n]]
        _, t_out = jax.jvp(composed, tuple(primals[:n]), tuple(tangents_in))
        return out, (list(t_out) if primitive.multiple_results else t_out)

    return jvp


def _gather_gmm_impl(lhs, rhs, row_scale, dot_with, row_index, group_sizes, *, kernels, transpose_rhs,
                     preferred_element_type, with_dots):
    out, dots = kernels.gather_gmm(lhs, rhs, row_index, row_scale, dot_with if with_dots else None, group_sizes,
                                   group_offset=0, transpose_rhs=transpose_rhs,
                                   preferred_element_type=preferred_element_type)
    return out, (dots if with_dots else jnp.zeros(row_index.shape, accumulation_dtype(out.dtype)))


def _gather_gmm_unfused(lhs, rhs, row_scale, dot_with, row_index, group_sizes, *, kernels, transpose_rhs,
                        preferred_element_type, with_dots):
    out_dtype = _out_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
    acc = accumulation_dtype(out_dtype)
    product = gmm_p.bind(jnp.take(lhs, row_index, axis=0, mode="clip"), rhs, group_sizes, kernels=kernels,
                         group_offset=0, transpose_rhs=transpose_rhs, preferred_element_type=acc, zero_outside=True,
                         expected_rows=None, batch=())
    out = (product * row_scale.astype(acc)[:, None]).astype(out_dtype)
    dots = jnp.sum(product * dot_with.astype(acc), axis=1) if with_dots else jnp.zeros(row_index.shape, acc)
    return out, dots


def _gather_gmm_shape(lhs, rhs, row_scale, dot_with, row_index, group_sizes, *, transpose_rhs, preferred_element_type,
                      **_):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = _out_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
    return [((row_index.shape[0], n), out_dtype), (row_index.shape, accumulation_dtype(out_dtype))]


def _gather_tgmm_impl(lhs, grad, grad_scale, grad_index, group_sizes, *, kernels, num_groups, preferred_element_type):
    return kernels.gather_tgmm(lhs, grad, grad_index, grad_scale, group_sizes, num_groups=num_groups, group_offset=0,
                               preferred_element_type=preferred_element_type)


def _gather_tgmm_unfused(lhs, grad, grad_scale, grad_index, group_sizes, *, kernels, num_groups,
                         preferred_element_type):
    acc = accumulation_dtype(grad.dtype)
    rows = jnp.take(grad, grad_index, axis=0, mode="clip").astype(acc) * grad_scale.astype(acc)[:, None]
    return tgmm_p.bind(lhs, rows.astype(grad.dtype), group_sizes, kernels=kernels, num_groups=num_groups,
                       group_offset=0, preferred_element_type=preferred_element_type, expected_rows=None, batch=())


def _gather_tgmm_shape(lhs, grad, grad_scale, grad_index, group_sizes, *, num_groups, preferred_element_type, **_):
    return [((num_groups, lhs.shape[1], grad.shape[1]), _out_dtype(preferred_element_type, lhs.dtype, grad.dtype))]


expert_combine_p = _define("moe_expert_combine", _expert_combine_impl, _expert_combine_shape, jvp=_expert_combine_jvp)
expert_combine_tangent_p = _define("moe_expert_combine_tangent", _expert_combine_tangent_impl,
                                   _expert_combine_tangent_shape, transpose=_expert_combine_tangent_transpose)
_compat.primitive_jvps[expert_combine_tangent_p] = _composition_jvp(
    expert_combine_tangent_p, _expert_combine_tangent_unfused, lambda params: sum(params["present"]) + 3)
gather_gmm_p = _define("moe_gather_gmm", _gather_gmm_impl, _gather_gmm_shape, multiple_results=True)
_compat.primitive_jvps[gather_gmm_p] = _composition_jvp(gather_gmm_p, _gather_gmm_unfused, 4)
gather_tgmm_p = _define("moe_gather_tgmm", _gather_tgmm_impl, _gather_tgmm_shape)
_compat.primitive_jvps[gather_tgmm_p] = _composition_jvp(gather_tgmm_p, _gather_tgmm_unfused, 3)


# --------------------------------------------------------------------------- entry points


def _offset(group_offset) -> int:
    return operator.index(group_offset)  # a static int, as the custom_vjp's nondiff argument was


def _dtype_or_none(dtype):
    return None if dtype is None else jnp.dtype(dtype)


def gmm(lhs, rhs, group_sizes, kernels, *, group_offset=0, transpose_rhs=False, preferred_element_type=None,
        zero_outside=True, expected_rows=None):
    """``kernels.gmm`` (``lhs[r] @ rhs[group(r)]``) as a differentiable primitive."""
    return gmm_p.bind(lhs, rhs, group_sizes, kernels=kernels, group_offset=_offset(group_offset),
                      transpose_rhs=bool(transpose_rhs), preferred_element_type=_dtype_or_none(preferred_element_type),
                      zero_outside=bool(zero_outside), expected_rows=expected_rows, batch=())


def tgmm(lhs, grad, group_sizes, kernels, *, num_groups, group_offset=0, preferred_element_type=None,
         expected_rows=None):
    """``kernels.tgmm`` (``lhs_g^T @ grad_g`` per group) as a differentiable primitive."""
    return tgmm_p.bind(lhs, grad, group_sizes, kernels=kernels, num_groups=int(num_groups),
                       group_offset=_offset(group_offset),
                       preferred_element_type=_dtype_or_none(preferred_element_type), expected_rows=expected_rows,
                       batch=())


def gmm_pair(lhs, rhs_a, rhs_b, group_sizes, kernels, *, group_offset=0, preferred_element_type=None,
             zero_outside=True, expected_rows=None):
    """``(gmm(lhs, rhs_a), gmm(lhs, rhs_b))`` through ``kernels.gmm_pair`` where the backend has it;
    the rows' cotangents of both products are added in float32 (or wider)."""
    return tuple(gmm_pair_p.bind(lhs, rhs_a, rhs_b, group_sizes, kernels=kernels, group_offset=_offset(group_offset),
                                 preferred_element_type=_dtype_or_none(preferred_element_type),
                                 zero_outside=bool(zero_outside), expected_rows=expected_rows, batch=()))


def swiglu_gmm(lhs, gate_rhs, up_rhs, group_sizes, kernels, *, group_offset=0, preferred_element_type=None):
    """``silu(lhs @ gate[g]) * (lhs @ up[g])`` through ``kernels.swiglu_gmm`` (or the jnp reference)."""
    (out,) = swiglu_gmm_p.bind(lhs, gate_rhs, up_rhs, group_sizes, kernels=kernels, group_offset=_offset(group_offset),
                               preferred_element_type=_dtype_or_none(preferred_element_type),
                               with_preactivations=False, batch=())
    return out


def swiglu_rows(gate, up, num_rows, kernels):
    """``silu(gate) * up`` on rows ``[0, num_rows)`` through ``kernels.swiglu_rows`` (or the jnp
    reference); later rows unspecified, in the forward and in every derivative."""
    return swiglu_rows_p.bind(gate, up, jnp.asarray(num_rows, jnp.int32), kernels=kernels, batch=())


def permute(tokens, token_of_row, inverse):
    """``rows[r] = tokens[token_of_row[r]]``; transposes to adding each token's copies."""
    return permute_p.bind(tokens, token_of_row, inverse, batch=())


def combine(rows, weights, inverse, token_of_row, order, num_valid):
    """``out[t] = sum_j weights[t, j] * rows[inverse[t, j]]`` in ``rows``' type, accumulated in
    float32 (or wider); copies in rows ``[num_valid, N)`` (dropped) contribute nothing."""
    return combine_p.bind(rows, weights, inverse, token_of_row, order, jnp.asarray(num_valid, jnp.int32),
                          dtype=jnp.dtype(rows.dtype), batch=())


def gather_swiglu_gmm(tokens, gate_rhs, up_rhs, group_sizes, token_of_row, inverse, kernels, *,
                      preferred_element_type=None):
    """``swiglu_gmm(permute(tokens), gate_rhs, up_rhs)`` (all groups local) with the rows read from the
    tokens, through ``kernels.gather_swiglu_gmm``."""
    return gather_swiglu_gmm_p.bind(tokens, gate_rhs, up_rhs, group_sizes, token_of_row, inverse, kernels=kernels,
                                    preferred_element_type=_dtype_or_none(preferred_element_type),
                                    with_preactivations=False, batch=())[0]


def expert_combine(rows, weight, route_weights, routing_inverse, token_of_row, order, group_sizes, kernels, *,
                   preferred_element_type=None):
    """``combine(gmm(rows, weight), route_weights)`` (all groups local, dropped copies past
    ``group_sizes.sum()``), its backward on ``kernels.gather_gmm`` / ``gather_tgmm``."""
    num_valid = jnp.sum(group_sizes).astype(jnp.int32)
    return expert_combine_p.bind(rows, weight, route_weights, group_sizes, routing_inverse, token_of_row, order,
                                 num_valid, kernels=kernels,
                                 preferred_element_type=_dtype_or_none(preferred_element_type), batch=())


# --------------------------------------------------------------------------- row gathers on CUDA GPUs
# ``permute`` copies whole token rows into expert order, and ``spread`` (the combine's backward in
# its rows) does the same to the output's cotangent, times each row's routing weight. XLA's gather
# fusion of ``jnp.take`` ran the permutation at about 1.3 TB/s on an H100 (0.43 ms for the 0.5 GB of
# rows of SonicMoE's 1.4B-n256 layer); where Triton and jax_triton load, CUDA lowers both to a
# row-gather kernel instead (``kernels/gather_rows``, 0.32 ms there). ``spread`` could only move
# there once the dropped rows' mask was part of the combine family (``num_valid``): with a separate
# ``where`` on the rows, its transpose stayed an XLA select pass over all rows and the kernel lost.
# Other platforms, batched uses and odd dtypes keep the jnp code.

GPU_ROW_GATHER = True
"""Whether CUDA lowers ``permute`` and ``spread`` to the Triton row gather (False: XLA's gather)."""


@functools.cache
def _triton_gather_rows():
    try:
        from moe_lowering.kernels.gather_rows.triton_launch import gather_rows
    except ImportError:
        return None
    return gather_rows


def _permute_cuda(tokens, token_of_row, inverse, *, batch):
    gather = _triton_gather_rows() if GPU_ROW_GATHER else None
    if gather is None or batch or tokens.ndim != 2:
        return permute_p.impl(tokens, token_of_row, inverse, batch=batch)
    return gather(tokens, token_of_row)


def _spread_cuda(x, weights, inverse, token_of_row, order, num_valid, *, dtype, batch):
    gather = _triton_gather_rows() if GPU_ROW_GATHER else None
    if gather is None or batch or x.ndim != 2:
        return spread_p.impl(x, weights, inverse, token_of_row, order, num_valid, dtype=dtype, batch=batch)
    acc = accumulation_dtype(x.dtype, weights.dtype)
    return gather(x, token_of_row, _spread_row_weights(weights, order, num_valid, acc), dtype)


for _primitive, _lowering in ((permute_p, _permute_cuda), (spread_p, _spread_cuda)):
    _compat._mlir.register_lowering(_primitive, _compat._mlir.lower_fun(_lowering, multiple_results=False),
                                    platform="cuda", cacheable=False)
