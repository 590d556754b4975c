"""analysis.bench's compile-report rows (CPU only): one row per set of kernels a provider launches, with
the lengths that launch it (the wgmma backward's atomic path runs its rotated twin up to 2048 query rows
at D=64 without a causal mask)."""
from __future__ import annotations

from types import SimpleNamespace

from analysis import bench
from flashcupy._policy import bwd_wgmma_rotated
from flashcupy._variant import Variant


def test_compile_rows_follow_the_kernels_each_length_launches():
    v = Variant("bwd_wgmma", "f16", "fp32", 128, 128, 64, False)
    kernels = {v.kernel_name(r): {"registers": 168, "smem_static": 0, "smem_dynamic": 1000 + i,
                                  "spill_stores": 0, "spill_loads": 0} for i, r in enumerate(v.roles)}
    report = (v, {"key": v.key, "kernels": kernels, "nvrtc_compile_s": 1.0})
    rows = {}
    lengths = (1024, 2048, 4096, 16384)
    for n in lengths:
        cell = SimpleNamespace(dname="f16", n=n, d=64, causal=False)
        for name, det in (("flashcupy wgmma", False), ("flashcupy wgmma det", True)):
            bench._note_compile(rows, name, "bwd", cell, report, det)
    _, _, comp, _ = bench._tables([], rows, [])
    atomic = sorted((r[5], r[7]) for r in comp if r[0] == "flashcupy wgmma")
    rotated = ", ".join(str(n) for n in lengths if bwd_wgmma_rotated(64, False, n))
    plain = ", ".join(str(n) for n in lengths if not bwd_wgmma_rotated(64, False, n))
    want = [(rotated, "bwd_prep/bwd_dkdvdq_rotated_wgmma/bwd_dq_convert"),
            (plain, "bwd_prep/bwd_dkdvdq_wgmma/bwd_dq_convert")]
    assert atomic == sorted(w for w in want if w[0]) and len(atomic) == 2  # the rule splits these lengths
    det = [r for r in comp if r[0] == "flashcupy wgmma det"]
    assert len(det) == 1 and det[0][5] == "1024, 2048, 4096, 16384"
    assert det[0][7] == "bwd_prep/bwd_dkdvdq_ordered_wgmma/bwd_dq_convert"


def test_the_speed_figure_names_its_card_and_commit(monkeypatch):
    """The CUDA figure, drawn from the committed bench's cells, titles itself with the run's card and
    commit (a bench.png shown beside another run's table must say whose it is)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[2] / "reports" / "bench.json").read_text())
    raw = data["data"]["cells"]
    peers = ["naive"] + [f"torch {s}" for s in bench.sdpa.BACKENDS]
    columns, table_rows, _, _ = bench._tables(raw, {}, peers)
    monkeypatch.setenv("FLASHCUPY_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567+dirty")
    ctx = SimpleNamespace(backend="cuda", quick=False, device_name=lambda: "NVIDIA H100 (CUDA kernels)")
    fig = bench._figure(ctx, columns, table_rows, raw, bench.MINE + peers)
    assert fig._suptitle.get_text().endswith(": NVIDIA H100 (CUDA kernels), 0123456+dirty")
