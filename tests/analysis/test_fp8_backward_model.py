"""The fp8 backward study's building blocks (analysis/fp8_backward.py): stochastic rounding lands on
representable values, saturates, and is unbiased; round-to-nearest is ml_dtypes'; the block and element
scales follow their definitions."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from analysis.fp8_backward import _FORMATS, _fp8, _round_fp8

DT = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_stochastic_rounding_is_representable_saturating_and_unbiased(fmt):
    rng = np.random.default_rng(3)
    fmax, _, emin = _FORMATS[fmt]
    # normal values, subnormals and values past the largest finite one
    y = np.concatenate([rng.uniform(-fmax, fmax, 200), rng.uniform(-1, 1, 200) * 2.0 ** emin,
                        [1.5 * fmax, -2 * fmax]])
    draws = np.stack([_round_fp8(y, fmt, rng) for _ in range(4000)])
    assert np.array_equal(draws, draws.astype(DT[fmt]).astype(np.float64))  # representable
    assert (np.abs(draws) <= fmax).all() and (draws[:, -2:] == [fmax, -fmax]).all()
    inside = np.abs(y) <= fmax
    ulp = np.abs(draws.max(axis=0) - draws.min(axis=0))[inside]  # the two neighbours' spacing
    bias = np.abs(draws.mean(axis=0)[inside] - y[inside])
    assert (bias <= 0.05 * np.maximum(ulp, 1e-300) + 1e-300).all()  # 4000 draws: within 5% of an ulp
    nearest = _round_fp8(y[inside], fmt)
    assert np.array_equal(nearest, y[inside].astype(np.float32).astype(DT[fmt]).astype(np.float64))


def test_block_and_element_scales():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 100, 70)) * np.exp(rng.uniform(-3, 3, (2, 100, 70)))
    q, s = _fp8(x, "e4m3", -1, "block64")
    for r0 in (0, 64):
        for c0 in (0, 64):
            blk = np.abs(x[:, r0:r0 + 64, c0:c0 + 64]).max(axis=(-2, -1))
            want = (blk / 448.0).astype(np.float32).astype(np.float64)
            assert (s[:, r0:r0 + 64, c0:c0 + 64] == want[:, None, None]).all()
    assert (np.abs(q) <= 448).all()
    q, s = _fp8(x, "e4m3", -1, "element")
    assert (np.abs(q * s - x) <= 2.0 ** -4 * np.abs(x)).all()  # only the mantissa rounds
