"""``analysis fp8`` on a Hopper GPU: its arms and its N sweep run the fp8 wgmma kernel (quick sizes)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_fp8_experiment_runs_the_kernel(tmp_path):
    from analysis import fp8 as exp
    from analysis.common import Context

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    if not exp._kernel_runs(ctx):
        pytest.skip("the fp8 wgmma kernel needs a Hopper GPU")
    rep = exp.run_fp8(ctx)
    arms = next(t for t in rep.tables if t.title == "Arms against float64")
    fp8_rows = [r for r in arms.rows if r[1].startswith("e4m3")]
    assert len(fp8_rows) == 48 and all(r[1] == "e4m3 (kernel)" for r in fp8_rows)
    for dist in {r[0] for r in arms.rows}:
        ref = max(r[6] for r in arms.rows if r[0] == dist and not r[1].startswith("e4m3"))
        assert all(r[6] > ref for r in fp8_rows if r[0] == dist)  # fp8 loses to fp16 / bf16
    sweep = rep.data["sweep"]
    long = [p for p in sweep if p["v mean"] == 1.0][-1]
    # the tensor core's truncating accumulator: single-level costs more than two-level, and the two
    # kernels' outputs differ by about the single-level accumulation's own error
    assert long["single accumulation"] > 3 * long["tile accumulation"]
    assert long["single - tile"] == pytest.approx(long["single accumulation"], rel=0.5)
