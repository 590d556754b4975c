"""The build layer's experiment hook (CPU: NVRTC needs no GPU): ``kernel_build`` gives the variants made
inside it a Build, whose defines replace the variant's own and whose folder replaces kernels_cu/; the
modules, memoized checks and keys of such variants are their own."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from flashcupy import _checks, _compile, _families
from flashcupy._compile import compile_report
from flashcupy._variant import Build, Variant, current_build, kernel_build


def _simt():
    return Variant("fwd_simt", "f16", "fp32", 64, 64, 64)


def test_variants_made_inside_a_build_carry_it_and_are_other_variants():
    plain = _simt()
    assert plain.build is None and current_build() is None
    with kernel_build({"FC_AB_PROBE": 3}) as b:
        inside = _simt()
        assert current_build() == b
    assert current_build() is None
    assert inside.build == Build((("FC_AB_PROBE", 3),))
    assert inside != plain and hash(inside) != hash(plain)
    assert inside.key == plain.key + "+FC_AB_PROBE=3"
    assert inside.defines() == {**plain.defines(), "FC_AB_PROBE": 3}
    # a define of the variant's own is replaced, not repeated
    with kernel_build({"FC_SMEM_FWD": 12345}):
        smem = _simt()
    assert smem.defines()["FC_SMEM_FWD"] == 12345
    assert sum(o.startswith("-DFC_SMEM_FWD=") for o in _compile.compile_options(smem)) == 1
    # an empty block is the package's own build
    with kernel_build():
        assert _simt() == plain


def test_build_rejects_what_is_not_a_define():
    with pytest.raises(ValueError, match="C identifier"):
        Build((("1X", 1),))
    with pytest.raises(TypeError, match="int value"):
        Build((("FC_X", 1.5),))
    with pytest.raises(TypeError, match="int value"):
        Build((("FC_X", True),))
    with pytest.raises(ValueError, match="once"):
        Build((("FC_X", 1), ("FC_X", 2)))
    with pytest.raises(ValueError, match="existing folder"):
        Build((), "/no/such/folder")
    with pytest.raises(TypeError, match="dict"):
        with kernel_build([("FC_X", 1)]):
            pass
    with pytest.raises(TypeError, match="Build"):
        Variant("fwd_simt", "f16", "fp32", 64, 64, 64, build="FC_X=1")


def test_memoized_checks_follow_the_build():
    """A call inside a build gets that build's variant even when the same call ran outside before."""
    q = np.ones((1, 1, 8, 64), np.float16)
    kw = dict(causal=False, scale=None, block_m=None, block_n=None, accum="fp32", kernel="simt", ablate=None)
    outside = _checks.forward_problem(q, q, q, **kw)
    with kernel_build({"FC_AB_PROBE": 1}):
        inside = _checks.forward_problem(q, q, q, **kw)
    assert outside.variant.build is None
    assert inside.variant.build == Build((("FC_AB_PROBE", 1),))
    assert _checks.forward_problem(q, q, q, **kw) is outside


def test_modules_are_memoized_per_build(monkeypatch):
    built = []
    monkeypatch.setattr(_compile, "_MODULES", {})
    monkeypatch.setattr(_compile, "_build_module", lambda v, dev: built.append(v.key) or {"fwd": v.key})
    plain = _simt()
    with kernel_build({"FC_AB_PROBE": 1}):
        probe = _simt()
    for v in (plain, probe, plain, probe):
        _compile._module_on_device(v, 0)
    assert built == [plain.key, probe.key]


@pytest.mark.cupy
def test_defines_reach_the_compiler():
    """A define replaced by the build is what NVRTC compiles: the forward kernels assert at compile time
    that their layout needs exactly FC_SMEM_FWD bytes, so a wrong FC_SMEM_FWD must fail there; the right
    value compiles, and the report's key names the build."""
    real = _simt().smem_for("fwd")
    with kernel_build({"FC_SMEM_FWD": real + 16}):
        wrong = _simt()
    with pytest.raises(_compile.CompileError, match="differs from FC_SMEM_FWD"):
        compile_report(wrong)
    with kernel_build({"FC_SMEM_FWD": real}):
        right = _simt()
    rep = compile_report(right)
    assert rep["kernels"]["flash_fwd_simt"]["smem_dynamic"] == real
    assert rep["key"].endswith(f"+FC_SMEM_FWD={real}")


@pytest.mark.cupy
def test_a_kernels_folder_replaces_the_package_sources(tmp_path):
    """The family's source and its headers come from the build's folder: an #error planted in the
    folder's copy of a header is what NVRTC reports, with the folder's path."""
    folder = tmp_path / "kernels"
    shutil.copytree(_compile._kernels_dir(), folder, ignore=shutil.ignore_patterns("__pycache__"))
    same = compile_report(Variant("fwd_simt", "f16", "fp32", 64, 64, 64,
                                  build=Build((), str(folder))))
    assert same["registers"] == compile_report(_simt())["registers"]
    header = folder / "flash_common.cuh"
    header.write_text("#error planted by the test\n" + header.read_text())
    with kernel_build(kernels_dir=str(folder)):
        v = _simt()
    assert v.key.endswith("@" + str(folder))
    with pytest.raises(_compile.CompileError, match="planted by the test"):
        compile_report(v)


