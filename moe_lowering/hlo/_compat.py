"""jaxlib entry points the HLO tool needs, and how they differ between the supported versions.

jax 0.10.2 and 0.11.2 both expose ``hlo_module_from_text`` (on ``xla_client.hlo``), the
HLO-proto -> StableHLO converter ``_jax.mlir.hlo_to_stablehlo``, StableHLO -> HLO through
``mlir_module_to_xla_computation`` and ``Client.compile_and_load(text, devices, options)``; they
are private, so every use goes through this module. The lead's ``moe_lowering/_compat.py`` owns
the jaxpr-level differences.
"""

from __future__ import annotations

import contextlib

import jax
import jax.extend.backend
from jax._src.interpreters import mlir as _jax_mlir
from jax._src.lib import _jax
from jax._src.lib import xla_client

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def make_ir_context():
    """An MLIR context with every dialect JAX emits registered (stablehlo, chlo, mhlo, sdy, func)."""
    return _jax_mlir.make_ir_context()


def hlo_text_to_stablehlo_bytecode(hlo_text: str) -> bytes:
    """HLO text (an XLA dump) -> StableHLO MLIR bytecode. Raises ``ValueError`` if unparsable."""
    try:
        module = xla_client.hlo.hlo_module_from_text(hlo_text)
    except Exception as err:  # the binding raises XlaRuntimeError or a bare RuntimeError
        raise ValueError(_hlo_parse_message(err)) from None
    return _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())


def portable_artifact_to_stablehlo(artifact: bytes) -> str:
    """A StableHLO portable artifact (versioned VHLO bytecode: ``jax.export``'s
    ``Exported.mlir_module_serialized``) -> StableHLO text. Raises ``ValueError`` if unreadable."""
    try:
        with make_ir_context():
            return str(_jax.mlir.deserialize_portable_artifact(artifact))
    except Exception as err:  # the binding raises a bare RuntimeError/ValueError on bad input
        raise ValueError(_hlo_parse_message(err)) from None


def exported_to_portable_artifact(serialized: bytes) -> bytes:
    """The portable artifact inside a serialized ``jax.export.Exported`` (``Exported.serialize()``,
    a flatbuffer). Raises ``ValueError`` if ``serialized`` is not one."""
    try:
        import flatbuffers  # noqa: F401  (jax.export's deserializer needs it; not a dependency of jax)
    except ImportError:
        raise ValueError("reading a serialized jax.export module needs the flatbuffers package "
                         "(pip install flatbuffers)") from None
    try:
        return bytes(jax.export.deserialize(bytearray(serialized)).mlir_module_serialized)
    except Exception as err:  # flatbuffers raises struct.error / IndexError / ... on other bytes
        raise ValueError(f"not a serialized jax.export module ({type(err).__name__}: {err})") from None


def stablehlo_to_hlo_text(stablehlo_text: str) -> str:
    """A StableHLO module's HLO text, as XLA would dump it before optimisation."""
    computation = _jax.mlir.mlir_module_to_xla_computation(stablehlo_text, use_tuple_args=False, return_tuple=False)
    return computation.as_hlo_text()


def compile_stablehlo(stablehlo_text: str):
    """Compile a StableHLO module for the first local device; returns ``run(arrays) -> [np.ndarray]``."""
    import numpy as np

    backend = jax.extend.backend.get_backend()
    device = jax.local_devices()[0]
    executable = backend.compile_and_load(stablehlo_text, [device], xla_client.CompileOptions())

    def run(arrays):
        buffers = [jax.device_put(a, device) for a in arrays]
        results = executable.execute_sharded(buffers).disassemble_into_single_device_arrays()
        return [np.asarray(r[0]) for r in results]

    return run


def enable_x64(enabled: bool):
    """Context manager turning 64-bit types on (modules from x64 programs carry i64/f64)."""
    if not enabled:
        return contextlib.nullcontext()
    setter = getattr(jax, "enable_x64", None)
    if setter is not None:
        return setter(True)
    from jax.experimental import enable_x64 as experimental_enable_x64  # older spelling

    return experimental_enable_x64()


def _hlo_parse_message(err: BaseException) -> str:
    """The HLO parser's ``was parsing L:C: error: ...`` line when present, else the first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if "error:" in line:
            return line.replace("was parsing ", "line ")
    return lines[0] if lines else type(err).__name__


