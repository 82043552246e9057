"""``--verify``: compile the original and rewritten modules, run both on the same random inputs.

Inputs are routing-realistic: floats ``N(0, 1/fan_in)`` (fan-in = the second-to-last dimension,
as for a lecun-normal weight), so router logits are spread and top-k choices have no ties; ints
are small non-negative values, valid as indices. Each module is compiled as written (not via
our importer), so this checks the rewrite end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moe_lowering.hlo import _compat

# (rtol, atol relative to the output's largest magnitude): f32 tight, 16-bit loose.
_TOLERANCES = {4: (1e-4, 1e-5), 8: (1e-9, 1e-12), 2: (3e-2, 3e-2)}


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    max_abs_error: float
    detail: str


def random_inputs(avals: Sequence, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for aval in avals:
        dtype = np.dtype(aval.dtype)
        shape = tuple(aval.shape)
        if dtype == np.bool_:
            arrays.append(rng.random(shape) < 0.5)
        elif dtype.kind in "iu":
            arrays.append(rng.integers(0, 4, shape).astype(dtype))
        else:
            fan_in = shape[-2] if len(shape) >= 2 else 1
            arrays.append((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype))
    return arrays


def verify(original_stablehlo: str, rewritten_stablehlo: str, in_avals: Sequence, *, seeds=(0, 1)) -> VerifyResult:
    run_original = _compat.compile_stablehlo(original_stablehlo)
    run_rewritten = _compat.compile_stablehlo(rewritten_stablehlo)
    worst = 0.0
    for seed in seeds:
        inputs = random_inputs(in_avals, seed)
        expected = run_original(inputs)
        got = run_rewritten(inputs)
        if len(expected) != len(got):
            return VerifyResult(False, float("inf"), f"{len(got)} outputs instead of {len(expected)}")
        for index, (want, have) in enumerate(zip(expected, got)):
            if want.shape != have.shape or want.dtype != have.dtype:
                return VerifyResult(
                    False, float("inf"), f"output {index}: {have.dtype}{list(have.shape)} instead of {want.dtype}{list(want.shape)}"
                )
            error, bad = _compare(want, have)
            worst = max(worst, error)
            if bad:
                return VerifyResult(False, error, f"output {index} (seed {seed}): max |error| {error:.3g} ({bad})")
    return VerifyResult(True, worst, f"{len(seeds)} random input sets agree (max |error| {worst:.3g})")


def _compare(want: np.ndarray, have: np.ndarray) -> tuple[float, str]:
    if want.dtype.kind in "biu":
        mismatches = int(np.sum(want != have))
        return float(mismatches), f"{mismatches} integer elements differ" if mismatches else ""
    want64 = want.astype(np.float64)
    have64 = have.astype(np.float64)
    if not np.array_equal(np.isfinite(want64), np.isfinite(have64)):
        return float("inf"), "non-finite values differ"
    finite = np.isfinite(want64)
    error = float(np.max(np.abs(want64 - have64)[finite], initial=0.0))
    rtol, atol = _TOLERANCES.get(want.dtype.itemsize, _TOLERANCES[2])
    scale = float(np.max(np.abs(want64[finite]), initial=0.0))
    close = np.abs(want64 - have64) <= atol * scale + rtol * np.abs(want64)
    bad = int(np.sum(~close & finite))
    return error, f"{bad} elements beyond rtol={rtol:g}, atol={atol:g}*max|ref|" if bad else ""
