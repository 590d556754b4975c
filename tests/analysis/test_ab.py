"""analysis.ab without a GPU: arms, cells and directions from the command line, the bitwise comparison,
and the table and Markdown of synthetic rows."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from analysis import ab
from tests.conftest import GPU_SKIP_REASON


def test_arms_parse_names_folders_and_defines(tmp_path):
    assert ab.parse_arm("base") == ab.Arm("base")
    tma = ab.parse_arm("tma:FC_BWD_STAGES=1, FC_X=0x10")
    assert tma.name == "tma" and tma.defines == (("FC_BWD_STAGES", 1), ("FC_X", 16))
    old = ab.parse_arm(f"old@{tmp_path}:FC_X=2")
    assert old.kernels_dir == str(tmp_path) and old.defines == (("FC_X", 2),)
    assert "FC_X=2" in old.describe() and str(tmp_path) in old.describe()
    assert ab.parse_arm("base").describe() == "the package's kernels"


@pytest.mark.parametrize("spec, match", [
    ("", "name"), (":FC_X=1", "name"), ("a b", "name"), ("x@", "folder"), ("x@/no/such/dir", "not a folder"),
    ("x:", "NAME=INT"), ("x:FC_X", "NAME=INT"), ("x:FC_X=one", "NAME=INT"), ("x:1FC=1", "C identifier"),
    ("x:FC_X=1,FC_X=2", "once"),
])
def test_bad_arms_are_refused_with_what_is_allowed(spec, match):
    with pytest.raises(ValueError, match=match):
        ab.parse_arm(spec)


def test_arms_need_two_distinct_names():
    with pytest.raises(ValueError, match="at least two"):
        ab.parse_arms(["base"])
    with pytest.raises(ValueError, match="differ"):
        ab.parse_arms(["a", "a:FC_X=1"])
    assert [a.name for a in ab.parse_arms(["a", "b:FC_X=1"])] == ["a", "b"]


def test_cells_and_directions():
    assert ab.parse_cells("f16:4096:128:0, bf16:1024:64:1") == [("f16", 4096, 128, False),
                                                                ("bf16", 1024, 64, True)]
    for bad in ("f16:4096:128", "f16:4096:128:2", "f8:4096:128:0", "f16:x:128:0", "f16:4096:128:0:1", ""):
        with pytest.raises(ValueError, match="--cells"):
            ab.parse_cells(bad)
    assert ab.parse_directions("bwd, bwd_det") == ["bwd", "bwd_det"]
    for bad in ("", "back", "fwd,dq"):
        with pytest.raises(ValueError, match="--directions"):
            ab.parse_directions(bad)


def test_compare_is_bitwise_and_sizes_a_difference(rng):
    o = rng.standard_normal((2, 3, 5, 8)).astype(np.float16)
    lse = rng.standard_normal((2, 3, 5)).astype(np.float32)
    base = {"o": o, "lse": lse}
    assert ab.compare(base, {"o": o.copy(), "lse": lse.copy()}, set()) == "equal"
    # one ulp in one element of o is reported, sized against the largest |o|
    o2 = o.copy()
    o2.view(np.uint16)[0, 0, 0, 0] += 1
    text = ab.compare(base, {"o": o2, "lse": lse}, set())
    assert text.startswith("o: ") and "lse" not in text
    rel = float(text.split(": ")[1])
    expect = abs(float(o2[0, 0, 0, 0]) - float(o[0, 0, 0, 0])) / float(np.abs(o.astype(np.float64)).max())
    assert rel == pytest.approx(expect, rel=0.01)
    # -0.0 against +0.0 is a different bit pattern
    z = np.zeros(4, np.float32)
    assert ab.compare({"x": z}, {"x": -z}, set()) == "x: 0"
    # an output the baseline does not repeat is marked
    assert ab.compare(base, {"o": o2, "lse": lse}, {"o"}).endswith("(varies)")
    nan = lse.copy()
    nan[0, 0, 0] = np.nan
    assert ab.compare(base, {"o": o, "lse": nan}, set()) == "lse: non-finite values differ"
    assert ab.repeat_varies(base, {"o": o2, "lse": lse}) == {"o"}
    assert ab.repeat_varies(base, base) == set()


def _rows():
    arms = [ab.Arm("base"), ab.Arm("tma", (("FC_BWD_STAGES", 1),))]
    rows = [{"dtype": "f16", "N": 4096, "D": 64, "causal": False, "direction": "bwd", "varies": ["dq"],
             "arms": {"base": {"tflops": [400.0, 410.0], "bits": "equal",
                               "compile": ["k", "prep/dkdvdq/conv", "28/168/17", "1/2/3", 0]},
                      "tma": {"tflops": [430.5, 420.0], "bits": "dq: 1e-07 (varies)",
                              "compile": ["k+FC_BWD_STAGES=1", "prep/dkdvdq/conv", "28/168/17", "1/2/3", 0]}},
             "peer": {"name": "cudnn", "tflops": [450.0, 455.0]}},
            {"dtype": "bf16", "N": 1024, "D": 128, "causal": True, "direction": "fwd", "varies": [],
             "arms": {"base": {"tflops": [300.0]}, "tma": {"tflops": [299.0], "bits": "equal"}}}]
    return arms, rows


def test_table_ratios_are_best_round_over_best_round():
    arms, rows = _rows()
    t = ab.table(rows, arms)
    first = dict(zip(t.columns, t.rows[0]))
    assert first["base TFLOP/s"] == "400.0, 410.0" and first["tma TFLOP/s"] == "430.5, 420.0"
    assert first["tma / base"] == f"{430.5 / 410.0:.3f}"
    assert first["tma bits"] == "dq: 1e-07 (varies)"
    assert first["cudnn TFLOP/s"] == "450.0, 455.0"
    assert first["base / cudnn"] == f"{410 / 455:.3f}" and first["tma / cudnn"] == f"{430.5 / 455:.3f}"
    assert first["tma regs (spill bytes)"] == "28/168/17 (0)"
    second = dict(zip(t.columns, t.rows[1]))
    assert second["tma / base"] == f"{299 / 300:.3f}" and second["causal"] == "yes"
    assert second["cudnn TFLOP/s"] == "n/a" and second["base regs (spill bytes)"] == "n/a"
    rows[1]["arms"]["tma"]["compile"] = ["k", "CompileError: no ptxas report", None, None, None]
    assert dict(zip(t.columns, ab.table(rows, arms).rows[1]))["tma regs (spill bytes)"] == (
        "CompileError: no ptxas report")


def test_render_names_arms_setup_and_results():
    arms, rows = _rows()
    args = {"cells": [("f16", 4096, 64, False)], "b": 4, "h": 32, "kernel": "wgmma", "directions": ["bwd"],
            "rounds": 2, "budget_s": 0.3}
    md = ab.render({"device": "NVIDIA H200", "git_commit": "abc", "seed": 0}, arms, rows, args)
    assert md.startswith("# A/B: tma against base")
    assert "**base** (baseline): the package's kernels" in md and "**tma**: FC_BWD_STAGES=1" in md
    assert "f16:4096:64:0" in md and "NVIDIA H200" in md and "| tma / base |" in md


@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="checks the message given where there is no GPU")
def test_main_refuses_to_run_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--arm", "a", "--arm", "b:FC_X=1"])
    assert "needs a CUDA device" in capsys.readouterr().err


def test_main_refuses_bad_arguments_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--arm", "a"])
    assert "at least two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--arm", "a", "--arm", "b", "--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_a_define_no_kernel_reads_is_named(tmp_path):
    """A typo in a define builds the baseline's code: the arm says so."""
    arm = ab.parse_arm("typo:FC_WG_PINGPONK=0,FC_WG_PINGPONG=0")
    assert arm.unread_defines() == ["FC_WG_PINGPONK"]
    assert "FC_WG_PINGPONK=0 (read by no file of its kernels;" in arm.describe()
    assert "FC_WG_PINGPONG=0 (" not in arm.describe()
    (tmp_path / "k.cu").write_text("#if FC_ONLY_HERE\n#endif\n")
    assert ab.parse_arm(f"x@{tmp_path}:FC_ONLY_HERE=1").unread_defines() == []


