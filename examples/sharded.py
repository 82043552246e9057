"""The sharded layer (docs/sharded.md): a dense MoE on a 2x4 ``fsdp x expert`` mesh, rewritten into
the expert-parallel layer, with FP8 weight gathers, checked against the unsharded dense layer.

Run: ``python examples/sharded.py`` (CPU: eight host devices stand in for the mesh; on eight GPUs
drop the flag). The flag must be set before JAX starts.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from moe_lowering import explain, moe_optimize  # noqa: E402

T, d, f, E, k = 512, 64, 128, 8, 2  # tokens, model width, expert width, experts, experts per token


def moe_layer(p, x):
    """A dense Mixtral-style layer: every expert on every token, combined by a [T, E] top-k gate."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(x @ p["router"]), k)
    combine = (jax.nn.one_hot(experts, E) * weights[..., None]).sum(1)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, p["w_gate"])) * jnp.einsum("td,edf->tef", x, p["w_up"])
    return jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", h, p["w_down"]))


def main():
    shapes = {"router": (d, E), "w_gate": (E, d, f), "w_up": (E, d, f), "w_down": (E, f, d)}
    keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
    params = {name: jax.random.normal(key, shape) / shape[-2] ** 0.5
              for key, (name, shape) in zip(keys, shapes.items())}
    x = jax.random.normal(keys[-1], (T, d))

    # Expert weights [E, d, f]: experts over 'expert' (EP), the model width over 'fsdp' (FSDP).
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)
    weight_sharding = NamedSharding(mesh, P("expert", "fsdp", None))
    param_shardings = {name: weight_sharding if name != "router" else NamedSharding(mesh, P()) for name in params}
    token_sharding = NamedSharding(mesh, P(("fsdp", "expert")))  # tokens over all eight devices

    # Decorate the jitted function: the pass reads the layout from its in_shardings.
    sharded = jax.jit(moe_layer, in_shardings=(param_shardings, token_sharding))
    print(explain(sharded, params, x))
    layer = moe_optimize(sharded)
    fp8_layer = moe_optimize(sharded, weight_gather_quant="fp8_e4m3")  # or "mxfp8", or None (exact)

    dense = moe_layer(params, x)
    exact = layer(params, x)
    fp8 = fp8_layer(params, x)
    error = float(jnp.linalg.norm(exact - dense) / jnp.linalg.norm(dense))
    fp8_error = float(jnp.linalg.norm(fp8 - dense) / jnp.linalg.norm(dense))
    print(f"expert-parallel layer: relative error {error:.1e}; with FP8 weight gathers {fp8_error:.1e}")
    assert error < 1e-5 and fp8_error < 0.1

    # Gradients flow through the exchange: the weight gradients come back sharded like the weights.
    grads = jax.grad(lambda p: jnp.mean(layer(p, x) ** 2))(params)
    dense_grads = jax.grad(lambda p: jnp.mean(moe_layer(p, x) ** 2))(params)
    for name in params:
        scale = float(jnp.max(jnp.abs(dense_grads[name])))
        assert float(jnp.max(jnp.abs(grads[name] - dense_grads[name]))) <= 1e-4 * scale, name
    print("gradients match the dense layer's")


if __name__ == "__main__":
    main()
