"""The ``moe-rewrite`` tool's machinery: read StableHLO/HLO modules, import them as JAX
callables, rewrite their MoE layers with the shared matcher, and verify the result.

:mod:`importer` interprets a module with ``jax.lax`` ops; :mod:`rewrite` traces that, calls
``moe_lowering.api.optimize_jaxpr`` and re-lowers; :mod:`reader` parses inputs with one-line
errors; :mod:`verify` compiles and compares; :mod:`_compat` holds the jaxlib version shims.
"""
