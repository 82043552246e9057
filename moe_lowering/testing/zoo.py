"""Dense-reference MoE layers written the way people write them in plain ``jax.numpy``.

Every test of the matcher, every golden-IR test and every benchmark draws its models from here, so
each one is written in the idiom of a real code base (Mixtral/MaxText, DeepSeek-V3, Switch/GShard,
Hugging Face loops, GPT-OSS, Flax) rather than in a form chosen to be easy to match. The negatives
look like MoE layers (an E-like axis, a ``top_k``) but route nothing and must be left alone.

``ZOO[name].args(key, dtype)`` gives ``(params, x)`` for ``ZOO[name].fn(params, x)``. ``fn`` reads
tokens, d_model, d_ff and experts from the array shapes; ``top_k`` and the other routing
hyperparameters are static, so ``ZOO[name].sized(T=..., E=..., k=..., capacity_factor=...)``
rebuilds a model at other sizes (benchmarks use it for large shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

logger = logging.getLogger(__name__)

try:  # Flax is a test extra; the zoo works without it and then simply has no ``flax_moe``.
    import flax.linen as nn
except ImportError:  # pragma: no cover - exercised only where flax is missing
    nn = None
    logger.info("flax is not installed: the zoo has no 'flax_moe' model")


@dataclass(frozen=True)
class Sizes:
    """Shapes of one model: tokens ``T`` (``B * S`` for ``[B, S, d]`` inputs), ``d``, ``f``, ``E``, ``k``."""

    T: int = 32
    d: int = 16
    f: int = 32
    E: int = 8
    k: int = 2
    B: int = 2

    def __post_init__(self):
        for name in ("T", "d", "f", "E", "k", "B"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"size {name} must be a positive int, got {value!r}")
        if self.k > self.E:
            raise ValueError(f"top_k k={self.k} exceeds the number of experts E={self.E}")


@dataclass(frozen=True)
class ZooModel:
    """One dense-reference model: ``fn(params, x)`` plus how to make its arguments and what to expect.

    ``expected_regions`` is how many MoE regions a correct matcher rewrites (0 for negatives);
    ``top_k``, ``num_experts`` and ``capacity`` describe the default sizes (``capacity`` is None
    for dropless models). ``hyper`` holds the static routing hyperparameters ``sized`` accepts.
    ``style`` is the idiom: ``mixtral`` (one-hot or scatter ``[T, E]`` combine of dense experts),
    ``deepseek``, ``capacity`` (Switch/GShard ``[T, E, C]`` dispatch), ``hf_loop``, ``gather``,
    ``gate_on_tokens`` (the routing weights scale the tokens before the experts), ``one_hot_dispatch``
    (the tokens masked per expert, a loop's outputs stacked), ``separate_experts``
    (E expert modules with weight arrays of their own), ``sorted_range_mask`` (copies sorted by expert,
    each one's own expert kept by a range mask of the sorted positions), ``tiled_per_choice`` (the tokens
    repeated per choice, each copy's own expert selected by a one-hot after every expert product) or
    ``negative``.
    """

    name: str
    fn: Callable
    make_params: Callable[..., Any]
    make_inputs: Callable[..., jax.Array]
    expected_regions: int
    style: str
    top_k: int | None
    num_experts: int | None
    capacity: int | None
    notes: str
    sizes: Sizes = field(default_factory=Sizes)
    hyper: tuple[tuple[str, Any], ...] = ()
    builder: Callable[..., "ZooModel"] | None = field(default=None, repr=False, compare=False)

    @property
    def hyperparams(self) -> dict[str, Any]:
        return dict(self.hyper)

    def args(self, key, dtype=jnp.float32) -> tuple[Any, jax.Array]:
        """``(params, x)``: the positional arguments of ``fn`` at the default sizes."""
        params_key, inputs_key = jax.random.split(key)
        return self.make_params(params_key, dtype), self.make_inputs(inputs_key, dtype)

    def sized(self, **overrides) -> "ZooModel":
        """This model rebuilt with other sizes (``T, d, f, E, k, B``) or routing hyperparameters."""
        if self.builder is None:
            raise TypeError(f"{self.name} has no builder, so it cannot be rebuilt at other sizes")
        size_names = {f.name for f in dataclasses.fields(Sizes)}
        unknown = set(overrides) - size_names - set(self.hyperparams)
        if unknown:
            raise TypeError(
                f"{self.name}.sized() got unknown overrides {sorted(unknown)}; "
                f"sizes are {sorted(size_names)}, hyperparameters {sorted(self.hyperparams)}"
            )
        sizes = dataclasses.replace(self.sizes, **{k: v for k, v in overrides.items() if k in size_names})
        hyper = {**self.hyperparams, **{k: v for k, v in overrides.items() if k not in size_names}}
        return self.builder(sizes, **hyper)


# --------------------------------------------------------------------------------------------
# Parameter initialisation: w ~ N(0, 1/fan_in) like a lecun-normal init, biases ~ N(0, 0.01); never zeros.


@dataclass(frozen=True)
class _Normal:
    """A parameter ``N(0, std**2)`` of ``shape``; param makers return trees of these."""

    shape: tuple[int, ...]
    std: float


def _weight(shape, fan_in) -> _Normal:
    return _Normal(tuple(shape), 1.0 / math.sqrt(fan_in))


def _bias(shape, std=0.1) -> _Normal:
    return _Normal(tuple(shape), std)


def _swiglu_experts(sizes: Sizes) -> dict:
    E, d, f = sizes.E, sizes.d, sizes.f
    return {"w_gate": _weight((E, d, f), d), "w_up": _weight((E, d, f), d), "w_down": _weight((E, f, d), f)}


def _mlp_experts(sizes: Sizes, biases: bool) -> dict:
    E, d, f = sizes.E, sizes.d, sizes.f
    params = {"w_up": _weight((E, d, f), d), "w_down": _weight((E, f, d), f)}
    if biases:
        params["b_up"] = _bias((E, f))
        params["b_down"] = _bias((E, d))
    return params


def _with_router(sizes: Sizes, experts: dict) -> dict:
    return {"router": _weight((sizes.d, sizes.E), sizes.d), **experts}


# Up to this many elements, a model's params are cut from one normal draw: at test sizes the compile
# of one random program per weight dominates. Above it, each weight gets its own draw, so that no
# float32 buffer of all the params is ever live (benchmark sizes).
_ONE_DRAW_LIMIT = 1 << 24


def _draw(key, spec, dtype):
    """Arrays for a tree of ``_Normal`` specs, made by one jitted program."""
    leaves, treedef = jax.tree.flatten(spec)
    return _draw_leaves(key, treedef, tuple(leaves), jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_leaves(key, treedef, leaves, dtype):
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    if sum(sizes) <= _ONE_DRAW_LIMIT:
        flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        units = [flat[start:start + size].reshape(leaf.shape) for start, size, leaf in zip(starts, sizes, leaves)]
    else:
        units = [jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32) for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, [(unit * leaf.std).astype(dtype) for unit, leaf in zip(units, leaves)])


def _token_inputs(sizes: Sizes):
    def make_inputs(key, dtype=jnp.float32, **overrides):
        s = dataclasses.replace(sizes, **overrides)
        return _random_tokens(key, s.T * s.d, jnp.dtype(dtype)).reshape(s.T, s.d)

    return make_inputs


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_tokens(key, size, dtype):
    """``size`` unit normals, drawn flat so that ``[T, d]`` and ``[B, S, d]`` share one compile."""
    return jax.random.normal(key, (size,), jnp.float32).astype(dtype)


def _params_maker(sizes: Sizes, spec):
    """``spec(sizes)`` (a tree of ``_Normal``) as ``make_params(key, dtype=float32, **size_overrides)``.

    All of a model's params come from one jitted normal draw: one small compile per model instead
    of one per weight shape, and made on device at benchmark sizes.
    """

    def make_params(key, dtype=jnp.float32, **overrides):
        return _draw(key, spec(dataclasses.replace(sizes, **overrides)), dtype)

    return make_params


def _mixtral_params(sizes):
    return _with_router(sizes, _swiglu_experts(sizes))


# --------------------------------------------------------------------------------------------
# Routers, as the Mixtral-style code bases write them.


def _softmax_topk_renormalise(logits, k):
    """Mixtral / MaxText: softmax over all experts, keep the top k, renormalise them to sum to 1."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, idx = lax.top_k(probs, k)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, idx


def _onehot_combine(weights, idx, num_experts, dtype):
    """``[..., E]`` combine weights: zero except at the chosen experts."""
    return (jax.nn.one_hot(idx, num_experts, dtype=dtype) * weights.astype(dtype)[..., None]).sum(axis=-2)


# --------------------------------------------------------------------------------------------
# Mixtral family: softmax -> top_k -> renormalise, experts as einsums over all tokens.


def _mixtral_fn(k: int):
    def mixtral(params, x):
        """Mixtral-8x7B as a dense reference: every expert on every token, then a [T, E] combine."""
        num_experts = params["router"].shape[-1]
        router_logits = x @ params["router"]
        weights, idx = _softmax_topk_renormalise(router_logits, k)
        combine = _onehot_combine(weights, idx, num_experts, x.dtype)  # [T, E]
        gate = jnp.einsum("td,edf->tef", x, params["w_gate"])
        up = jnp.einsum("td,edf->tef", x, params["w_up"])
        hidden = jax.nn.silu(gate) * up
        expert_out = jnp.einsum("tef,efd->ted", hidden, params["w_down"])
        return jnp.einsum("te,ted->td", combine, expert_out)

    return mixtral


def build_mixtral(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="mixtral", fn=_mixtral_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="mixtral", top_k=sizes.k,
        num_experts=sizes.E, capacity=None, sizes=sizes, builder=build_mixtral,
        notes="softmax -> top_k -> renormalise; SwiGLU experts via einsum; combine through one_hot(idx) * w.",
    )


def _mixtral_annotated_fn(k: int):
    def mixtral_annotated(params, x):
        """Mixtral as MaxText annotates it: remat names on the expert activations, sharding constraints
        on the index iota and on the output (identities on one device; the matcher sees through both)."""
        num_experts = params["router"].shape[-1]
        mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

        def constrain(value):
            spec = jax.sharding.PartitionSpec(*([None] * value.ndim))
            return lax.with_sharding_constraint(value, jax.sharding.NamedSharding(mesh, spec))

        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        experts = constrain(jnp.arange(num_experts))
        combine = ((idx[..., None] == experts).astype(x.dtype) * weights[..., None].astype(x.dtype)).sum(-2)
        gate = checkpoint_name(jnp.einsum("td,edf->tef", x, params["w_gate"]), "mlpwi_0")
        up = checkpoint_name(jnp.einsum("td,edf->tef", x, params["w_up"]), "mlpwi_1")
        hidden = jax.nn.silu(gate) * up
        expert_out = checkpoint_name(jnp.einsum("tef,efd->ted", hidden, params["w_down"]), "mlpwo")
        return constrain(jnp.einsum("te,ted->td", combine, expert_out))

    return mixtral_annotated


def build_mixtral_annotated(sizes: Sizes = Sizes()) -> ZooModel:
    return replace(build_mixtral(sizes), name="mixtral_annotated", fn=_mixtral_annotated_fn(sizes.k),
                   builder=build_mixtral_annotated,
                   notes="mixtral with MaxText's annotations: checkpoint_name on the three expert activations, "
                         "with_sharding_constraint on the expert iota and on the output.")


def build_mixtral_square(sizes: Sizes = Sizes(T=32, d=16, f=16, E=16, k=2)) -> ZooModel:
    return replace(build_mixtral(sizes), name="mixtral_square", builder=build_mixtral_square,
                   notes="mixtral with E = d = f (SonicMoE's n = E shapes, Qwen3-Next's): which weight axis counts "
                         "experts follows from how it meets the routing, not from sizes.")


def _mixtral_logits_topk_fn(k: int):
    def mixtral_logits_topk(params, x):
        """Top-k on the router logits, softmax over the k kept logits; fused gate/up weight split in two."""
        num_experts = params["router"].shape[-1]
        router_logits = x @ params["router"]
        top_logits, idx = lax.top_k(router_logits, k)
        weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1)
        combine = _onehot_combine(weights, idx, num_experts, x.dtype)
        gate_up = jnp.einsum("td,edf->tef", x, params["w_gate_up"])
        gate, up = jnp.split(gate_up, 2, axis=-1)
        expert_out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, params["w_down"])
        return jnp.einsum("te,ted->td", combine, expert_out)

    return mixtral_logits_topk


