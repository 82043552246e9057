"""Real frameworks' dense MoE layers, built as shipped, as ``f(params, x)`` functions.

MaxText 0.2.5 (``RoutedMoE`` / ``RoutedAndSharedMoE`` on the dense path) and EasyDeL 0.3.0
(``moe_method="dense_moe"`` blocks) at small sizes, float32. Each builder returns a ``Layer``:
``fn(params, x)`` is the layer's apply (its first output), ``params`` every parameter as a plain
pytree (dicts of arrays: what ``jax.grad`` differentiates), ``x`` an input ``[batch, seq, d_model]``.
Nothing of the frameworks is imported before a builder runs, so the test modules collect (and skip)
without them. Shared by ``tests/realworld/test_*.py`` and ``benchmarks/realworld_cpu.py``.

Both frameworks build on one device: a one-device mesh from the frameworks' own mesh builders, so
the program is the single-device layer whatever ``jax_num_cpu_devices`` the test suite sets.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

MAXTEXT_VERSION = "0.2.5"
EASYDEL_VERSION = "0.3.0"


@dataclass
class Layer:
    """One framework layer, ready to call: ``fn(params, x)``."""

    name: str
    fn: Callable[[Any, jax.Array], jax.Array]
    params: Any
    x: jax.Array
    # A second, independent implementation of the same layer (MaxText's own sparse path), same
    # signature and parameters; None where the framework has none that runs here.
    reference: Callable[[Any, jax.Array], jax.Array] | None = None
    reference_name: str = ""
    info: dict = field(default_factory=dict)


def _randomise_biases(params, key, scale=0.1):
    """Biases initialise to zero in both frameworks; random ones make them matter (routing included)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path).lower()
        if "bias" in name and jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(tree, out)


def _input(key, batch, seq, d_model):
    return jax.random.normal(key, (batch, seq, d_model), jnp.float32)


# --------------------------------------------------------------------------------------------
# MaxText 0.2.5

# model_name and the overrides that make each case; sizes (d_model, d_ff, batch, seq) come on top.
MAXTEXT_CASES: dict[str, dict] = {
    # Mixtral-8x7B: E=8, k=2, softmax over the top-k logits, SwiGLU experts; dropless.
    "mixtral-8x7b": dict(model_name="mixtral-8x7b"),
    # The same with token dropping: MaxText's GShard-style [B, S, E, C] dispatch/combine masks.
    "mixtral-8x7b-capacity1.25": dict(model_name="mixtral-8x7b", capacity_factor=1.25),
    # DeepSeek-V3 routing (sigmoid scores, selection bias, 4 groups / top-2 groups, scaling 2.5)
    # with one shared expert: RoutedAndSharedMoE.
    "deepseek3-test": dict(model_name="deepseek3-test", num_experts=16, num_experts_per_tok=4, n_routing_groups=4,
                           topk_routing_group=2),
    # GPT-OSS-20B: E=32, k=4, router bias, expert biases, clipped GLU (limit 7, alpha 1.702).
    "gpt-oss-20b": dict(model_name="gpt-oss-20b"),
}


def maxtext_config(case: str, *, batch: int, seq: int, d_model: int, d_ff: int, sparse: bool = False, **overrides):
    """MaxText's pydantic config for ``case``: base.yml + the model's yml + overrides (``overrides``
    last: a train step's layer count, optimizer), CPU, float32."""
    import maxtext
    from maxtext.configs import pyconfig

    base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    settings = dict(
        hardware="cpu",
        skip_jax_distributed_system=True,
        run_name="moe_lowering_realworld",
        base_output_directory=os.path.join(tempfile.gettempdir(), "moe_lowering_realworld_maxtext"),
        enable_checkpointing=False,
        override_model_config=True,  # shrink the model yml's sizes
        dtype="float32",
        weight_dtype="float32",
        matmul_precision="highest",
        sparse_matmul=sparse,
        megablox=False,
        per_device_batch_size=batch,
        max_target_length=seq,
        base_emb_dim=d_model,
        base_mlp_dim=d_ff,
        base_moe_mlp_dim=d_ff,
        base_num_query_heads=4,
        base_num_kv_heads=4,
        head_dim=8,
        base_num_decoder_layers=1,
        vocab_size=128,
        **MAXTEXT_CASES[case],
    )
    return pyconfig.initialize([None, base_yml], **(settings | overrides))


