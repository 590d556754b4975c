"""The decode experiment on the GPU (quick sizes): the report's structure, flashcupy's decoding outputs
(contiguous and paged caches) within the accuracy rule against float64, every peer that ran in agreement
with flashcupy, and the speed columns computed from the same run's numbers."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def _rows(doc, title_start):
    from analysis.common import from_json_number

    t = next(t for t in doc["tables"] if t["title"].startswith(title_start))
    return [dict(zip(t["columns"], map(from_json_number, r))) for r in t["rows"]]


def test_decode_experiment_on_the_kernels(tmp_path):
    from analysis import decode
    from analysis.common import Context, write_report

    ctx = Context.make("cuda", True, 0, str(tmp_path))
    rep = decode.run_decode(ctx)
    paths = write_report(ctx, rep, 0.0)
    assert set(paths) == {"json", "md", "png"}
    with open(paths["json"]) as f:
        doc = json.load(f)
    assert doc["name"] == "decode" and doc["meta"]["backend"] == "cuda"
    card = doc["meta"]["device"].split(" (")[0]
    assert card in doc["finding"] and card in (tmp_path / "decode.md").read_text()

    (copy,) = _rows(doc, "Copy bandwidth")
    assert 0.3 < copy["TB/s"] < 30 and copy["TB/s"] == pytest.approx(2 * copy["bytes copied"]
                                                                      / copy["device us"] / 1e6)
    cases = [tuple(c) for c in doc["data"]["cases"]]
    assert cases == decode.QUICK_CASES
    layouts = ["contiguous", "paged 64", "paged 256"]

    acc = _rows(doc, "Accuracy against float64")
    assert [(r["dtype"], r["B"], r["L"], r["layout"]) for r in acc] == \
        [(d, b, n, lay) for d in decode.DTYPES for b, n in cases for lay in layouts]
    for r in acc:
        assert r["within the rule"] is True and r["error / bound"] <= 1.0, r
        assert r["max abs error"] > 0 and r["entries checked"] == len({0, r["B"] - 1})
        assert r["max abs difference from the contiguous o"] <= 2 * r["rule bound"], r

    fc = _rows(doc, "flashcupy decoding steps")
    assert [(r["dtype"], r["B"], r["L"], r["layout"]) for r in fc] == \
        [(r["dtype"], r["B"], r["L"], r["layout"]) for r in acc]
    for r in fc:
        assert r["device us"] > 0 and r["host us"] > 0 and r["step us"] > 0
        kv = r["B"] * r["L"] * decode.HKV * decode.D * 2 * 2
        assert r["K+V MiB"] == pytest.approx(kv / 2 ** 20)
        assert r["TB/s"] == pytest.approx(kv / r["device us"] / 1e6)
        assert r["fraction of copy bandwidth"] == pytest.approx(r["TB/s"] / copy["TB/s"])
        assert 0 < r["fraction of copy bandwidth"] < 1.5, r
        base = next(c for c in fc if (c["dtype"], c["B"], c["L"], c["layout"])
                    == (r["dtype"], r["B"], r["L"], "contiguous"))
        assert r["layout / contiguous (time)"] == pytest.approx(r["device us"] / base["device us"])
        if r["best peer"] is not None:
            ratio = r["device us"] / r["best peer device us"]
            assert r["flashcupy / best peer (time)"] == pytest.approx(ratio)

    # the host's profile: once a layout, for the first dtype's first case; shares of one profiled time
    host = _rows(doc, "Host time of one flashcupy call")
    first = (decode.DTYPES[0], *cases[0])
    assert {(r["dtype"], r["B"], r["L"]) for r in host} == {first}
    for lay in layouts:
        mine = [r for r in host if r["layout"] == lay]
        assert 0 < len(mine) <= decode.HOST_TOP and mine[0]["profiled us per call"] > 0, lay
        assert all(0 < r["share of the profiled time"] <= 1 and r["own us per call"] > 0 for r in mine)
        assert sum(r["share of the profiled time"] for r in mine) <= 1 + 1e-9
        own = [r["own us per call"] for r in mine]
        assert own == sorted(own, reverse=True)

    from analysis import sdpa

    try:
        sdpa.load_torch()
    except Exception:
        assert not any(t["title"].startswith("Peers") for t in doc["tables"])
        return
    peers = _rows(doc, "Peers")
    names = [f"torch {s}" for s in decode.PEER_BACKENDS] + [decode.FLEX]
    assert [(r["dtype"], r["B"], r["L"], r["provider"]) for r in peers] == \
        [(d, b, n, p) for d in decode.DTYPES for b, n in cases for p in names]
    for r in peers:
        assert r["status"].startswith(("ok", "refused")), r   # no peer disagreed with flashcupy
        if r["status"].startswith("ok"):
            assert r["max abs difference from flashcupy"] <= r["agreement bound"], r
            assert r["device us"] > 0 and r["host us"] > 0
    # the math backend runs every case (with enable_gqa or repeated heads), so every case has a best peer
    assert all(r["status"].startswith("ok") for r in peers if r["provider"] == "torch math")
    assert all(r["best peer"] is not None for r in fc)
