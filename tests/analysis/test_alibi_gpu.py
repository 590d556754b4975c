"""The alibi experiment on the GPU (quick sizes): the kernels within the accuracy rule near the diagonal
with fp32 accumulators, fp16 accumulators losing the rows far from their keys as the twin predicts, and
the cost table measured on the wgmma kernels."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_alibi_experiment_on_the_kernels(tmp_path):
    from analysis import alibi
    from analysis.common import Context, from_json_number, write_report

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rep = alibi.run_alibi(ctx)
    write_report(ctx, rep, 0.0)
    assert (tmp_path / "alibi.png").exists()
    rule, far, cost = ([dict(zip(t.columns, map(from_json_number, r))) for r in t.rows] for t in rep.tables)
    assert len(rule) == 16
    for r in rule:
        if r["accum"] == "fp32" and r["dtype"] != "f32":
            assert r["within the rule"] is True, r
    assert far[-1]["fp16 accumulators"] > 5 * far[0]["fp16 accumulators"]
    assert max(r["fp32 accumulators"] for r in far) < far[-1]["fp16 accumulators"] / 10
    assert len(cost) == 2
    for r in cost:  # (no tight bounds: the GPU suite shares the GPU between workers)
        assert 0 < r["fwd / plain"] < 3 and 0 < r["bwd / plain"] < 3, r
