"""Every kernel family compiles with NVRTC on a machine with no GPU, over a covering set of variants,
and the variants that must not spill do not (ptxas's resource report)."""
from __future__ import annotations

import re

import pytest

from flashcupy._build import FAMILIES, compile_report, covering_variants, source_text

VARIANTS = [pytest.param(v, id=v.key) for fam in FAMILIES for v in covering_variants(fam)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_compiles_without_spills(variant):
    rep = compile_report(variant)
    assert rep["registers"] > 0, rep
    assert rep["registers"] <= 65536 // variant.threads, f"too many registers to launch: {rep}"
    if variant.fam.no_spill(variant):
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sources_carry_line_directive_and_ablation_switches(family):
    src = source_text(FAMILIES[family].source)
    assert src.startswith(f'#line 1 "kernels_cu/{FAMILIES[family].source}"')
    if not family.startswith("fwd"):
        return  # the breaks live in the forward's online softmax
    for switch in ("FC_ABLATE_MAX_SUBTRACTION", "FC_ABLATE_RESCALING"):
        assert re.search(rf"^#\s*(if|elif)\b.*\b{switch}\b", src, re.M), f"{family} lacks an #if {switch} branch"


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    """A broken source reports kernels_cu/<file>:<line>, thanks to the #line prefix."""
    from flashcupy import _build

    fam = FAMILIES["fwd_simt"]
    broken = source_text(fam.source) + "\nthis is not C++;\n"
    monkeypatch.setattr(_build, "source_text", lambda name: broken)
    v = covering_variants("fwd_simt")[0]
    with pytest.raises(_build.CompileError, match=r"kernels_cu/fwd_simt\.cu\(\d+\)"):
        compile_report(v)
