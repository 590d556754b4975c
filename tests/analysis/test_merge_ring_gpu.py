"""The merge and ring experiments on the kernels (quick sizes): the kernels' own parts and chunk pairs,
with the claims the twin's runs make (tests/analysis/test_experiments.py)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _rows(rep, title_start):
    from analysis.common import from_json_number

    t = next(t for t in rep.tables if t.title.startswith(title_start))
    return [dict(zip(t.columns, map(from_json_number, r))) for r in t.rows]


def test_merge_experiment_on_the_kernels(tmp_path):
    from analysis import merge
    from analysis.common import Context

    rep = merge.run_merge(Context.make("cuda", True, 0, str(tmp_path)))
    rows = _rows(rep, "Error of the merged output")
    def errs(state):
        return [r["error"] for r in rows
                if (r["arm"], r["running output"], r["form"]) == ("kernel parts", state, "exp")]

    kern, grows = errs("float32"), errs("bfloat16")
    assert len(kern) >= 4 and max(kern) < 1.5 * kern[0] and grows[-1] > 5 * grows[0]


def test_ring_experiment_on_the_kernels(tmp_path):
    from analysis import ring
    from analysis.common import Context

    rep = ring.run_ring(Context.make("cuda", True, 0, str(tmp_path)))
    rows = _rows(rep, "Error against float64 of the whole sequence")
    single = rows[0]
    for r in rows[1:]:
        if r["state and gradient dtype"] == "float32":
            assert all(r[n] <= 2 * single[n] for n in ("o", "dQ", "dK", "dV")), r
