"""The few JAX APIs the sharded lowering needs, behind one name each (jax 0.10.2 and 0.11.2).

Kept inside ``parallel/`` so version differences of ``shard_map`` stay in one small place.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def shard_map(body, *, mesh, in_specs, out_specs):
    """``jax.shard_map`` without the varying-axes type check.

    The check is off because loop carries built from ``jnp.zeros`` (the XLA grouped GEMM's tile
    loop, this package's exchange rounds) are typed invariant and would need ``pcast`` at every
    site. Gradients stay right without it: every output here is sharded over all mesh axes, and
    ``shard_map``'s transpose then sums the cotangent of each input over the axes its spec
    leaves out (a weight replicated along a token axis gets every device's contribution).
    """
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def reshard(x, mesh, spec: PartitionSpec):
    """Constrains ``x`` to ``spec`` on ``mesh`` (a ``reshard`` on Explicit axes, a constraint on Auto)."""
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
