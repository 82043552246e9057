"""Suite-wide setup: eight host CPU devices (the sharded tests need them; the rest use one).

Set before any test initialises a JAX backend, so every test module sees the same devices.
"""

import jax

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (RuntimeError, AttributeError):  # a backend is already up, or an older JAX
    pass