def _fused_swiglu_params(sizes):
    E, d, f = sizes.E, sizes.d, sizes.f
    return _with_router(sizes, {"w_gate_up": _weight((E, d, 2 * f), d), "w_down": _weight((E, f, d), f)})


def build_mixtral_logits_topk(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="mixtral_logits_topk", fn=_mixtral_logits_topk_fn(sizes.k),
        make_params=_params_maker(sizes, _fused_swiglu_params), make_inputs=_token_inputs(sizes),
        expected_regions=1, style="mixtral", top_k=sizes.k, num_experts=sizes.E, capacity=None, sizes=sizes,
        builder=build_mixtral_logits_topk,
        notes="top_k on logits then softmax over the k values; fused w_gate_up [E, d, 2f] split by jnp.split.",
    )


def _mixtral_bsd_fn(k: int):
    def mixtral_bsd(params, x):
        """MaxText layout: ``x [B, S, d]`` and every einsum keeps the batch and sequence axes."""
        num_experts = params["router"].shape[-1]
        router_logits = jnp.einsum("bsd,de->bse", x, params["router"])
        weights, idx = _softmax_topk_renormalise(router_logits, k)
        combine = _onehot_combine(weights, idx, num_experts, x.dtype)  # [B, S, E]
        gate = jnp.einsum("bsd,edf->bsef", x, params["w_gate"])
        up = jnp.einsum("bsd,edf->bsef", x, params["w_up"])
        expert_out = jnp.einsum("bsef,efd->bsed", jax.nn.silu(gate) * up, params["w_down"])
        return jnp.einsum("bse,bsed->bsd", combine, expert_out)

    return mixtral_bsd