def test_an_edited_header_changes_the_source_text(tmp_path):
    """CuPy's disk cache is keyed by the source text, not by the headers it includes: the text carries a
    digest of the folder's headers, so an edited header is a new text (and a new cubin)."""
    folder = tmp_path / "kernels"
    shutil.copytree(_compile._kernels_dir(), folder, ignore=shutil.ignore_patterns("__pycache__"))
    v = _simt()
    with kernel_build(kernels_dir=str(folder)):
        moved = _simt()
    before = _compile.variant_source(moved)
    assert before.split("\n", 1)[1].startswith(f'#line 1 "{folder}')
    assert before.split("\n", 1)[0] == _compile.variant_source(v).split("\n", 1)[0]  # same headers
    header = folder / "flash_common.cuh"
    header.write_text(header.read_text() + "\n// an edit\n")
    after = _compile.variant_source(moved)
    assert after != before and after.split("\n", 1)[1] == before.split("\n", 1)[1]


def test_an_empty_build_is_the_package_build():
    assert Variant("fwd_simt", "f16", "fp32", 64, 64, 64, build=Build()) == _simt()


@pytest.mark.cupy
def test_module_build_launches_each_kernel_with_its_compiled_shared_memory(monkeypatch):
    """_build_module's Python, with CuPy's device and module faked (no GPU here): the source and options
    handed to RawModule are the variant's, and each kernel's handle carries the module's defines and the
    FC_SMEM_<ROLE> it was compiled for (the variant's own, or a build's replacement)."""
    import cupy

    calls = []

    class FakeFunction:
        max_dynamic_shared_size_bytes = 0

    class FakeModule:
        def __init__(self, code, options):
            calls.append((code, options))

        def get_function(self, name):
            return FakeFunction()

    class FakeDevice:
        def __init__(self, device_id):
            self.attributes = {"MaxSharedMemoryPerBlockOptin": _families.SMEM_LIMIT}

    monkeypatch.setattr(cupy, "RawModule", FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    v = Variant("bwd_wgmma", "f16", "fp32", 64, 128, 128, causal=True)
    handles = _compile._build_module(v, 0)
    code, options = calls[-1]
    assert code == _compile.variant_source(v) and options == _compile.compile_options(v) + ("-arch=sm_90a",)
    assert set(handles) == set(v.roles)
    for role, h in handles.items():
        assert h.smem_bytes == v.smem_for(role) and h.defines == v.defines() and h.name == v.kernel_name(role)
        big = h.smem_bytes > 48 * 1024
        assert h.function.max_dynamic_shared_size_bytes == (h.smem_bytes if big else 0)
    role = v.roles[-1]
    with kernel_build({f"FC_SMEM_{role.upper()}": 1024}):
        w = Variant("bwd_wgmma", "f16", "fp32", 64, 128, 128, causal=True)
    assert _compile._build_module(w, 0)[role].smem_bytes == 1024
    with kernel_build({f"FC_SMEM_{role.upper()}": _families.SMEM_LIMIT + 1}):
        huge = Variant("bwd_wgmma", "f16", "fp32", 64, 128, 128, causal=True)
    with pytest.raises(ValueError, match="shared memory"):
        _compile._build_module(huge, 0)


@pytest.mark.cupy
@pytest.mark.parametrize("family, knobs, switch, value", [
    ("bwd_wgmma", dict(block_m=64, block_n=128, head_dim=128), "FC_BWD_STAGES", 3),
    ("fwd_wgmma", dict(block_m=128, block_n=64, head_dim=64), "FC_KV_STAGES", 3),
    ("fwd_wgmma", dict(block_m=128, block_n=128, head_dim=128, schedule="static"), "FC_WG_O_STAGE", 0),
])
def test_a_layout_switch_changed_alone_is_followed_by_the_host(family, knobs, switch, value):
    """Switches that change a kernel's shared memory are read by the host's formulas through
    Variant.switch: a build that sets one alone compiles (the kernels assert their layout against
    FC_SMEM_<ROLE> at compile time) and is launched with its own shared memory."""
    plain = Variant(family, "f16", "fp32", **knobs)
    with kernel_build({switch: value}):
        v = Variant(family, "f16", "fp32", **knobs)
    assert v.switch(switch, -1) == value and plain.switch(switch, -1) == -1
    role = v.roles[0] if family == "fwd_wgmma" else "dkdvdq"
    assert v.smem_for(role) != plain.smem_for(role)
    rep = compile_report(v)
    assert rep["spill_stores"] == 0 and rep["smem_dynamic"] == v.smem_for(role)


def test_a_build_of_another_tile_sets_the_default_tile():
    """FC_BLOCK_M / FC_BLOCK_N in a build are the default tile of calls made inside it (analysis.ab can
    then time two tiles as two arms: the variant is made with the build's tile, so the host launches its
    grid); default_tile gives a caller's own block_m / block_n back (though the build's define still
    compiles the variant: analysis.ab's arms give none), and outside the build the family's default is
    back."""
    from flashcupy._policy import default_tile

    plain = default_tile("bwd_wgmma", "f16", 64, "fp32", False, n=4096)
    assert plain == (128, 128)
    with kernel_build({"FC_BLOCK_M": 64, "FC_BLOCK_N": 128}):
        assert default_tile("bwd_wgmma", "f16", 64, "fp32", False, n=4096) == (64, 128)
        assert default_tile("bwd_wgmma", "f16", 64, "fp32", False, block_m=128, n=4096) == (128, 128)
    with kernel_build({"FC_BLOCK_M": 64}):  # block_n from the family's rule for block_m=64
        assert default_tile("bwd_wgmma", "f16", 64, "fp32", False, n=4096) == (64, 128)
    assert default_tile("bwd_wgmma", "f16", 64, "fp32", False, n=4096) == plain


def _sectioned_tile(lin: int, n_kt: int, n_hb: int, hs: int) -> tuple[int, int]:
    """kernels_cu/bwd_wgmma.cu's sectioned_tile, written again: the (key tile, (batch, KV head) pair)
    of linear block index lin."""
    sec = lin // (hs * n_kt)
    first = sec * hs
    in_sec = min(hs, n_hb - first)
    r = lin - first * n_kt
    return r // in_sec, first + r % in_sec


@pytest.mark.parametrize("n_kt,n_hb", [(1, 1), (7, 1), (3, 5), (128, 128), (9, 13), (64, 16)])
def test_the_ordered_backward_waits_only_on_lower_blocks(n_kt, n_hb):
    """The deterministic wgmma backward without a mask adds into each query tile in ascending key tiles,
    so key tile kt waits for key tile kt - 1 of its head. With the blocks in sections of any size (the
    rule's and every other), each (key tile, head) is one block's, and that predecessor's block index is
    lower: no CTA waits on one that may not have started. The rule's section size lies in 1..heads and
    is every head where the grid fits in two waves of the SMs."""
    from flashcupy._policy import bwd_wgmma_ordered_heads

    for hs in sorted({1, 2, 3, n_hb, n_hb + 4, bwd_wgmma_ordered_heads(n_hb, n_kt, 40, 132)}):
        block = {}
        for lin in range(n_kt * n_hb):
            tile = _sectioned_tile(lin, n_kt, n_hb, hs)
            assert tile not in block and 0 <= tile[0] < n_kt and 0 <= tile[1] < n_hb
            block[tile] = lin
        assert len(block) == n_kt * n_hb
        for (kt, hb), lin in block.items():
            assert kt == 0 or block[(kt - 1, hb)] < lin, (hs, kt, hb)
    for tiles in (1, 8, 52, 205, 10 ** 4):
        g = bwd_wgmma_ordered_heads(n_hb, n_kt, tiles, 132)
        assert 1 <= g <= n_hb
        if n_hb * n_kt <= 2 * 132:
            assert g == n_hb


def _every_variant():
    """Every variant the families accept over their tiles, dtypes, accumulators, masks, breaks, fp8 and
    schedule knobs, at head dims 8, 40, 64, 96, 128 and 256."""
    import itertools

    for name, fam in _families.FAMILIES.items():
        fp8 = [(None, "tile")] + ([(a, s) for a in _families.FP8_ACCUMULATIONS for s in _families.FP8_KSCALES]
                                  if name == "fwd_wgmma" else [])
        schedules = (None, *_families.SCHEDULES) if name == "fwd_wgmma" else (None,)
        for dtype, bm, bn, d, causal, ablate, (acc8, kscale), schedule in itertools.product(
                fam.dtypes, fam.block_m, fam.block_n, (8, 40, 64, 96, 128, 256), (False, True),
                _families.ABLATIONS, fp8, schedules):
            for accum in fam.accums(dtype):
                try:
                    yield Variant(name, dtype, accum, bm, bn, d, causal, ablate, fp8=acc8, fp8_kscale=kscale,
                                  schedule=schedule)
                except ValueError:  # a combination the family refuses
                    pass


def test_a_variants_key_names_its_compilation():
    """Two variants share a key exactly when they compile the same module: the same family source and
    the same defines (the module cache and ``covering_variants`` go by the key)."""
    by_key, by_defines = {}, {}
    count = 0
    for v in _every_variant():
        compiled = (v.family, tuple(sorted(v.defines().items())))
        assert by_key.setdefault(v.key, compiled) == compiled, f"{v.key} names two compilations"
        other = by_defines.setdefault(compiled, v.key)
        assert other == v.key, f"{v.key} and {other} compile alike"
        count += 1
    assert count > 1000 and len(by_key) == len(by_defines)
