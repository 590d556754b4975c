"""The alibi experiment on the GPU (quick sizes): the kernels within the accuracy rule in every case with
16-bit inputs, fp16 accumulators keeping the rows far from their keys (measured from key 0) where the
twin measured from i' loses them, and the cost table measured on the wgmma kernels."""
from __future__ import annotations

import pytest

from tests.helpers import assert_cost_ratios

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
    for r in rule:  # fp16 accumulators too, far rows included (measured from key 0)
        if r["dtype"] == "f16":
            assert r["within the rule"] is True, r
    shifted = [r["fp16 accumulators"] for r in far]
    assert max(shifted) < 4 * shifted[0]
    assert max(r["fp16 accumulators, measured from i' (twin)"] for r in far) > 3 * max(shifted)
    assert len(cost) == 2
    assert_cost_ratios(cost)  # (bounded in a lone run only: tests/helpers.py)