def _bsd_inputs(sizes: Sizes):
    def make_inputs(key, dtype=jnp.float32, **overrides):
        s = dataclasses.replace(sizes, **overrides)
        if s.T % s.B:
            raise ValueError(f"tokens T={s.T} must be a multiple of the batch B={s.B} for [B, S, d] inputs")
        return _random_tokens(key, s.T * s.d, jnp.dtype(dtype)).reshape(s.B, s.T // s.B, s.d)

    return make_inputs


def build_mixtral_bsd(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="mixtral_bsd", fn=_mixtral_bsd_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_bsd_inputs(sizes), expected_regions=1, style="mixtral", top_k=sizes.k, num_experts=sizes.E,
        capacity=None, sizes=sizes, builder=build_mixtral_bsd,
        notes="mixtral on [B, S, d] inputs (B * S = T tokens), einsums over 'bsd'.",
    )


# --------------------------------------------------------------------------------------------
# Activation and bias variants: same Mixtral routing, other expert bodies.


def _mlp_fn(name: str, k: int, activation: Callable, biases: bool):
    def mlp_moe(params, x):
        num_experts = params["router"].shape[-1]
        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        combine = _onehot_combine(weights, idx, num_experts, x.dtype)
        hidden = jnp.einsum("td,edf->tef", x, params["w_up"])
        if biases:
            hidden = hidden + params["b_up"]
        hidden = activation(hidden)
        expert_out = jnp.einsum("tef,efd->ted", hidden, params["w_down"])
        if biases:
            expert_out = expert_out + params["b_down"]
        return jnp.einsum("te,ted->td", combine, expert_out)

    mlp_moe.__name__ = mlp_moe.__qualname__ = name
    mlp_moe.__doc__ = f"Non-gated expert MLP ({name}) with Mixtral routing."
    return mlp_moe


def squared_relu(x):
    """Primer / Nemotron activation: ``relu(x) ** 2``."""
    return jnp.square(jax.nn.relu(x))


def _gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


_MLP_VARIANTS = {
    "mlp_gelu": (_gelu_exact, False, "GELU (erf) expert MLP, no gate."),
    "mlp_relu_bias": (jax.nn.relu, True, "ReLU expert MLP with per-expert biases b_up [E, f], b_down [E, d]."),
    "mlp_squared_relu": (squared_relu, False, "squared-ReLU expert MLP, no gate."),
}


def _build_mlp(name: str):
    activation, biases, notes = _MLP_VARIANTS[name]

    def build(sizes: Sizes = Sizes()) -> ZooModel:
        def spec(s):
            return _with_router(s, _mlp_experts(s, biases))

        return ZooModel(
            name=name, fn=_mlp_fn(name, sizes.k, activation, biases), make_params=_params_maker(sizes, spec),
            make_inputs=_token_inputs(sizes), expected_regions=1, style="mixtral", top_k=sizes.k,
            num_experts=sizes.E, capacity=None, sizes=sizes, builder=build, notes=notes,
        )

    return build


def _gpt_oss_fn(k: int, limit: float, alpha: float):
    def gpt_oss(params, x):
        """GPT-OSS experts: interleaved fused gate/up with biases, clamped SwiGLU ``(up + 1) * glu``.

        The router is a biased linear layer; top-k on its logits, softmax over the k values, and the
        combine weights scattered into ``[T, E]`` and applied by a broadcast multiply and a sum.
        """
        num_tokens, num_experts = x.shape[0], params["router"].shape[-1]
        router_logits = x @ params["router"] + params["router_bias"]
        top_logits, idx = lax.top_k(router_logits, k)
        top_weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        routing_weights = jnp.zeros((num_tokens, num_experts), x.dtype)
        routing_weights = routing_weights.at[jnp.arange(num_tokens)[:, None], idx].set(top_weights)
        gate_up = jnp.einsum("td,edf->tef", x, params["w_gate_up"]) + params["b_gate_up"]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        glu = gate * jax.nn.sigmoid(gate * alpha)
        expert_out = jnp.einsum("tef,efd->ted", (up + 1) * glu, params["w_down"]) + params["b_down"]
        return (expert_out * routing_weights[..., None]).sum(axis=1)

    return gpt_oss


def _gpt_oss_params(sizes):
    E, d, f = sizes.E, sizes.d, sizes.f
    return _with_router(sizes, {
        "router_bias": _bias((E,)),
        "w_gate_up": _weight((E, d, 2 * f), d),
        "b_gate_up": _bias((E, 2 * f)),
        "w_down": _weight((E, f, d), f),
        "b_down": _bias((E, d)),
    })


def build_gpt_oss(sizes: Sizes = Sizes(), *, limit: float = 1.0, alpha: float = 1.702) -> ZooModel:
    return ZooModel(
        name="gpt_oss", fn=_gpt_oss_fn(sizes.k, limit, alpha), make_params=_params_maker(sizes, _gpt_oss_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="mixtral", top_k=sizes.k,
        num_experts=sizes.E, capacity=None, sizes=sizes, hyper=(("limit", limit), ("alpha", alpha)),
        builder=build_gpt_oss,
        notes="clipped SwiGLU with biases, interleaved gate/up (::2, 1::2); limit 1.0 (GPT-OSS uses 7.0) "
              "so that the clamps are active at unit-scale activations.",
    )


# --------------------------------------------------------------------------------------------
# DeepSeek-V3: sigmoid scores, selection bias, group-limited top-k, scatter combine, shared expert.


def _deepseek_v3_fn(k: int, n_group: int, topk_group: int, routed_scaling_factor: float):
    def deepseek_v3(params, x):
        """DeepSeek-V3 MoE: the bias steers selection only; weights come from the unbiased sigmoid scores."""
        num_tokens, num_experts = x.shape[0], params["router"].shape[-1]
        logits = x.astype(jnp.float32) @ params["router"].astype(jnp.float32)
        scores = jax.nn.sigmoid(logits)
        scores_for_choice = scores + params["e_score_correction_bias"].astype(jnp.float32)
        grouped = scores_for_choice.reshape(num_tokens, n_group, num_experts // n_group)
        group_scores = lax.top_k(grouped, 2)[0].sum(axis=-1)  # [T, n_group]
        _, group_idx = lax.top_k(group_scores, topk_group)
        group_mask = jnp.zeros((num_tokens, n_group), jnp.float32).at[jnp.arange(num_tokens)[:, None], group_idx].set(1.0)
        score_mask = jnp.repeat(group_mask, num_experts // n_group, axis=-1)  # [T, E]
        masked_scores = jnp.where(score_mask > 0, scores_for_choice, -jnp.inf)
        _, idx = lax.top_k(masked_scores, k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * routed_scaling_factor
        gates = jnp.zeros((num_tokens, num_experts), x.dtype).at[jnp.arange(num_tokens)[:, None], idx].set(
            weights.astype(x.dtype)
        )
        hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, params["w_gate"])) * jnp.einsum(
            "td,edf->tef", x, params["w_up"]
        )
        routed = jnp.einsum("te,tef,efd->td", gates, hidden, params["w_down"])
        shared = (jax.nn.silu(x @ params["shared_gate"]) * (x @ params["shared_up"])) @ params["shared_down"]
        return routed + shared

    return deepseek_v3


def _deepseek_v3_params(sizes):
    d, f = sizes.d, sizes.f
    return {
        **_with_router(sizes, _swiglu_experts(sizes)),
        "e_score_correction_bias": _bias((sizes.E,)),
        "shared_gate": _weight((d, f), d),
        "shared_up": _weight((d, f), d),
        "shared_down": _weight((f, d), f),
    }


def build_deepseek_v3(sizes: Sizes = Sizes(), *, n_group: int = 2, topk_group: int = 1,
                      routed_scaling_factor: float = 2.5) -> ZooModel:
    if sizes.E % n_group or sizes.E // n_group < 2:
        raise ValueError(f"deepseek_v3 needs E={sizes.E} to split into n_group={n_group} groups of >= 2 experts")
    if not 1 <= topk_group <= n_group or sizes.k > topk_group * (sizes.E // n_group):
        raise ValueError(
            f"deepseek_v3 cannot pick k={sizes.k} experts from topk_group={topk_group} of n_group={n_group} groups"
        )
    return ZooModel(
        name="deepseek_v3", fn=_deepseek_v3_fn(sizes.k, n_group, topk_group, routed_scaling_factor),
        make_params=_params_maker(sizes, _deepseek_v3_params), make_inputs=_token_inputs(sizes),
        expected_regions=1, style="deepseek", top_k=sizes.k, num_experts=sizes.E, capacity=None, sizes=sizes,
        hyper=(("n_group", n_group), ("topk_group", topk_group), ("routed_scaling_factor", routed_scaling_factor)),
        builder=build_deepseek_v3,
        notes="sigmoid + selection bias, group-limited top-k, scaling factor, scatter-built [T, E] gates, "
              "3-operand combine einsum, dense shared expert beside the routed ones.",
    )


# --------------------------------------------------------------------------------------------
# Switch / GShard: capacity-limited dispatch through [T, E, C] masks.


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * T * k / E)`` slots per expert."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def _switch_fn(capacity_factor: float):
    def switch(params, x):
        """Switch Transformer (top-1, argmax) with capacity; tokens past an expert's capacity are dropped.

        Position in expert = cumsum over tokens of the one-hot choice; a dropped token gets no expert
        and its output is zero (the residual around the layer carries it in a real model).
        """
        num_tokens, num_experts = x.shape[0], params["router"].shape[-1]
        capacity = expert_capacity(num_tokens, num_experts, 1, capacity_factor)
        router_probs = jax.nn.softmax((x @ params["router"]).astype(jnp.float32), axis=-1)
        expert_index = jnp.argmax(router_probs, axis=-1)
        expert_mask = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32)  # [T, E]
        expert_gate = (router_probs * expert_mask).sum(axis=-1)  # [T]
        position_in_expert = jnp.cumsum(expert_mask, axis=0) * expert_mask - 1  # -1 where not chosen
        expert_mask = expert_mask * (position_in_expert < capacity)
        dispatch = jax.nn.one_hot(position_in_expert, capacity, dtype=x.dtype) * expert_mask[..., None].astype(x.dtype)
        combine = dispatch * expert_gate.astype(x.dtype)[:, None, None]  # [T, E, C]
        expert_inputs = jnp.einsum("tec,td->ecd", dispatch, x)
        hidden = jax.nn.relu(jnp.einsum("ecd,edf->ecf", expert_inputs, params["w_up"]))
        expert_outputs = jnp.einsum("ecf,efd->ecd", hidden, params["w_down"])
        return jnp.einsum("tec,ecd->td", combine, expert_outputs)

    return switch


def _gshard_top2_fn(capacity_factor: float, combine_by_outer_products: bool = False):
    def gshard_top2(params, x):
        """GShard top-2 gating with capacity: second choices queue after all first choices of an expert.

        Gates are renormalised over the two choices before any drop (as GShard does); a dropped
        choice simply contributes nothing. ``combine_by_outer_products``: combine is built as praxis
        and AXLearn build it, one ``einsum('te,tc->tec')`` outer product per choice, and the dispatch
        tensor is ``combine != 0``; the same layer.
        """
        num_tokens, num_experts = x.shape[0], params["router"].shape[-1]
        capacity = expert_capacity(num_tokens, num_experts, 2, capacity_factor)
        router_probs = jax.nn.softmax((x @ params["router"]).astype(jnp.float32), axis=-1)
        gates, index = lax.top_k(router_probs, 2)
        gates = gates / (gates.sum(axis=-1, keepdims=True) + 1e-9)
        mask_1 = jax.nn.one_hot(index[:, 0], num_experts, dtype=jnp.int32)
        mask_2 = jax.nn.one_hot(index[:, 1], num_experts, dtype=jnp.int32)
        position_1 = jnp.cumsum(mask_1, axis=0) - 1
        mask_1 = mask_1 * (position_1 < capacity)
        position_2 = jnp.cumsum(mask_2, axis=0) - 1 + mask_1.sum(axis=0, keepdims=True)
        mask_2 = mask_2 * (position_2 < capacity)
        if combine_by_outer_products:  # praxis / AXLearn: (gate on the chosen expert) x (one-hot slot)
            combine = sum(
                jnp.einsum("te,tc->tec",
                           (gates[:, j] * mask.sum(axis=-1)).astype(x.dtype)[:, None]
                           * jax.nn.one_hot(index[:, j], num_experts, dtype=x.dtype),
                           jax.nn.one_hot((position * mask).sum(axis=-1), capacity, dtype=x.dtype))
                for j, (position, mask) in enumerate(((position_1, mask_1), (position_2, mask_2))))
            dispatch = combine.astype(bool).astype(x.dtype)  # [T, E, C]
        else:
            slots_1 = jax.nn.one_hot(position_1, capacity, dtype=x.dtype) * mask_1[..., None].astype(x.dtype)
            slots_2 = jax.nn.one_hot(position_2, capacity, dtype=x.dtype) * mask_2[..., None].astype(x.dtype)
            dispatch = slots_1 + slots_2  # [T, E, C]
            combine = (gates[:, 0, None, None].astype(x.dtype) * slots_1
                       + gates[:, 1, None, None].astype(x.dtype) * slots_2)
        expert_inputs = jnp.einsum("tec,td->ecd", dispatch, x)
        hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_inputs, params["w_up"]))
        expert_outputs = jnp.einsum("ecf,efd->ecd", hidden, params["w_down"])
        return jnp.einsum("tec,ecd->td", combine, expert_outputs)

    return gshard_top2


