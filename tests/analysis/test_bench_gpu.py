"""One bench cell on the GPU: positive numbers, and ratios computed from the same run."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_bench_one_cell(tmp_path):
    from analysis import bench
    from analysis.common import Context, from_json_number, write_report

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rep = bench.run_bench(ctx, cells=[("f16", 1024, 64, False)])
    write_report(ctx, rep, 0.0)
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.md").exists()
    t = rep.tables[0]
    rows = [dict(zip(t.columns, map(from_json_number, r))) for r in t.rows]
    assert {r["direction"] for r in rows} == {"fwd", "bwd"}
    cells = {c["direction"]: c for c in rep.data["cells"]}
    for r in rows:
        ours = r["flashcupy mma TFLOP/s"]
        assert ours > 0
        peers = [c[: -len(" TFLOP/s")] for c in t.columns
                 if c.endswith(" TFLOP/s") and not c.startswith("flashcupy")]
        assert "naive" in peers
        for p in peers:
            theirs = r[f"{p} TFLOP/s"]
            if theirs is None:
                continue
            assert theirs > 0
            assert r[f"mma / {p}"] == pytest.approx(ours / theirs, rel=1e-9)
            # the ratio is of times measured in this run
            c = cells[r["direction"]]
            assert r[f"mma / {p}"] == pytest.approx(c[p]["ms"] and c[p]["ms"] / c["flashcupy mma"]["ms"],
                                                    rel=1e-9)


def test_bench_small_call_table(tmp_path):
    """The small-call table: every shape in both directions, positive times, ratios of this run."""
    from analysis import bench
    from analysis.common import Context

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rows = bench._small_calls(ctx, bench._load_torch())
    assert len(rows) == len(bench.SMALL_DIRECTIONS) * len(bench.SMALL_SHAPES)
    for b, h, n, d, direction, ours, theirs, ratio, ours_min, theirs_min, ratio_min, dev_ours, dev_theirs, \
            bridge, bridge_ratio in rows:
        assert ours >= ours_min > 0 and dev_ours > 0
        if theirs is not None:
            assert ratio == pytest.approx(ours / theirs)
            assert theirs >= theirs_min > 0 and ratio_min == pytest.approx(ours_min / theirs_min)
            assert bridge > 0 and bridge_ratio == pytest.approx(bridge / theirs)


def test_bench_fp8_table(tmp_path):
    """A D=128 cell on a Hopper GPU: the fp8 forward's table, its ratios from the same run."""
    from analysis import bench
    from analysis.common import Context

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    import cupy

    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("the fp8 wgmma kernel needs a Hopper GPU")
    rep = bench.run_bench(ctx, cells=[("f16", 1024, 128, True)])
    t = next(t for t in rep.tables if t.title.startswith("fp8"))
    (row,) = t.rows
    dtype, n, d, causal, one, two, w, r1, r2, cu, rc = row
    assert (dtype, n, d, causal) == ("f16", 1024, 128, True) and one > 0 and two > 0 and w > 0
    assert r1 == pytest.approx(one / w) and r2 == pytest.approx(two / w)
    assert "fp8 (e4m3) forward" in rep.finding
