"""flashcupy.inspect: the public window on the build layer (CPU; the compile part needs CuPy's NVRTC)."""
from __future__ import annotations

import numpy as np
import pytest

from flashcupy import inspect


def test_the_variant_of_a_call_is_the_one_the_call_checks(rng):
    shapes = [(1, 4, 70, 64), (1, 2, 90, 64), (1, 2, 90, 64)]
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    var = inspect.forward_variant(q, k, v, causal=True, kernel="mma")
    assert var.family == "fwd_mma" and var.causal and var.head_dim == 64 and var.key.startswith("fwd_mma.f16")
    assert inspect.launch_roles(var) == ("fwd",)
    o = np.zeros_like(q)
    lse = np.zeros((1, 4, 70), np.float32)
    bwd = inspect.backward_variant(o, q, k, v, o, lse, causal=True, kernel="mma", deterministic=True)
    assert bwd.family == "bwd_mma" and inspect.launch_roles(bwd, True)[0] == "prep"
    with pytest.raises(ValueError, match="head dim"):
        inspect.forward_variant(q[..., :60], k[..., :60], v[..., :60])


def test_every_family_has_a_covering_set_and_a_source():
    for name, fam in inspect.FAMILIES.items():
        variants = inspect.covering_variants(name)
        assert variants and all(v.family == name for v in variants)
        assert "extern \"C\" __global__" in inspect.source_text(fam.source)


@pytest.mark.cupy
def test_a_builds_define_reaches_the_compile_report():
    var = inspect.covering_variants("fwd_simt")[0]
    with inspect.kernel_build({"FC_ANYTHING": 1}):
        built = inspect.Variant(var.family, var.dtype, var.accum, var.block_m, var.block_n, var.head_dim)
    assert built.key.endswith("+FC_ANYTHING=1")
    assert "-DFC_ANYTHING=1" in inspect.nvrtc_options(built.defines())
    rep = inspect.compile_report(built)
    assert rep["key"] == built.key and rep["spill_stores"] == 0 and rep["registers"] > 0
