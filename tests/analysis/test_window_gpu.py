"""The window experiment on the GPU (quick sizes): the kernels' error rows within the accuracy rule, and
the cost table, whose times must fall with the window (a window of 256 keys at N = 4096 runs well under
the causal kernel's time)."""
from __future__ import annotations

import pytest

from flashcupy.accuracy import FACTOR

pytestmark = pytest.mark.gpu


def test_window_experiment_on_the_kernels(tmp_path):
    from analysis import window
    from analysis.common import Context, from_json_number, write_report

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rep = window.run_window(ctx)
    write_report(ctx, rep, 0.0)
    assert (tmp_path / "window.png").exists()
    err, cost = ([dict(zip(t.columns, map(from_json_number, r))) for r in t.rows] for t in rep.tables)
    for r in err:
        if r["accum"] == "fp32":
            assert r["o / naive"] <= FACTOR["fwd"], r
            assert max(r["dQ / naive"], r["dK / naive"], r["dV / naive"]) <= FACTOR["bwd"], r
    causal = cost[0]
    assert causal["window w"] == "causal" and causal["fwd / causal"] == 1.0
    w256 = next(r for r in cost if r["window w"] == 256)
    assert w256["visible / causal"] < 0.15
    assert w256["fwd / causal"] < 0.4 and w256["bwd / causal"] < 0.4, w256