@pytest.mark.cupy
def test_measure_records_an_arm_that_cannot_build_and_rotates_the_first_arm(monkeypatch):
    """measure() with the device faked (no GPU here): an arm whose build is refused is recorded for the
    cell and left out of the timing, the others run in every round with the first arm rotating, each
    row is handed to on_row, and the bits compare each arm with the baseline."""
    import cupy

    from flashcupy.inspect import current_build

    order, seen = [], []

    def defines():
        b = current_build()
        return dict(b.defines) if b else {}

    class FakeCell:
        def timed(self, fn, sets, direction):
            order.append(defines().get("FC_ARM", 0))
            return {"tflops": 100.0 + order[-1]}

    class FakeRun:
        def __init__(self, ctx, timer, cell, b, h, kernel, l2):
            self.c, self.cell = FakeCell(), cell

        def call(self, direction):
            def fn(s):
                if defines().get("FC_BAD"):
                    raise ValueError("needs 300000 bytes of shared memory")
                return {"o": np.full(4, 1.0 + defines().get("FC_ARM", 0) % 2, np.float32)}
            return fn, [None]

        def variant_row(self, direction):
            return ["key", "k", "168", "1000", 0]

    class FakeDevice:
        attributes = {"L2CacheSize": 50 << 20}

    monkeypatch.setattr(ab, "_CellRun", FakeRun)
    monkeypatch.setattr(ab, "_host", lambda outs: outs)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: FakeDevice())
    pool = SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: pool)
    arms = [ab.Arm("a", (("FC_ARM", 0),)), ab.Arm("b", (("FC_ARM", 2),)), ab.Arm("c", (("FC_ARM", 1),)),
            ab.Arm("bad", (("FC_BAD", 1),))]
    ctx = SimpleNamespace(backend="cuda", sync=lambda: None)
    rows = ab.measure(ctx, arms, [("f16", 256, 64, False)], ["fwd", "bwd"], b=1, h=1, kernel="wgmma",
                      rounds=3, peer=None, budget_s=0.01, compile_reports=True,
                      on_row=lambda r: seen.append(len(r)))
    assert seen == [1, 2] and len(rows) == 2
    row = rows[0]["arms"]
    assert row["bad"]["tflops"] == [] and row["bad"]["error"].startswith("ValueError: needs 300000 bytes")
    assert row["a"]["tflops"] == [100.0] * 3 and row["b"]["tflops"] == [102.0] * 3
    assert row["b"]["bits"] == "equal" and row["c"]["bits"].startswith("o: ")
    assert row["c"]["compile"] == ["key", "k", "168", "1000", 0]
    assert order[:9] == [0, 2, 1, 2, 1, 0, 1, 0, 2]  # round r starts at arm r (the refused arm skipped)
    t = ab.table(rows, arms)
    first = dict(zip(t.columns, t.rows[0]))
    assert first["bad TFLOP/s"].startswith("error: ValueError") and first["bad / a"] == "n/a"
    assert first["b / a"] == "1.020" and first["bad regs (spill bytes)"] == "n/a"