def _capacity_params(sizes):
    return _with_router(sizes, _mlp_experts(sizes, biases=False))


def build_switch(sizes: Sizes = Sizes(E=4, k=1), *, capacity_factor: float = 1.0) -> ZooModel:
    if sizes.k != 1:
        raise ValueError(f"switch routes each token to one expert; got k={sizes.k}")
    return ZooModel(
        name="switch", fn=_switch_fn(capacity_factor), make_params=_params_maker(sizes, _capacity_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="capacity", top_k=1, num_experts=sizes.E,
        capacity=expert_capacity(sizes.T, sizes.E, 1, capacity_factor), sizes=sizes,
        hyper=(("capacity_factor", capacity_factor),), builder=build_switch,
        notes="top-1 (argmax) with capacity, [T, E, C] dispatch/combine einsums, ReLU experts. At the default "
              "sizes (T=32, E=4, C=8) and args(jax.random.key(0)) 4 of 32 tokens are dropped.",
    )


def build_gshard_top2(sizes: Sizes = Sizes(E=4, k=2), *, capacity_factor: float = 1.0) -> ZooModel:
    if sizes.k != 2:
        raise ValueError(f"gshard_top2 routes each token to two experts; got k={sizes.k}")
    return ZooModel(
        name="gshard_top2", fn=_gshard_top2_fn(capacity_factor), make_params=_params_maker(sizes, _capacity_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="capacity", top_k=2, num_experts=sizes.E,
        capacity=expert_capacity(sizes.T, sizes.E, 2, capacity_factor), sizes=sizes,
        hyper=(("capacity_factor", capacity_factor),), builder=build_gshard_top2,
        notes="top-2 with capacity, second choices after all first choices, GELU (tanh) experts. At the default "
              "sizes (T=32, E=4, C=16) and args(jax.random.key(0)) 7 of 64 token copies are dropped.",
    )


def build_gshard_top2_outer(sizes: Sizes = Sizes(E=4, k=2), *, capacity_factor: float = 1.0) -> ZooModel:
    return replace(build_gshard_top2(sizes, capacity_factor=capacity_factor), name="gshard_top2_outer",
                   fn=_gshard_top2_fn(capacity_factor, combine_by_outer_products=True), builder=build_gshard_top2_outer,
                   notes="gshard_top2 with combine written as praxis and AXLearn write it: per choice, the gate on the "
                         "chosen expert times the one-hot slot, einsum('te,tc->tec'); dispatch = combine.astype(bool).")


def grouped_expert_capacity(group_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """MaxText's per-group capacity: ``int(max(ceil(S * k / E) * capacity_factor, capacity_factor))``."""
    return int(max(math.ceil(group_tokens * top_k / num_experts) * capacity_factor, capacity_factor))


def _grouped_capacity_fn(k: int, capacity_factor: float, all_to_all_layout: bool = False):
    def grouped_capacity(params, x):
        """MaxText's dense path with ``capacity_factor`` (``RoutedMoE.generate_masks`` / ``dense_matmul``):
        each batch row is a group with its own ``C`` slots per expert; positions count the row's
        (token, choice) pairs in flattened ``[S * k]`` order (a ``[B, S, k, E]`` mask reshaped to
        ``[B, S * k, E]``, cumsum'd, reshaped back); ``one_hot(position, C + 1)[..., 1:]`` drops
        position 0 (not routed or over capacity); dispatch is ``combine.astype(bool)``.
        """
        batch, seq, _ = x.shape
        num_experts = params["router"].shape[-1]
        capacity = grouped_expert_capacity(seq, num_experts, k, capacity_factor)
        top_weights, idx = _softmax_topk_renormalise(x @ params["router"], k)  # [B, S, k]
        expert_mask = jax.nn.one_hot(idx, num_experts, dtype=jnp.int32)  # [B, S, k, E]
        weights = jnp.sum(expert_mask * top_weights[..., None], axis=2).astype(x.dtype)  # [B, S, E]
        mask_fused = expert_mask.reshape(batch, seq * k, num_experts)
        count_fused = jnp.cumsum(mask_fused, axis=1)
        count = count_fused.reshape(batch, seq, k, num_experts)
        kept = jnp.sum(expert_mask * (count <= capacity), axis=2)  # [B, S, E]
        weights = weights * kept
        position = jnp.sum((mask_fused * count_fused).reshape(batch, seq, k, num_experts), axis=2) * kept
        slots = jax.nn.one_hot(position, capacity + 1, dtype=jnp.int32)
        combine = (weights[..., None] * slots)[..., 1:]  # [B, S, E, C]
        dispatch = combine.astype(bool)
        if all_to_all_layout:  # what an all-to-all moves: [G, E, C, d] -> [E, G * C, d], and back
            expert_inputs = jnp.einsum("BSM,BSEC->BECM", x, dispatch)
            expert_inputs = jnp.transpose(expert_inputs, (1, 0, 2, 3)).reshape(num_experts, batch * capacity, -1)
            hidden = jax.nn.silu(jnp.einsum("ERM,EMH->ERH", expert_inputs, params["w_gate"])) * jnp.einsum(
                "ERM,EMH->ERH", expert_inputs, params["w_up"])
            expert_outputs = jnp.einsum("ERH,EHM->ERM", hidden, params["w_down"])
            expert_outputs = jnp.transpose(expert_outputs.reshape(num_experts, batch, capacity, -1), (1, 0, 2, 3))
            return jnp.einsum("BECM,BSEC->BSM", expert_outputs, combine)
        expert_inputs = jnp.einsum("BSM,BSEC->EBCM", x, dispatch)
        hidden = jax.nn.silu(jnp.einsum("EBCM,EMH->EBCH", expert_inputs, params["w_gate"])) * jnp.einsum(
            "EBCM,EMH->EBCH", expert_inputs, params["w_up"])
        expert_outputs = jnp.einsum("EBCH,EHM->EBCM", hidden, params["w_down"])
        return jnp.einsum("EBCM,BSEC->BSM", expert_outputs, combine)

    return grouped_capacity


def _batch_prioritized_fn(capacity_factor: float):
    def batch_prioritized(params, x):
        """V-MoE's batch-prioritised routing (top-1): tokens queue for their expert's capacity in order of
        their router confidence, not their position: positions are a cumsum over the tokens sorted by
        top-1 probability (descending), scattered back to token order."""
        num_tokens, num_experts = x.shape[0], params["router"].shape[-1]
        capacity = expert_capacity(num_tokens, num_experts, 1, capacity_factor)
        probs = jax.nn.softmax(x @ params["router"], axis=-1)
        gate, index = lax.top_k(probs, 1)
        order = jnp.argsort(-gate[:, 0], stable=True)
        mask = jax.nn.one_hot(index[:, 0], num_experts, dtype=jnp.int32)  # [T, E]
        sorted_mask = mask[order]
        sorted_position = jnp.cumsum(sorted_mask, axis=0) * sorted_mask - 1
        position = jnp.zeros_like(sorted_position).at[order].set(sorted_position)
        dispatch = jax.nn.one_hot(position, capacity, dtype=x.dtype) * (mask * (position < capacity))[..., None]
        combine = dispatch * gate.astype(x.dtype)[:, :, None]
        expert_inputs = jnp.einsum("tec,td->ecd", dispatch, x)
        hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_inputs, params["w_up"]), approximate=True)
        return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", hidden, params["w_down"]))

    return batch_prioritized


def build_batch_prioritized(sizes: Sizes = Sizes(E=4, k=1), *, capacity_factor: float = 1.0) -> ZooModel:
    if sizes.k != 1:
        raise ValueError(f"batch_prioritized routes each token to one expert; got k={sizes.k}")
    return ZooModel(
        name="batch_prioritized", fn=_batch_prioritized_fn(capacity_factor),
        make_params=_params_maker(sizes, _capacity_params), make_inputs=_token_inputs(sizes), expected_regions=1,
        style="capacity", top_k=1, num_experts=sizes.E, capacity=expert_capacity(sizes.T, sizes.E, 1, capacity_factor),
        sizes=sizes, hyper=(("capacity_factor", capacity_factor),), builder=build_batch_prioritized,
        notes="V-MoE batch-prioritised routing: capacity filled in order of top-1 probability (argsort, cumsum, "
              "scatter back), [T, E, C] einsums, GELU (tanh) experts.",
    )


def build_grouped_capacity_a2a(sizes: Sizes = Sizes(E=4, k=2), *, capacity_factor: float = 1.0) -> ZooModel:
    group_tokens = sizes.T // sizes.B
    return ZooModel(
        name="grouped_capacity_a2a", fn=_grouped_capacity_fn(sizes.k, capacity_factor, all_to_all_layout=True),
        make_params=_params_maker(sizes, _mixtral_params), make_inputs=_bsd_inputs(sizes), expected_regions=1,
        style="capacity", top_k=sizes.k, num_experts=sizes.E,
        capacity=grouped_expert_capacity(group_tokens, sizes.E, sizes.k, capacity_factor), sizes=sizes,
        hyper=(("capacity_factor", capacity_factor),), builder=build_grouped_capacity_a2a,
        notes="grouped_capacity with the expert rows laid out as an all-to-all moves them: [G, E, C, d] "
              "transposed and reshaped to [E, G * C, d] for the expert products, and back before the combine.",
    )


def build_grouped_capacity(sizes: Sizes = Sizes(E=4, k=2), *, capacity_factor: float = 1.0) -> ZooModel:
    group_tokens = sizes.T // sizes.B
    return ZooModel(
        name="grouped_capacity", fn=_grouped_capacity_fn(sizes.k, capacity_factor),
        make_params=_params_maker(sizes, _mixtral_params), make_inputs=_bsd_inputs(sizes), expected_regions=1,
        style="capacity", top_k=sizes.k, num_experts=sizes.E,
        capacity=grouped_expert_capacity(group_tokens, sizes.E, sizes.k, capacity_factor), sizes=sizes,
        hyper=(("capacity_factor", capacity_factor),), builder=build_grouped_capacity,
        notes="MaxText's capacity path: per-batch-row capacity, positions over flattened (token, choice) order, "
              "one_hot(pos, C + 1)[..., 1:], einsum('BSM,BSEC->EBCM') / einsum('EBCM,BSEC->BSM') with the batch "
              "row a dot_general batch axis, SwiGLU experts.",
    )


# --------------------------------------------------------------------------------------------
# Hugging Face loop and gather-combine styles.


def _hf_loop_fn(k: int):
    def hf_loop(params, x):
        """Hugging Face style: a Python loop over experts, each masked by ``where(selected == e)``."""
        num_experts = params["router"].shape[-1]
        weights, selected = _softmax_topk_renormalise(x @ params["router"], k)
        weights = weights.astype(x.dtype)
        out = jnp.zeros_like(x)
        for e in range(num_experts):
            weight_e = jnp.where(selected == e, weights, 0).sum(axis=-1)  # [T]
            hidden = jax.nn.silu(x @ params["w_gate"][e]) * (x @ params["w_up"][e])
            out = out + weight_e[:, None] * (hidden @ params["w_down"][e])
        return out

    return hf_loop


def build_hf_loop(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="hf_loop", fn=_hf_loop_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="hf_loop", top_k=sizes.k, num_experts=sizes.E,
        capacity=None, sizes=sizes, builder=build_hf_loop,
        notes="Python loop over experts (E unrolled copies), where(selected == e) masks, x @ w[e] slices.",
    )


def _gather_combine_fn(k: int):
    def gather_combine(params, x):
        """All experts on all tokens, then ``take_along_axis`` of the k chosen outputs and a weighted sum."""
        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, params["w_gate"])) * jnp.einsum(
            "td,edf->tef", x, params["w_up"]
        )
        expert_out = jnp.einsum("tef,efd->ted", hidden, params["w_down"])  # [T, E, d]
        chosen = jnp.take_along_axis(expert_out, idx[..., None], axis=1)  # [T, k, d]
        return (chosen * weights.astype(x.dtype)[..., None]).sum(axis=1)

    return gather_combine


