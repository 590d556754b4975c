"""analysis.ab on the GPU: each arm runs its own build (a define that changes nothing keeps the bits, one
that breaks the algorithm is reported as a difference), the reports name each arm's variant, and the
modules carry the defines they were compiled with."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def _run(tmp_path, kernel, directions, *extra):
    from analysis import ab

    argv = ["--arm", "base", "--arm", "noop:FC_AB_NOOP=1", "--arm", "norescale:FC_ABLATE_RESCALING=1",
            "--cells", "f16:256:64:0", "--directions", directions, "--kernel", kernel, "--rounds", "2",
            "--b", "1", "--h", "2", "--budget", "0.02", "--out", str(tmp_path), "--name", "t", *extra]
    assert ab.main(argv) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.md").read_text().startswith("# A/B: noop, norescale against base")
    return {r["direction"]: r for r in data["rows"]}


def test_ab_arms_run_their_own_builds(tmp_path):
    from flashcupy import _compile, _variant

    rows = _run(tmp_path, "mma", "fwd,bwd_det")
    for row in rows.values():
        for arm in ("base", "noop", "norescale"):
            assert len(row["arms"][arm]["tflops"]) == 2 and min(row["arms"][arm]["tflops"]) > 0
        assert row["arms"]["noop"]["bits"] == "equal"
        assert row["arms"]["noop"]["compile"][0].endswith("+FC_AB_NOOP=1")
        assert not row["arms"]["base"]["compile"][0].count("+")
    # 256 keys are several key tiles: without rescaling o is wrong, and the tool says so
    assert rows["fwd"]["arms"]["norescale"]["bits"].startswith("o: ")
    assert rows["bwd_det"]["varies"] == []  # the deterministic backward repeats itself
    builds = [v.build for v, _ in _compile._MODULES if v.build is not None]
    assert _variant.Build((("FC_ABLATE_RESCALING", 1),)) in builds
    noop = next(v for v, _ in _compile._MODULES if v.build == _variant.Build((("FC_AB_NOOP", 1),)))
    assert _compile.get_kernel(noop).defines["FC_AB_NOOP"] == 1


def test_ab_on_the_hopper_family(tmp_path):
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma family needs compute capability 9.0")
    rows = _run(tmp_path, "wgmma", "fwd,bwd", "--no-compile", "--clocks", "--budget", "0.2")
    for row in rows.values():  # each round's window (0.2 s or more of calls) holds samples of a running SM
        for res in row["arms"].values():
            assert len(res["clocks"]) == len(res["tflops"]) == 2
            assert all(c["n"] >= 1 and c["mhz"] > 0 for c in res["clocks"]), res["clocks"]
    assert rows["fwd"]["arms"]["noop"]["bits"] == "equal"
    assert rows["fwd"]["arms"]["norescale"]["bits"] != "equal"
    # dk and dv are one CTA's sums in a fixed order: equal whatever dq's atomic order did
    bits = rows["bwd"]["arms"]["noop"]["bits"]
    assert bits == "equal" or (bits.startswith("dq: ") and "dk" not in bits and "dv" not in bits)
    assert "compile" not in rows["bwd"]["arms"]["base"]


def test_the_clock_sampler_sees_the_gpu_work():
    """analysis.clocks on the device: a window of half a second of matrix products holds samples of a
    running SM clock and a power draw, within the card's own limits."""
    import subprocess
    import time

    import cupy

    from analysis import clocks

    query = ["nvidia-smi", "--query-gpu=clocks.max.sm,power.limit", "--format=csv,noheader,nounits",
             f"--id={cupy.cuda.Device().pci_bus_id}"]
    limits = subprocess.run(query, capture_output=True, text=True, check=True)
    max_mhz, max_w = (float(x) for x in limits.stdout.split(","))
    sampler = clocks.for_current_device(period_ms=20)
    try:
        a0 = cupy.random.default_rng(0).standard_normal((4096, 4096), dtype=cupy.float32)
        t0 = time.time()
        while time.time() - t0 < 0.5:
            b = a0 @ a0  # the same product each time: no values run off to inf or zero
            cupy.cuda.Device().synchronize()
        t1 = time.time()
        time.sleep(0.1)
        got = sampler.window(t0, t1)
    finally:
        sampler.close()
    assert float(cupy.abs(b).max()) > 0
    # a window misplaced in time (a misread time stamp) or another card's samples would hold none, or the
    # idle clock (a few hundred MHz on these cards, against over a thousand under load)
    assert got["n"] >= 5, got
    assert 0.5 * max_mhz < got["mhz"] <= max_mhz and 0 < got["w"] <= 1.2 * max_w and got["c"] > 0, got