def _maxtext_apply(cfg):
    """``(fn, params)`` for the MaxText MoE block that ``cfg`` describes (one-device mesh)."""
    from flax import nnx
    from jax.sharding import Mesh
    from maxtext.layers import moe
    from maxtext.layers.initializers import nd_dense_init
    from maxtext.utils import maxtext_utils

    mesh = Mesh(maxtext_utils.create_device_mesh(cfg, devices=jax.devices()[:1]), cfg.mesh_axes)
    kernel_init = nd_dense_init(1.0, "fan_in", "truncated_normal")
    rngs = nnx.Rngs(params=0)
    if cfg.shared_experts > 0:
        layer = moe.RoutedAndSharedMoE(config=cfg, mesh=mesh, kernel_init=kernel_init, kernel_axes=("embed", None),
                                       weight_dtype=cfg.weight_dtype, dtype=cfg.dtype, rngs=rngs)
    else:
        layer = moe.RoutedMoE(config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                              mesh=mesh, kernel_init=kernel_init, kernel_axes=("embed", None),
                              intermediate_dim=cfg.moe_mlp_dim, weight_dtype=cfg.weight_dtype, dtype=cfg.dtype,
                              rngs=rngs)
    # Parameters, and DeepSeek's routing bias (an MoEBiasVar: MaxText updates it outside the loss).
    graphdef, params, rest = nnx.split(layer, nnx.Any(nnx.Param, moe.MoEBiasVar), ...)

    def fn(params, x):
        out, _load_balance_loss, _bias_updates = nnx.merge(graphdef, params, rest, copy=True)(x)
        return out

    return fn, nnx.to_pure_dict(params)


def maxtext_layer(case: str, *, batch: int = 2, seq: int = 16, d_model: int = 32, d_ff: int = 64,
                  seed: int = 0) -> Layer:
    cfg = maxtext_config(case, batch=batch, seq=seq, d_model=d_model, d_ff=d_ff)
    fn, params = _maxtext_apply(cfg)
    k_bias, k_x = jax.random.split(jax.random.key(seed))
    params = _randomise_biases(params, k_bias)
    reference, reference_name = None, ""
    if cfg.capacity_factor <= 0:
        # MaxText's sparse path (sort + jax.lax.ragged_dot when megablox=False) runs on CPU; with
        # token dropping it drops differently from the dense path, so only the dropless cases have it.
        sparse_fn, sparse_params = _maxtext_apply(maxtext_config(case, batch=batch, seq=seq, d_model=d_model,
                                                                 d_ff=d_ff, sparse=True))
        assert jax.tree.structure(sparse_params) == jax.tree.structure(params)
        reference, reference_name = sparse_fn, "MaxText sparse_matmul=True, megablox=False"
    info = dict(framework="maxtext", version=MAXTEXT_VERSION, model_name=cfg.model_name,
                experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, d_model=cfg.emb_dim, d_ff=cfg.moe_mlp_dim,
                capacity_factor=cfg.capacity_factor, shared_experts=cfg.shared_experts)
    return Layer(f"maxtext/{case}", fn, params, _input(k_x, batch, seq, d_model), reference, reference_name, info)


@dataclass
class TrainStep:
    """A framework's own training step, as its training loop builds and calls it.

    ``step(state, batch) -> (state, metrics)`` is the unjitted step; ``jit(fn)`` jits ``step`` or a
    decorated ``step`` the way the loop does (its shardings, the state donated); the loop calls it
    inside ``context()``. ``batch(seed)`` is a synthetic batch; ``loss(metrics)`` the step's loss.
    """

    name: str
    step: Callable
    jit: Callable[[Callable], Callable]
    context: Callable
    state: Any
    batch: Callable[[int], Any]
    loss: Callable[[Any], jax.Array]
    info: dict = field(default_factory=dict)


def maxtext_train_step(case: str = "mixtral-8x7b", *, layers: int = 2, batch: int = 2, seq: int = 16,
                       d_model: int = 32, d_ff: int = 64, learning_rate: float = 1e-2, steps: int = 20,
                       scan_layers: bool = False) -> TrainStep:
    """``maxtext.trainers.pre_train.train.train_step`` with the state MaxText's own setup builds
    (``train_utils.setup_train_loop`` less its checkpointing and data pipeline: the NNX model,
    ``create_training_optimizer``'s AdamW, ``setup_training_state``), jitted as ``train_loop`` jits it
    (``get_functional_train_with_signature``), fed ``make_synthetic_batch``. Unscanned layers by default
    (``scan_layers=False``): one MoE region per layer; scanned, one region in the scan over layers.
    ``head_dim`` 16 keeps the attention's head axis apart from the expert axis (8)."""
    import contextlib

    from flax import nnx
    from flax.linen import logical_axis_rules
    from maxtext.common import train_state_nnx
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils, model_creation_utils, sharding, train_utils

    cfg = maxtext_config(case, batch=batch, seq=seq, d_model=d_model, d_ff=d_ff, base_num_decoder_layers=layers,
                         scan_layers=scan_layers, head_dim=16, attention="dot_product", dataset_type="synthetic",
                         steps=steps, learning_rate=learning_rate)
    mesh = maxtext_utils.get_mesh_from_config(cfg, jax.devices()[:1])
    create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
    _, tx = train_utils.create_training_optimizer(cfg, abstract_model, mesh=mesh)

    def init_state_fn():
        model = create_model()
        return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

    state, _, state_shardings, _, _ = maxtext_utils.setup_training_state(None, cfg, mesh, None, init_state_fn)
    with logical_axis_rules(cfg.logical_axis_rules):
        state_graphdef = nnx.graphdef(nnx.eval_shape(init_state_fn))
    graphdef, state = nnx.split(nnx.merge(state_graphdef, state))
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(cfg, state_shardings)
    data_sharding = sharding.get_input_data_sharding(cfg, mesh)
    step, in_shardings, out_shardings, static_argnums, donate_argnums = (
        maxtext_utils.get_functional_train_with_signature(train.train_step, data_sharding, state_shardings, graphdef,
                                                          cfg, params_shardings))
    shaped_batch = maxtext_utils.get_shaped_batch(cfg, batch_sharding=data_sharding)

    def jit(fn):
        return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, static_argnums=static_argnums,
                       donate_argnums=donate_argnums)

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(logical_axis_rules(cfg.logical_axis_rules))
        return stack

    info = dict(framework="maxtext", version=MAXTEXT_VERSION, model_name=cfg.model_name, layers=layers,
                experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, d_model=cfg.emb_dim, d_ff=cfg.moe_mlp_dim,
                optimizer=cfg.opt_type, learning_rate=learning_rate)
    return TrainStep(f"maxtext/{case}/train_step{'/scan_layers' if scan_layers else ''}", step, jit, context, state,
                     lambda seed: train.make_synthetic_batch(cfg, shaped_batch, seed=seed),
                     lambda metrics: metrics["scalar"]["learning/loss"], info)


