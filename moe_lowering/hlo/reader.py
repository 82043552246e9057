"""Reading the tool's inputs: StableHLO text, MLIR bytecode, HLO text, XLA dump directories, and
``jax.export``'s modules: a serialized ``Exported`` (``Exported.serialize()``) and the StableHLO
portable artifact in it (versioned VHLO bytecode), both read as the StableHLO they hold.

Every failure is a :class:`ModuleReadError` with a one-line message naming the file and, for
MLIR, the line and column of the first diagnostic; the CLI prints it and exits 2. Given a
``worker`` (:class:`moe_lowering.hlo.isolated.Worker`, what the CLI does) the native parsing and
conversion of the input runs first in that child process, so input that crashes jaxlib is an
error too rather than the end of the process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from jaxlib.mlir import ir

from moe_lowering.hlo import _compat

MLIR_BYTECODE_MAGIC = b"ML\xefR"
# The producer a StableHLO portable artifact names after the magic and version byte (``StableHLO_v1.9.3``).
PORTABLE_ARTIFACT_PRODUCER = b"StableHLO_v"
# The kinds read through a conversion (``convert``), and what their conversion errors are called.
CONVERTED_KINDS = {"hlo": "invalid HLO", "portable": "invalid StableHLO portable artifact",
                   "exported": "unreadable"}
# What a dump directory holds that we rewrite: XLA's pre-optimisation HLO and JAX's MLIR dumps.
DUMP_PATTERNS = (".before_optimizations.txt", ".mlir", ".mlirbc")


class ModuleReadError(ValueError):
    """The input is not a readable, valid StableHLO/HLO module."""


@dataclass(frozen=True)
class ModuleSource:
    """One input module: its bytes as read, what they are, and the MLIR to parse."""

    path: str
    kind: str  # "stablehlo" (MLIR text), "bytecode" (MLIR bytecode), "hlo" (HLO text), "portable" (a StableHLO
    #            portable artifact) or "exported" (a serialized jax.export module)
    raw: bytes
    mlir: bytes | str  # StableHLO text or bytecode for ``ir.Module.parse``


def detect_kind(raw: bytes, path: str) -> str:
    if raw.startswith(MLIR_BYTECODE_MAGIC):
        return "portable" if raw[len(MLIR_BYTECODE_MAGIC) + 1:].startswith(PORTABLE_ARTIFACT_PRODUCER) else "bytecode"
    if b"\x00" in raw:  # no text module holds a NUL; a flatbuffer does (it has no magic of its own)
        return "exported"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ModuleReadError(f"{path}: neither text, MLIR bytecode nor a serialized jax.export module") from None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("//") or line.startswith("#loc"):
            continue
        if line.startswith("HloModule"):
            return "hlo"
        if line.startswith("module") or line.startswith("func.func") or line.startswith('"builtin.module"'):
            return "stablehlo"
        break
    raise ModuleReadError(f"{path}: not a StableHLO module (`module ...`), MLIR bytecode, or HLO text (`HloModule ...`)")


def load_source(path: str, *, worker=None) -> ModuleSource:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ModuleReadError(f"{path}: cannot read: {err.strerror or err}") from None
    return source_from_bytes(raw, path, worker=worker)


def source_from_bytes(raw: bytes, path: str = "<input>", *, worker=None) -> ModuleSource:
    """The module in ``raw``; with a ``worker``, parsed/converted in that child process first."""
    if not raw.strip():
        raise ModuleReadError(f"{path}: empty input")
    kind = detect_kind(raw, path)
    if worker is not None:
        from moe_lowering.hlo import isolated

        try:
            converted = worker.check_module(raw, kind)
        except isolated.IsolatedError as err:
            what = CONVERTED_KINDS.get(kind, "invalid module")
            message = str(err)
            # MLIR diagnostics already read as "line L:C: ..." or "<op> op ...": keep them as they were.
            raise ModuleReadError(
                f"{path}: {what}: {message}" if kind in CONVERTED_KINDS or err.crashed else f"{path}: {message}"
            ) from None
        if kind in CONVERTED_KINDS:
            return ModuleSource(path, kind, raw, converted if kind == "hlo" else converted.decode("utf-8"))
    if kind in CONVERTED_KINDS:
        try:
            mlir = convert(raw, kind)
        except ValueError as err:
            raise ModuleReadError(f"{path}: {CONVERTED_KINDS[kind]}: {err}") from None
        return ModuleSource(path, kind, raw, mlir)
    return ModuleSource(path, kind, raw, raw if kind == "bytecode" else raw.decode("utf-8"))


def convert(raw: bytes, kind: str) -> bytes | str:
    """The MLIR of a module of one of ``CONVERTED_KINDS``: StableHLO bytecode for HLO text, StableHLO
    text for ``jax.export``'s modules. Raises ``ValueError`` when ``raw`` is not one."""
    if kind == "hlo":
        try:
            return _compat.hlo_text_to_stablehlo_bytecode(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(str(err)) from None
    if kind == "exported":
        raw = _compat.exported_to_portable_artifact(raw)
    return _compat.portable_artifact_to_stablehlo(raw)


def parse(source: ModuleSource, context: ir.Context) -> ir.Module:
    """The verified MLIR module of ``source`` in ``context``."""
    with context:
        try:
            return ir.Module.parse(source.mlir)
        except ir.MLIRError as err:
            raise ModuleReadError(f"{source.path}: {_first_diagnostic(err)}") from None
        except (ValueError, RuntimeError) as err:
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModuleReadError(f"{source.path}: invalid module: {message}") from None


def _first_diagnostic(err) -> str:
    diagnostics = getattr(err, "error_diagnostics", None) or []
    if diagnostics:
        first = diagnostics[0]
        location = _short_location(str(first.location))
        return f"{location}: {first.message}" if location else first.message
    text = str(err).strip().splitlines()
    return text[-1].strip() if text else "invalid MLIR"


def _short_location(location: str) -> str:
    """``loc("-":3:7)`` -> ``line 3:7``."""
    match = re.search(r":(\d+):(\d+)", location)
    return f"line {match.group(1)}:{match.group(2)}" if match else ""


def dump_modules(directory: str) -> list[str]:
    """The module files of an XLA (``--xla_dump_to``) or JAX IR dump directory, sorted."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(DUMP_PATTERNS))
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]