def test_figure_draws_each_arm_against_the_baseline(tmp_path):
    arms, rows = _rows()
    rows[1]["arms"]["tma"] = {"tflops": [], "error": "ValueError: refused"}  # an arm a cell could not build
    fig = ab.figure(rows, arms)
    (ax,) = fig.axes
    heights = [b.get_height() for c in ax.containers for b in c]
    assert heights[0] == pytest.approx(430.5 / 410.0) and heights[1] != heights[1]  # NaN for the refusal
    fig.savefig(tmp_path / "ab.png")
    assert (tmp_path / "ab.png").stat().st_size > 1000
    assert ab.figure([], arms) is None


def test_clock_samples_parse_and_summarize_per_window():
    from analysis import clocks

    lines = ["2026/11/26 12:57:01.100, 1980, 650.25, 61", "2026/11/26 12:57:01.150, 1755, 700.00, 63",
             "2026/11/26 12:57:01.200, [N/A], 700.00, 63", "timestamp, clocks.sm [MHz], power.draw [W]", ""]
    parsed = [clocks.parse_line(x) for x in lines]
    assert parsed[2:] == [None, None, None]
    (t0, mhz0, w0, c0), (t1, mhz1, _, c1) = parsed[:2]
    assert (mhz0, w0, c0, mhz1, c1) == (1980.0, 650.25, 61.0, 1755.0, 63.0)
    assert abs((t1 - t0) - 0.05) < 1e-6
    both = clocks.summarize(parsed[:2], t0, t1)
    assert both == {"mhz": (1980 + 1755) / 2, "w": (650.25 + 700) / 2, "c": 63.0, "n": 2}
    assert clocks.summarize(parsed[:2], t0 + 0.01, t1 + 1) == {"mhz": 1755.0, "w": 700.0, "c": 63.0, "n": 1}
    assert clocks.summarize(parsed[:2], t1 + 0.01, t1 + 1) == {"mhz": None, "w": None, "c": None, "n": 0}