def build_gather_combine(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="gather_combine", fn=_gather_combine_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="gather", top_k=sizes.k, num_experts=sizes.E,
        capacity=None, sizes=sizes, builder=build_gather_combine,
        notes="dense experts -> [T, E, d], take_along_axis of the chosen k, weighted sum over k.",
    )


def _gathered_weights_fn(k: int):
    def gathered_weights(params, x):
        """EasyDeL's reference path: each token's k experts' weights gathered, ``[T, k, d, f]``, and
        per-(token, choice) products, biases gathered the same way, a weighted sum over k."""
        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        w_gate = jnp.take(params["w_gate"], idx, axis=0)  # [T, k, d, f]
        w_up = jnp.take(params["w_up"], idx, axis=0)
        w_down = jnp.take(params["w_down"], idx, axis=0)  # [T, k, f, d]
        hidden = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, w_gate)) * jnp.einsum("td,tkdf->tkf", x, w_up)
        out = jnp.einsum("tkf,tkfd->tkd", hidden, w_down) + jnp.take(params["b_down"], idx, axis=0)
        return jnp.sum(out * weights.astype(x.dtype)[..., None], axis=1)

    return gathered_weights


def _gathered_weights_params(sizes):
    return {**_mixtral_params(sizes), "b_down": _bias((sizes.E, sizes.d))}


