"""Every kernel family compiles with NVRTC on a machine with no GPU, over a covering set of variants,
and the variants that must not spill do not (ptxas's resource report)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashcupy._compile import toolkit_ptxas  # (private: the toolkit's ptxas, for the cross-checks)
from flashcupy.inspect import FAMILIES, compile_report, covering_variants, ptx, source_text

pytestmark = pytest.mark.cupy  # NVRTC comes with CuPy

VARIANTS = [pytest.param(v, id=v.key) for fam in FAMILIES for v in covering_variants(fam)]


def _report_or_error(variant):
    try:
        return compile_report(variant)
    except Exception as e:  # raised again by the variant's own test
        return e


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every covering variant's compile report, built once for the module's tests by a pool of threads
    (NVRTC runs without the GIL: the compile check scales with the cores instead of running 140-odd
    compiles one after another)."""
    variants = [p.values[0] for p in VARIANTS]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip((v.key for v in variants), pool.map(_report_or_error, variants)))


def _report(reports: dict, variant) -> dict:
    rep = reports[variant.key]
    if isinstance(rep, Exception):
        raise rep
    return rep


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_compiles_without_spills(variant, reports):
    rep = _report(reports, variant)
    assert rep["registers"] > 0, rep
    assert rep["registers"] <= 65536 // variant.threads, f"too many registers to launch: {rep}"
    if variant.fam.no_spill(variant):
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"


# ptxas warnings that silently cost a Hopper kernel its overlap: wgmma serialized because other
# instructions define its accumulators (C7515), for want of registers (C7511) or because registers of an
# in-flight wgmma are written (C7513); setmaxnreg ignored (C7508). (NVRTC 13.5 did not print C7513 where
# the toolkit's ptxas 13.0 did: this check reads what NVRTC reports.)
SERIALIZING_WARNINGS = ("C7515", "C7511", "C7513", "C7508")


@pytest.mark.parametrize("variant", [p for p in VARIANTS if p.values[0].fam.kind == "wgmma"],
                         ids=lambda v: v.key)
def test_wgmma_variants_keep_their_overlap(variant, reports):
    warnings = [w for w in _report(reports, variant)["warnings"] if any(c in w for c in SERIALIZING_WARNINGS)]
    assert not warnings, warnings


WGMMA_VARIANTS = [p for p in VARIANTS if p.values[0].fam.kind == "wgmma"]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="the CUDA toolkit's ptxas is not on PATH")
@pytest.mark.parametrize("variant", WGMMA_VARIANTS, ids=lambda v: v.key)
def test_wgmma_under_the_toolkit_ptxas(variant, tmp_path):
    """The same PTX through the toolkit's ptxas (which prints the C75xx notes where NVRTC's log may be
    empty; at its own PTX version when it is older than NVRTC): no serializing note; and, where
    cuobjdump exists, the main loop issues wgmma: HGMMA on 16-bit operands, QGMMA on e4m3 (fp8), not
    only the HMMA of the mma.sync path."""
    out = tmp_path / "k.cubin"
    res = toolkit_ptxas(ptx(variant), variant.fam.arch, str(out))
    if res.returncode and "version" in res.stderr:
        pytest.skip(f"the toolkit's ptxas cannot read NVRTC's PTX: {res.stderr.strip().splitlines()[0]}")
    assert res.returncode == 0, res.stderr[-2000:]
    warnings = [w for w in res.stderr.splitlines() if any(c in w for c in SERIALIZING_WARNINGS)]
    assert not warnings, warnings
    if shutil.which("cuobjdump"):
        sass = subprocess.run(["cuobjdump", "--dump-sass", str(out)], capture_output=True, text=True,
                              check=True).stdout
        gmma = "QGMMA" if variant.fp8 else "HGMMA"
        assert gmma in sass, f"no {gmma} in the SASS of {variant.key}: {sass[:2000]}"


def test_softmax_step_and_its_breaks_exist_once():
    """The online-softmax step, with the two #if branches that break it, is written in flash_common.cuh
    only; every forward family calls it and none restates a break; every forward writes its LSE through
    fc_hook_lse (fc_softmax_lse, with what the score hook took off a row given back)."""
    common = source_text("flash_common.cuh")
    for switch in ("FC_ABLATE_MAX_SUBTRACTION", "FC_ABLATE_RESCALING"):
        assert re.search(rf"^#\s*(if|elif)\b.*\b{switch}\b", common, re.M), switch
    for family in FAMILIES.values():
        src = source_text(family.source)
        digest, rest = src.split("\n", 1)
        assert digest.startswith("// headers ") and rest.startswith(f'#line 1 "kernels_cu/{family.source}"')
        assert not re.search(r"^#\s*(if|elif)\b.*\bFC_ABLATE_", src, re.M), family.name
        if family.direction == "fwd":
            assert "fc_softmax_step(" in src and "fc_hook_lse(" in src, family.name
            assert "fc_softmax_lse(" not in src, family.name


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    """A broken source reports kernels_cu/<file>:<line>, thanks to the #line prefix."""
    from flashcupy import _compile

    fam = FAMILIES["fwd_simt"]
    broken = source_text(fam.source) + "\nthis is not C++;\n"
    monkeypatch.setattr(_compile, "source_text", lambda name, kernels_dir=None: broken)
    v = covering_variants("fwd_simt")[0]
    with pytest.raises(_compile.CompileError, match=r"kernels_cu/fwd_simt\.cu\(\d+\)"):
        compile_report(v)


def test_report_survives_an_nvrtc_that_keeps_ptxas_quiet(monkeypatch):
    """NVRTC >= 12.9 serves repeated compiles from its on-disk cache without running ptxas, so the log
    has no resource report: with the in-process log emptied, the report comes from a fresh process with
    the cache off, the same numbers."""
    from flashcupy import _compile

    v = covering_variants("fwd_mma")[0]
    want = compile_report(v)
    monkeypatch.setattr(_compile, "_nvrtc_log", lambda variant, arch: "")
    monkeypatch.setattr(_compile, "_toolkit_ptxas_log", lambda variant, arch: None)
    got = compile_report(v)
    assert got["kernels"] == want["kernels"] and got["registers"] > 0


def test_report_falls_back_when_the_fresh_process_fails(monkeypatch):
    """A fresh process that cannot run (or times out) gives way to the toolkit's ptxas, and with neither
    the error shows NVRTC's own log."""
    import subprocess

    from flashcupy import _compile

    v = covering_variants("fwd_mma")[0]

    def broken(*args, **kwargs):
        raise subprocess.TimeoutExpired("python", 900)

    monkeypatch.setattr(_compile, "_nvrtc_log", lambda variant, arch: "NVRTC said this")
    monkeypatch.setattr(subprocess, "run", broken)
    monkeypatch.setattr(_compile, "_toolkit_ptxas_log", lambda variant, arch: None)
    with pytest.raises(_compile.CompileError, match="NVRTC said this"):
        compile_report(v)
