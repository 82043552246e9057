"""The Triton backend end to end on the CPU: rewritten zoo layers, forward and gradients, with every
Triton kernel launched through its launcher and run by Triton's interpreter.

``jax_triton`` is stood in for by the interpreter (``interpreter_harness.install_interpreted_jax_triton``)
and the backend built as a GPU builds it (``kernels.triton_kernels()``), so the primitives, their
transposes and the launchers run exactly the kernels a training step on a GPU runs: the gathered up
projection and its pre-activations, ``gather_lhs_tgmm``, ``gmm`` with its tail kernel, ``gmm_pair``,
``gmm_sum``, the combine's gathered backward products, ``tgmm`` on both schedules. Each layer is
compared with the same layer on the XLA backend (float32: the kernels' float32 tiles, products in
IEEE float32): output, loss and the gradient of every input (for two cases also a JVP and ``vmap`` of
the gradient). The cases pick the paths by width and
group size: experts up to 256 wide (the last product and the combine as one piece), 320 (apart) and
600 (no fused SwiGLU kernel: ``gmm_pair``), groups under and over the resident weight gradient's
limit, an MLP expert and DeepSeek's shared expert.
"""

from __future__ import annotations

import interpreter_harness as harness

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

CASES = {
    "mixtral-small-groups": ("mixtral", {}),
    "mixtral-large-groups": ("mixtral", dict(T=384, E=3, k=2)),
    "mixtral-f320": ("mixtral", dict(f=320)),
    "mixtral-f600": ("mixtral", dict(T=48, f=600, E=4)),
    "mlp-gelu": ("mlp_gelu", {}),
    "deepseek-v3": ("deepseek_v3", {}),
}

MORE_MODES = ("mixtral-small-groups", "mlp-gelu")


def _compare(case):
    import jax
    import jax.numpy as jnp
    import numpy as np

    harness.install_interpreted_jax_triton()
    from moe_lowering import moe_optimize
    from moe_lowering import sparse_moe
    from moe_lowering.kernels import get_backend, triton_kernels
    from moe_lowering.testing import ZOO

    name, sizes = CASES[case]
    model = ZOO[name].sized(**sizes)
    params, x = model.args(jax.random.key(11))
    results = {}
    for backend in (get_backend("xla"), triton_kernels()):
        sparse_moe.get_backend = lambda _, b=backend: b
        layer = moe_optimize(model.fn, strict=True)  # one per backend: its trace is cached

        def loss(p, x):
            return jnp.sum(jnp.sin(layer(p, x)))

        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        leaves = [layer(params, x), value, grads]
        if case in MORE_MODES:  # forward mode (the fused pieces' compositions) and vmap (sequential launches)
            leaves.append(jax.jvp(loss, (params, x), (params, x))[1])
            leaves.append(jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0))(params, jnp.stack([x, -x])))
        results[backend.name] = [np.asarray(v, np.float64) for v in jax.tree_util.tree_leaves(leaves)]
    errors = [float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
              for got, want in zip(results["triton"], results["xla"])]
    return {"leaves": len(errors), "max_relative_error": max(errors),
            "finite": all(bool(np.isfinite(v).all()) for v in results["triton"])}


def _jobs():
    return {case: (lambda case=case: _compare(case)) for case in CASES}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    # a child per layer (each takes 5-30 s): split between pytest-xdist's workers, none is run twice
    interpreter_report = harness.report_fixture(__file__, list(CASES), jobs_per_child=1, JAX_PLATFORMS="cpu")

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_triton_backend_layer_matches_the_xla_backend(interpreter_report, case):
        result = interpreter_report[case]
        assert result["finite"], result
        assert result["max_relative_error"] < 1e-5, result
