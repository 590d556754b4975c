"""The softcap experiment on the GPU (quick sizes): the kernels' error rows within the accuracy rule with
fp32 accumulators, for both tanh, and the cost table measured on the wgmma kernels."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


def test_softcap_experiment_on_the_kernels(tmp_path):
    from analysis import softcap
    from analysis.common import Context, from_json_number, write_report

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rep = softcap.run_softcap(ctx)
    write_report(ctx, rep, 0.0)
    assert (tmp_path / "softcap.png").exists()
    err, _, cost = ([dict(zip(t.columns, map(from_json_number, r))) for r in t.rows] for t in rep.tables)
    for r in err:
        assert all(r[c] > 0 for c in ("o", "dQ", "dK", "dV"))
        if r["dtype"] == "f32" or r["cap"] == 0:  # (no second tanh to run)
            assert math.isnan(r["o (accurate tanh)"]) and r["within the rule (accurate)"] is None
        # 16-bit inputs with fp32 accumulators: within the rule with either tanh (the float32 kernels'
        # excess at large exponents is reported, not asserted: docs/design/score_variants.md)
        if r["accum"] == "fp32" and r["dtype"] != "f32":
            assert r["within the rule"] is True, r
            if r["cap"]:
                assert r["within the rule (accurate)"] is True, r
    assert len(cost) == 2
    for r in cost:  # the cap is paid for, within reason
        assert 0.8 < r["fwd / plain"] < 3 and 0.8 < r["bwd / plain"] < 3, r