@pytest.mark.cupy
@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="fakes the device, which a GPU machine has")
def test_measure_samples_the_clock_of_each_timing_and_the_table_divides_by_it(monkeypatch):
    """With a sampler, each round of each arm and of the peer gets the samples taken while it ran (here
    a fake sampler whose clock depends on the arm that runs), and clock_table gives work per cycle: an
    arm 10% faster at a 10% higher clock does the same work per cycle."""
    import time

    import cupy

    from flashcupy.inspect import current_build

    samples = []

    def arm_id():
        b = current_build()
        return dict(b.defines).get("FC_ARM", 0) if b else -1

    class FakeCell:
        def timed(self, fn, sets, direction):
            i = arm_id()
            mhz = {0: 1600.0, 1: 1760.0, -1: 1500.0}[i]
            samples.extend((time.time(), mhz, 600.0 + i, 60.0) for _ in range(3))
            return {"tflops": {0: 400.0, 1: 440.0, -1: 450.0}[i]}

    class FakeRun:
        def __init__(self, *a):
            self.c = FakeCell()

        def call(self, direction):
            return (lambda s: {"o": np.ones(2, np.float32)}), [None]

    class FakeSampler:
        def samples(self):
            return list(samples)

    monkeypatch.setattr(ab, "_CellRun", FakeRun)
    monkeypatch.setattr(ab, "_host", lambda outs: outs)
    monkeypatch.setattr(ab, "_peer_call", lambda torch, peer, run, direction: (lambda s: None, [None]))
    monkeypatch.setattr(ab.sdpa, "load_torch", lambda: object())
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: SimpleNamespace(attributes={}))
    pool = SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: pool)
    arms = [ab.Arm("a", (("FC_ARM", 0),)), ab.Arm("b", (("FC_ARM", 1),))]
    ctx = SimpleNamespace(backend="cuda", sync=lambda: None)
    rows = ab.measure(ctx, arms, [("f16", 256, 64, False)], ["fwd"], b=1, h=1, kernel="wgmma", rounds=2,
                      peer="cudnn", budget_s=0.01, compile_reports=False, sampler=FakeSampler())
    r = rows[0]
    assert [c["mhz"] for c in r["arms"]["a"]["clocks"]] == [1600.0, 1600.0]
    assert [c["n"] for c in r["arms"]["b"]["clocks"]] == [3, 3] and r["arms"]["b"]["clocks"][0]["w"] == 601.0
    assert [c["mhz"] for c in r["peer"]["clocks"]] == [1500.0, 1500.0]
    t = ab.clock_table(rows, arms)
    line = dict(zip(t.columns, t.rows[0]))
    assert line["b MHz"] == 1760.0 and line["cudnn TFLOP/s"] == "450.0"
    assert line["b / a per clock"] == "1.000"
    assert line["a / cudnn per clock"] == f"{(400 / 1600) / (450 / 1500):.3f}"
    assert "## Clocks" in ab.render({}, arms, rows, {"cells": [("f16", 256, 64, False)], "b": 1, "h": 1,
                                                     "kernel": "wgmma", "directions": ["fwd"], "rounds": 2,
                                                     "budget_s": 0.01})
    assert ab.clock_table([dict(r, arms={k: {"tflops": [1.0]} for k in r["arms"]}, peer={})], arms) is None


def _fake_smi(tmp_path, monkeypatch, body: str):
    """An nvidia-smi on PATH that runs ``body`` (sh) for the sampling call and answers the power probes:
    power.draw.instant unknown (exit 2), power.draw known."""
    exe = tmp_path / "nvidia-smi"
    exe.write_text('#!/bin/sh\ncase "$1" in\n  --query-gpu=power.draw.instant) exit 2;;\n'
                   '  --query-gpu=power.draw) echo "300.00 W"; exit 0;;\nesac\n' + body)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_the_sampler_reads_whole_lines_and_falls_back_to_the_average_power(tmp_path, monkeypatch):
    import time

    from analysis import clocks

    lines = "2026/11/26 12:00:00.000, 1980, 650.5, 60\\n2026/11/26 12:00:00.050, 1755, 700.0, 61\\n"
    _fake_smi(tmp_path, monkeypatch, f'printf "{lines}2026/11/26 12:00:0"\nsleep 5\n')
    s = clocks.Sampler("00000000:19:00.0")
    try:
        assert s.power == "power.draw"
        deadline = time.time() + 5
        while len(s.samples()) < 2 and time.time() < deadline:
            time.sleep(0.01)
        got = s.samples()  # the third line is cut off: not a sample
        assert [x[1:] for x in got] == [(1980.0, 650.5, 60.0), (1755.0, 700.0, 61.0)]
    finally:
        s.close()
    assert not os.path.exists(s._out.name)


def test_a_sampler_whose_nvidia_smi_stopped_says_why(tmp_path, monkeypatch):
    import time

    from analysis import clocks

    _fake_smi(tmp_path, monkeypatch, 'echo "No devices were found" >&2\nexit 6\n')
    s = clocks.Sampler("00000000:19:00.0")
    try:
        s._proc.wait(timeout=5)
        time.sleep(0.01)
        with pytest.raises(RuntimeError, match=r"exit 6\): No devices were found"):
            s.samples()
    finally:
        s.close()
