"""The sinks experiment on the GPU (quick sizes): the merge order runs on the 16-bit kernels and the fp8
kernel, and the findings hold there as on the twin."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_sinks_experiment_on_the_kernels(tmp_path):
    from analysis import sinks
    from analysis.common import Context, from_json_number, write_report
    from tests.helpers import assert_sinks_findings

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rep = sinks.run_sinks(ctx)
    write_report(ctx, rep, 0.0)
    assert (tmp_path / "sinks.png").exists()
    fwd, bwd = ([dict(zip(t.columns, map(from_json_number, r))) for r in t.rows] for t in rep.tables)
    assert_sinks_findings(fwd, bwd)