# --------------------------------------------------------------------------------------------
# EasyDeL 0.3.0


def import_easydel():
    """``import easydel`` the way these tests need it: no XLA flag changes, no torch."""
    # EASYDEL_AUTO=1 (its default) appends GPU/TPU-only flags to XLA_FLAGS at import; XLA:CPU
    # rejects them when the backend starts.
    os.environ["EASYDEL_AUTO"] = "0"
    from rw_hf_stubs import install

    install()
    import easydel

    return easydel


EASYDEL_CASES = ("mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3")


def _easydel_block(case: str, d_model: int, d_ff: int):
    ed = import_easydel()
    common = dict(hidden_size=d_model, moe_method="dense_moe", num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=128)
    if case == "mixtral":
        from easydel.modules.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = ed.MixtralConfig(intermediate_size=d_ff, num_local_experts=8, num_experts_per_tok=2, **common)
        return cfg, lambda **kw: MixtralSparseMoeBlock(cfg, **kw)
    if case == "qwen2_moe":
        from easydel.modules.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseBlock

        cfg = ed.Qwen2MoeConfig(intermediate_size=d_ff, moe_intermediate_size=d_ff, shared_expert_intermediate_size=d_ff,
                                num_experts=16, num_experts_per_tok=4, **common)
        return cfg, lambda **kw: Qwen2MoeSparseBlock(cfg, **kw)
    if case == "deepseek_v2":
        from easydel.modules.deepseek_v2.modeling_deepseek import DeepseekV2MoE

        cfg = ed.DeepseekV2Config(intermediate_size=d_ff, moe_intermediate_size=d_ff, n_routed_experts=16,
                                  num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                  n_shared_experts=1, routed_scaling_factor=16.0, **common)
        return cfg, lambda **kw: DeepseekV2MoE(cfg, **kw)
    if case == "deepseek_v3":
        from easydel.modules.deepseek_v3.modeling_deepseek import DeepseekV3MoE

        cfg = ed.DeepseekV3Config(intermediate_size=d_ff, moe_intermediate_size=d_ff, n_routed_experts=16,
                                  num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="noaux_tc",
                                  scoring_func="sigmoid", norm_topk_prob=True, n_shared_experts=1,
                                  routed_scaling_factor=2.5, **common)
        return cfg, lambda **kw: DeepseekV3MoE(cfg, layer_idx=0, **kw)
    raise KeyError(f"unknown EasyDeL case {case!r}; expected one of {EASYDEL_CASES}")


def easydel_layer(case: str, *, batch: int = 2, seq: int = 16, d_model: int = 32, d_ff: int = 64,
                  seed: int = 0) -> Layer:
    from flax import nnx
    from jax.sharding import Mesh

    cfg, make = _easydel_block(case, d_model, d_ff)
    names = tuple(cfg.sharding_axis_names)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)
    cfg.set_model_mesh(mesh)  # the expert mesh (moe_call's `with self.auto_expert_mesh`) follows it
    layer = make(dtype=jnp.float32, param_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
                 rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def fn(params, x):
        # EasyDeL's sharding helpers read the mesh of `with mesh:` (its own idiom); JAX marks that
        # context manager deprecated in favour of jax.set_mesh, which cannot be entered under a trace.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with mesh:
                out, _router_logits = nnx.merge(graphdef, params, rest, copy=True)(x)
        return out

    k_bias, k_x = jax.random.split(jax.random.key(seed + 1))
    params = _randomise_biases(nnx.to_pure_dict(params), k_bias)
    info = dict(framework="easydel", version=EASYDEL_VERSION, moe_method=cfg.moe_method, d_model=d_model, d_ff=d_ff)
    return Layer(f"easydel/{case}", fn, params, _input(k_x, batch, seq, d_model), info=info)