def build_gathered_weights(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="gathered_weights", fn=_gathered_weights_fn(sizes.k),
        make_params=_params_maker(sizes, _gathered_weights_params), make_inputs=_token_inputs(sizes),
        expected_regions=1, style="gathered", top_k=sizes.k, num_experts=sizes.E, capacity=None, sizes=sizes,
        builder=build_gathered_weights,
        notes="per-token gathered expert weights jnp.take(W, idx, axis=0) -> [T, k, d, f] (T*k*d*f memory), "
              "einsum('td,tkdf->tkf'), a gathered bias, sum over k of out * w.",
    )


def _gate_on_tokens_fn(k: int):
    def gate_on_tokens(params, x):
        """The gate applied to the tokens before the experts: a gated copy of every token per expert,
        ``repeat(x[:, None], E, 1) * G[..., None]``, SwiGLU experts over ``[T, E, d]``, a sum over E
        (sigmoid scores, top-k; the weights reach the experts' input, not their output)."""
        num_experts = params["router"].shape[-1]
        weights, idx = lax.top_k(jax.nn.sigmoid(x @ params["router"]), k)
        gate = _onehot_combine(weights, idx, num_experts, x.dtype)  # [T, E]
        gated = jnp.repeat(x[:, None], num_experts, 1) * gate[..., None]  # [T, E, d]
        hidden = jax.nn.silu(jnp.einsum("ted,edf->tef", gated, params["w_gate"])) * jnp.einsum(
            "ted,edf->tef", gated, params["w_up"])
        return jnp.einsum("tef,efd->ted", hidden, params["w_down"]).sum(axis=1)

    return gate_on_tokens


def build_gate_on_tokens(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="gate_on_tokens", fn=_gate_on_tokens_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="gate_on_tokens", top_k=sizes.k,
        num_experts=sizes.E, capacity=None, sizes=sizes, builder=build_gate_on_tokens,
        notes="sigmoid -> top_k; repeat(x[:, None], E, 1) * G[..., None] gates the tokens before SwiGLU "
              "experts over [T, E, d]; a sum over E.",
    )


def _one_hot_dispatch_loop_fn(k: int):
    def one_hot_dispatch_loop(params, x):
        """A per-expert Python loop over one-hot dispatched tokens, its outputs stacked: the mask
        ``[B, S, E, k]`` masks each token per expert (``'BTID,BTEK->BTED'``), expert ``i`` runs on
        ``xin[:, :, i]`` with ``w[i]``, ``jnp.stack(..., axis=2)``, and ``'BTED,BTEK->BTD'`` against the
        mask times the weights combines."""
        num_experts = params["router"].shape[-1]
        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        mask = jnp.swapaxes(jax.nn.one_hot(idx, num_experts, dtype=x.dtype), -1, -2)  # [B, S, E, k]
        xin = jnp.einsum("BTID,BTEK->BTED", x[:, :, None], mask)
        outs = [(jax.nn.silu(xin[:, :, i] @ params["w_gate"][i]) * (xin[:, :, i] @ params["w_up"][i]))
                @ params["w_down"][i] for i in range(num_experts)]
        return jnp.einsum("BTED,BTEK->BTD", jnp.stack(outs, axis=2), mask * weights.astype(x.dtype)[:, :, None, :])

    return one_hot_dispatch_loop


def build_one_hot_dispatch_loop(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="one_hot_dispatch_loop", fn=_one_hot_dispatch_loop_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_bsd_inputs(sizes), expected_regions=1, style="one_hot_dispatch", top_k=sizes.k, num_experts=sizes.E,
        capacity=None, sizes=sizes, builder=build_one_hot_dispatch_loop,
        notes="[B, S, d] tokens masked per expert by a one-hot dispatch einsum, a Python loop over experts on "
              "xin[:, :, i] with w[i], outputs stacked on axis 2, an einsum combine against mask * weights.",
    )


def _separate_experts_fn(k: int):
    def separate_experts(params, x):
        """Experts as E separate modules, each with weight arrays of its own (a list of Flax-style
        submodules' params): every expert's output stacked ``[E, T, d]``, each (token, choice) picking its
        own with ``outs[idx, t, :]``, weighted and summed over k."""
        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        outs = jnp.stack([(jax.nn.silu(x @ expert["w_gate"]) * (x @ expert["w_up"])) @ expert["w_down"]
                          for expert in params["experts"]])  # [E, T, d]
        chosen = outs[idx, jnp.arange(x.shape[0])[:, None], :]  # [T, k, d]
        return jnp.sum(chosen * weights.astype(x.dtype)[..., None], axis=1)

    return separate_experts


def _separate_experts_params(sizes):
    d, f = sizes.d, sizes.f
    return {"router": _weight((d, sizes.E), d), "experts": [
        {"w_gate": _weight((d, f), d), "w_up": _weight((d, f), d), "w_down": _weight((f, d), f)} for _ in range(sizes.E)]}


def build_separate_experts(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="separate_experts", fn=_separate_experts_fn(sizes.k),
        make_params=_params_maker(sizes, _separate_experts_params), make_inputs=_token_inputs(sizes),
        expected_regions=1, style="separate_experts", top_k=sizes.k, num_experts=sizes.E, capacity=None, sizes=sizes,
        builder=build_separate_experts,
        notes="E expert modules with weights of their own, outputs stacked [E, T, d], outs[idx, t, :] picks each "
              "choice's; the rewrite stacks the weights on every call.",
    )


def _tiled_per_choice_fn(k: int):
    def tiled_per_choice(params, x):
        """Tokens tiled per choice: ``repeat(x, k, 0)`` gives one row per (token, choice) copy, every
        expert's product runs on every copy (``einsum('mk,bkn->bmn', a, W * scales)``, per-expert scaled
        weights), each copy's own expert is kept by ``einsum('bm,bmn->mn', one_hot(idx.reshape(-1), E,
        axis=0), ...)``; GeGLU after the selection; weighted by the gate and summed over k."""
        num_experts = params["router"].shape[-1]
        weights, idx = _softmax_topk_renormalise(x @ params["router"], k)
        tiled = jnp.repeat(x, k, axis=0)  # [T*k, d]: copy n is token n // k, choice n % k
        select = jax.nn.one_hot(idx.reshape(-1), num_experts, axis=0, dtype=x.dtype)  # [E, T*k]

        def product(a, weight):
            scaled = params[weight] * params[weight + "_scale"]
            return jnp.einsum("bm,bmn->mn", select, jnp.einsum("mk,bkn->bmn", a, scaled))

        hidden = jax.nn.gelu(product(tiled, "w_gate")) * product(tiled, "w_up")
        out = product(hidden, "w_down").reshape(-1, k, x.shape[-1])
        return jnp.sum(out * weights.astype(x.dtype)[..., None], axis=1)

    return tiled_per_choice


def _tiled_per_choice_params(sizes):
    scales = {"w_gate_scale": (sizes.E, 1, sizes.f), "w_up_scale": (sizes.E, 1, sizes.f), "w_down_scale": (sizes.E, 1, sizes.d)}
    return {**_mixtral_params(sizes), **{name: _Normal(shape, 1.0) for name, shape in scales.items()}}


def build_tiled_per_choice(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="tiled_per_choice", fn=_tiled_per_choice_fn(sizes.k),
        make_params=_params_maker(sizes, _tiled_per_choice_params), make_inputs=_token_inputs(sizes),
        expected_regions=1, style="tiled_per_choice", top_k=sizes.k, num_experts=sizes.E, capacity=None, sizes=sizes,
        builder=build_tiled_per_choice,
        notes="tokens repeated to [T*k, d], every expert on every copy with per-expert scaled weights W * scales, "
              "each copy's own expert kept by a one-hot of idx.reshape(-1) contracted over E, GeGLU after the "
              "selection, weights times the copies reshaped [T, k, d] summed over k.",
    )


def _sorted_range_mask_fn(k: int):
    def sorted_range_mask(params, x):
        """A sort-based dense dispatch on ``[B, L, d]`` tokens: ``approx_max_k`` routing, each row's
        (token, choice) copies argsorted by expert and gathered (``order // k``), every expert run on every
        sorted copy, each copy's own expert kept by the range mask ``start_e <= i < end_e`` (bounds from a
        cumsum of the per-expert counts), summed over E, un-sorted by ``argsort(order)``, combined with
        ``'blkd,blk->bld'``."""
        batch, length, _ = x.shape
        num_experts = params["router"].shape[-1]
        probs = jax.nn.softmax((x @ params["router"]).astype(jnp.float32), axis=-1)
        weights, idx = lax.approx_max_k(probs, k)  # [B, L, k]
        weights = weights / weights.sum(axis=-1, keepdims=True)
        flat = idx.reshape(batch, length * k)
        order = jnp.argsort(flat, axis=-1)  # [B, L*k]: copies by expert
        copies = jnp.take_along_axis(x, (order // k)[..., None], axis=1)  # [B, L*k, d]
        counts = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=1)  # [B, E]
        end = jnp.cumsum(counts, axis=-1)
        start = end - counts
        position = jnp.arange(length * k)
        in_range = (start[:, :, None] <= position) & (position < end[:, :, None])  # [B, E, L*k]
        hidden = jax.nn.silu(jnp.einsum("bnd,edf->benf", copies, params["w_gate"])) * jnp.einsum(
            "bnd,edf->benf", copies, params["w_up"])
        out = jnp.einsum("benf,efd->bend", hidden, params["w_down"])
        out = jnp.sum(out * in_range[..., None].astype(x.dtype), axis=1)  # [B, L*k, d], sorted
        out = jnp.take_along_axis(out, jnp.argsort(order, axis=-1)[..., None], axis=1)
        return jnp.einsum("blkd,blk->bld", out.reshape(batch, length, k, -1), weights.astype(x.dtype))

    return sorted_range_mask


def build_sorted_range_mask(sizes: Sizes = Sizes()) -> ZooModel:
    return ZooModel(
        name="sorted_range_mask", fn=_sorted_range_mask_fn(sizes.k), make_params=_params_maker(sizes, _mixtral_params),
        make_inputs=_bsd_inputs(sizes), expected_regions=1, style="sorted_range_mask", top_k=sizes.k,
        num_experts=sizes.E, capacity=None, sizes=sizes, builder=build_sorted_range_mask,
        notes="softmax -> approx_max_k -> renormalise; [B, L*k] copies argsorted by expert, gathered at "
              "order // k, SwiGLU experts on every sorted copy, start_e <= i < end_e range mask from a cumsum of "
              "counts, sum over E, un-sorted by argsort(order), 'blkd,blk->bld' combine.",
    )


# --------------------------------------------------------------------------------------------
# Several layers: two layers in one function, and a scan over stacked layers.


def _two_layers_fn(k: int):
    layer = _mixtral_fn(k)

    def two_layers(params, x):
        """Two Mixtral MoE layers with a residual around each: two separate regions."""
        h = x + layer(params["layer_0"], x)
        return h + layer(params["layer_1"], h)

    return two_layers


def build_two_layers(sizes: Sizes = Sizes()) -> ZooModel:
    def spec(s):
        return {"layer_0": _mixtral_params(s), "layer_1": _mixtral_params(s)}

    return ZooModel(
        name="two_layers", fn=_two_layers_fn(sizes.k), make_params=_params_maker(sizes, spec),
        make_inputs=_token_inputs(sizes), expected_regions=2, style="mixtral", top_k=sizes.k,
        num_experts=sizes.E, capacity=None, sizes=sizes, builder=build_two_layers,
        notes="x + moe(x), then h + moe(h): two Mixtral layers with their own weights, two regions.",
    )


def _scan_layers_fn(k: int):
    layer = _mixtral_fn(k)

    def scan_layers(params, x):
        """``lax.scan`` over layer-stacked weights, one Mixtral MoE layer (with residual) per step."""

        def step(h, layer_params):
            return h + layer(layer_params, h), None

        out, _ = lax.scan(step, x, params)
        return out

    return scan_layers


def build_scan_layers(sizes: Sizes = Sizes(), *, num_layers: int = 2) -> ZooModel:
    def spec(s):
        return {name: _Normal((num_layers, *w.shape), w.std) for name, w in _mixtral_params(s).items()}

    return ZooModel(
        name="scan_layers", fn=_scan_layers_fn(sizes.k), make_params=_params_maker(sizes, spec),
        make_inputs=_token_inputs(sizes), expected_regions=1, style="mixtral", top_k=sizes.k,
        num_experts=sizes.E, capacity=None, sizes=sizes, hyper=(("num_layers", num_layers),),
        builder=build_scan_layers,
        notes="lax.scan over params stacked on a leading layer axis; the one region is the scan body.",
    )


# --------------------------------------------------------------------------------------------
# Flax linen module.

if nn is not None:

    class FlaxMoE(nn.Module):
        """The Mixtral layer as a Flax module: router and expert weights are module params."""

        num_experts: int
        top_k: int
        d_ff: int
        param_dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x):
            d_model = x.shape[-1]
            expert_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2, out_axis=-1,
                                                           batch_axis=(0,))
            router = self.param("router", nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
                                (d_model, self.num_experts), self.param_dtype)
            w_gate = self.param("w_gate", expert_init, (self.num_experts, d_model, self.d_ff), self.param_dtype)
            w_up = self.param("w_up", expert_init, (self.num_experts, d_model, self.d_ff), self.param_dtype)
            w_down = self.param("w_down", expert_init, (self.num_experts, self.d_ff, d_model), self.param_dtype)
            weights, idx = _softmax_topk_renormalise(x @ router, self.top_k)
            combine = _onehot_combine(weights, idx, self.num_experts, x.dtype)
            gate = jnp.einsum("td,edf->tef", x, w_gate)
            up = jnp.einsum("td,edf->tef", x, w_up)
            expert_out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, w_down)
            return jnp.einsum("te,ted->td", combine, expert_out)

    def init_flax_moe(key, dtype=jnp.float32, *, d: int = 16, f: int = 32, E: int = 8, k: int = 2):
        """``(module, params)`` for a ``FlaxMoE`` with ``params`` in ``dtype``."""
        module = FlaxMoE(num_experts=E, top_k=k, d_ff=f, param_dtype=dtype)
        params = jax.jit(module.init)(key, jnp.zeros((1, d), dtype))["params"]
        return module, params

    def build_flax_moe(sizes: Sizes = Sizes()) -> ZooModel:
        module = FlaxMoE(num_experts=sizes.E, top_k=sizes.k, d_ff=sizes.f)

        def flax_moe(params, x):
            """``FlaxMoE.apply`` on the params tree ``init_flax_moe`` makes."""
            return module.apply({"params": params}, x)

        def make_params(key, dtype=jnp.float32, **overrides):
            """The tree ``init_flax_moe`` makes, with the same N(0, 1/fan_in) law, from one cheap draw.

            ``module.init`` compiles one random program per parameter, seconds on CPU per model;
            the zoo's tests check that both trees have the same structure, shapes and dtypes.
            """
            s = dataclasses.replace(sizes, **overrides)
            if (s.E, s.f, s.k) != (sizes.E, sizes.f, sizes.k):
                raise ValueError("flax_moe's module fixes E, f and k: use ZOO['flax_moe'].sized(...) to change them")
            return _draw(key, _mixtral_params(s), dtype)

        return ZooModel(
            name="flax_moe", fn=flax_moe, make_params=make_params, make_inputs=_token_inputs(sizes),
            expected_regions=1, style="mixtral", top_k=sizes.k, num_experts=sizes.E, capacity=None, sizes=sizes,
            builder=build_flax_moe, notes="FlaxMoE(nn.Module).apply: the mixtral computation on module params.",
        )


# --------------------------------------------------------------------------------------------
# Negatives: must not be rewritten.


def _topk_attention_fn(k: int):
    def topk_attention(params, x):
        """Top-k sparse attention: each query keeps its k best keys, softmax over them, weighted values.

        It gathers and weights rows chosen by ``top_k`` like a gather-combine MoE, but what it gathers
        are value vectors, not the outputs of per-expert weights.
        """
        q, key, v = x @ params["w_q"], x @ params["w_k"], x @ params["w_v"]
        scores = q @ key.T / math.sqrt(q.shape[-1])  # [T, T]
        top_scores, top_keys = lax.top_k(scores, k)
        probs = jax.nn.softmax(top_scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        values = jnp.take(v, top_keys, axis=0)  # [T, k, d]
        return jnp.einsum("tk,tkd->td", probs, values) @ params["w_o"]

    return topk_attention


def build_topk_attention(sizes: Sizes = Sizes(k=4)) -> ZooModel:
    def spec(s):
        return {name: _weight((s.d, s.d), s.d) for name in ("w_q", "w_k", "w_v", "w_o")}

    return ZooModel(
        name="topk_attention", fn=_topk_attention_fn(sizes.k), make_params=_params_maker(sizes, spec),
        make_inputs=_token_inputs(sizes), expected_regions=0, style="negative", top_k=sizes.k, num_experts=None,
        capacity=None, sizes=sizes, builder=build_topk_attention,
        notes="attention scores sparsified by lax.top_k; routes keys, not tokens to expert weights.",
    )


def _ensemble_average(params, x):
    """E "experts" on every token, simply averaged: an E axis and [T, E, f] tensors but no routing."""
    hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, params["w_up"]))
    return jnp.einsum("tef,efd->ted", hidden, params["w_down"]).mean(axis=1)


def build_ensemble_average(sizes: Sizes = Sizes()) -> ZooModel:
    def spec(s):
        return _mlp_experts(s, biases=False)

    return ZooModel(
        name="ensemble_average", fn=_ensemble_average, make_params=_params_maker(sizes, spec),
        make_inputs=_token_inputs(sizes), expected_regions=0, style="negative", top_k=None, num_experts=sizes.E,
        capacity=None, sizes=sizes, builder=build_ensemble_average,
        notes="mean over E expert MLPs applied to all tokens: nothing is routed.",
    )


def _batched_matmul_unrouted_fn(k: int):
    def batched_matmul_unrouted(params, x):
        """Per-head projections with an E-like head axis; a top_k elsewhere only scales each token.

        The ``top_k`` values (its indices are never used) give a per-token confidence that multiplies
        the concatenated heads: nothing selects among the heads.
        """
        num_tokens = x.shape[0]
        heads = jax.nn.gelu(jnp.einsum("td,edf->tef", x, params["w_heads"]))  # [T, E, f]
        top_scores, _ = lax.top_k(x @ params["w_score"], k)
        confidence = jax.nn.sigmoid(top_scores.mean(axis=-1))  # [T]
        out = heads.reshape(num_tokens, -1) @ params["w_out"]
        return out * confidence[:, None]

    return batched_matmul_unrouted


def build_batched_matmul_unrouted(sizes: Sizes = Sizes()) -> ZooModel:
    def spec(s):
        return {
            "w_heads": _weight((s.E, s.d, s.f), s.d),
            "w_score": _weight((s.d, s.E), s.d),
            "w_out": _weight((s.E * s.f, s.d), s.E * s.f),
        }

    return ZooModel(
        name="batched_matmul_unrouted", fn=_batched_matmul_unrouted_fn(sizes.k), make_params=_params_maker(sizes, spec),
        make_inputs=_token_inputs(sizes), expected_regions=0, style="negative", top_k=sizes.k, num_experts=sizes.E,
        capacity=None, sizes=sizes, builder=build_batched_matmul_unrouted,
        notes="einsum 'td,edf->tef' over heads, all heads used; top_k values scale tokens, indices unused.",
    )


# --------------------------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[], ZooModel]] = {
    "mixtral": build_mixtral,
    "mixtral_logits_topk": build_mixtral_logits_topk,
    "mixtral_bsd": build_mixtral_bsd,
    "mixtral_annotated": build_mixtral_annotated,
    "mixtral_square": build_mixtral_square,
    "mlp_gelu": _build_mlp("mlp_gelu"),
    "mlp_relu_bias": _build_mlp("mlp_relu_bias"),
    "mlp_squared_relu": _build_mlp("mlp_squared_relu"),
    "gpt_oss": build_gpt_oss,
    "deepseek_v3": build_deepseek_v3,
    "switch": build_switch,
    "grouped_capacity": build_grouped_capacity,
    "grouped_capacity_a2a": build_grouped_capacity_a2a,
    "batch_prioritized": build_batch_prioritized,
    "gshard_top2": build_gshard_top2,
    "gshard_top2_outer": build_gshard_top2_outer,
    "hf_loop": build_hf_loop,
    "gather_combine": build_gather_combine,
    "gathered_weights": build_gathered_weights,
    "gate_on_tokens": build_gate_on_tokens,
    "one_hot_dispatch_loop": build_one_hot_dispatch_loop,
    "separate_experts": build_separate_experts,
    "tiled_per_choice": build_tiled_per_choice,
    "sorted_range_mask": build_sorted_range_mask,
    "two_layers": build_two_layers,
    "scan_layers": build_scan_layers,
    **({"flax_moe": build_flax_moe} if nn is not None else {}),
    "topk_attention": build_topk_attention,
    "ensemble_average": build_ensemble_average,
    "batched_matmul_unrouted": build_batched_matmul_unrouted,
}

ZOO: Mapping[str, ZooModel] = {name: build() for name, build in _BUILDERS.items()}
POSITIVE: tuple[str, ...] = tuple(name for name, model in ZOO.items() if model.expected_regions > 0)
NEGATIVE: tuple[str, ...] = tuple(name for name, model in ZOO.items() if model.expected_regions == 0)
