"""Every experiment in --quick mode on the NumPy backend (one `all` run, shared by the tests below),
asserting on what each one found, plus the report plumbing: files, index, JSON == Markdown."""
from __future__ import annotations

import json
import math
import os

import pytest

from analysis import EXPERIMENTS
from analysis.__main__ import main
from analysis.common import fmt, from_json_number
from flashcupy.accuracy import F32_NEAR_FLOAT64, FACTOR, tolerance
from tests.helpers import LN_MAX


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    rc = main(["all", "--backend", "numpy", "--quick", "--out", str(out), "--seed", "7"])
    assert rc == 0
    docs = {}
    for name in EXPERIMENTS:
        with open(out / f"{name}.json") as f:
            docs[name] = json.load(f)
    return out, docs


def table(doc, title_start):
    for t in doc["tables"]:
        if t["title"].startswith(title_start):
            return [dict(zip(t["columns"], (from_json_number(c) for c in r))) for r in t["rows"]]
    raise KeyError(title_start)


def md_tables(text):
    """{title: rows of cell strings} parsed back from a report's Markdown."""
    out, lines, i = {}, text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("**") and lines[i].endswith("**") and i + 2 < len(lines) \
                and lines[i + 2].startswith("| "):
            title, rows, j = lines[i].strip("*"), [], i + 4
            while j < len(lines) and lines[j].startswith("| "):
                rows.append([c.strip() for c in lines[j].strip()[1:-1].split(" | ")])
                j += 1
            out[title] = rows
            i = j
        else:
            i += 1
    return out


def test_all_writes_every_report_and_the_index(reports):
    out, docs = reports
    index = (out / "index.md").read_text()
    for name in EXPERIMENTS:
        for ext in ("json", "md", "png"):
            path = out / f"{name}.{ext}"
            assert path.exists() and path.stat().st_size > 0, path
            assert f"({name}.{ext})" in index
        meta = docs[name]["meta"]
        assert meta["seed"] == 7 and meta["backend"] == "numpy" and meta["quick"]
        assert meta["device"].startswith("CPU (NumPy twin")
        assert meta["versions"]["numpy"] and "cupy" in meta["versions"]
        md = (out / f"{name}.md").read_text()
        for needle in ("**Finding:**", "- device: CPU (NumPy twin", "- seed: 7", "- git commit:",
                       "- versions:", "## Setup", "quick"):
            assert needle in md, (name, needle)
        assert docs[name]["finding"] in md


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_json_holds_the_numbers_the_markdown_shows(reports, name):
    out, docs = reports
    shown = md_tables((out / f"{name}.md").read_text())
    assert docs[name]["tables"]
    for t in docs[name]["tables"]:
        rows = shown[t["title"]]
        assert len(rows) == len(t["rows"])
        for md_row, js_row in zip(rows, t["rows"]):
            assert md_row == [fmt(from_json_number(c)) for c in js_row]


def test_overflow_at_the_predicted_threshold_and_tile(reports):
    doc = reports[1]["overflow"]
    summary = table(doc, "Onset")
    assert len(summary) >= 5
    for r in summary:
        thr = r["predicted threshold"]
        expected = LN_MAX["f16" if r["accum"] == "fp16" else r["dtype"]]
        assert abs(thr - expected) < 0.01
        # breaks at the threshold (or just below it, where several large terms overflow the running sum)
        assert thr - 1.0 <= r["first broken max score"] <= thr + 0.11, r
        assert r["last clean max score"] < thr
        pred = r["first overflow tile (float64 model)"]
        meas = r["first overflow tile (kernel, prefix bisection)"]
        assert pred is not None and meas is not None and abs(pred - meas) <= 1, r
        assert r["intact finite"] is True and r["intact max abs err"] < 1e-2
    sweep = doc["data"]["sweep"]
    groups = {}
    for p in sweep:
        groups.setdefault((p["dtype"], p["accum"], p["N"]), []).append(p)
        if p["max_score"] < p["threshold"] - 1.5:
            assert p["frac_broken"] == 0
        assert p["intact_nonfinite"] == 0
    for pts in groups.values():
        fr = [p["frac_broken"] for p in sorted(pts, key=lambda p: p["max_score"])]
        assert fr == sorted(fr) and fr[-1] > fr[0]          # more rows break as the scores grow
    # the float64 model of the broken kernel predicts which rows break
    agree = sum(abs(p["frac_broken"] - p["frac_predicted"]) * p["rows"] < 0.5 for p in sweep)
    assert agree >= 0.9 * len(sweep)


def test_rescaling_wrong_with_two_tiles_exact_with_one(reports):
    rows = table(reports[1]["rescaling"], "Error against float64")
    for r in rows:
        assert math.isfinite(r["max abs error (broken)"])
        if r["KV tiles"] >= 2:
            assert r["max abs error (broken)"] > 1e-2, r
        elif r["dtype"] == "f32":
            assert r["max abs error (broken)"] < F32_NEAR_FLOAT64["fwd"], r
    claim = table(reports[1]["rescaling"], "The tutorial's setup")
    assert len(claim) == 5 and all(r["max abs error (broken)"] > 0.1 for r in claim)
    f = reports[1]["rescaling"]["finding"]
    assert "held" in f or "did not hold" in f


def test_blocks_cover_every_forward_family_within_the_accuracy_rule(reports):
    from flashcupy._families import FAMILIES

    doc = reports[1]["blocks"]
    rows = table(doc, "Every supported tile size")
    naive = {r["dtype"]: r["max abs error"] for r in table(doc, "Naive")}
    assert {r["family"] for r in rows} == {name for name, f in FAMILIES.items() if f.direction == "fwd"}
    assert len(rows) > 50
    for r in rows:
        if r["accum"] == "fp32":
            assert r["max abs error"] <= tolerance(r["dtype"], "fp32", naive[r["dtype"]]), r
    assert "Golden" in doc["finding"] and ("held" in doc["finding"] or "did not hold" in doc["finding"])


def test_fp16_accumulators_are_worse(reports):
    rows = table(reports[1]["accum"], "Error against float64")
    assert len({r["N"] for r in rows}) >= 4
    for r in rows:
        assert r["RMSE (fp16 acc)"] > r["RMSE (fp32 acc)"], r
        assert r["max abs (fp16 acc)"] > r["max abs (fp32 acc)"], r


def test_outliers_table_beside_the_paper(reports):
    doc = reports[1]["outliers"]
    rows = table(doc, "Measured")
    assert len(rows) == 6 and all(0 < r["RMSE"] < 1e-2 for r in rows)
    assert "N=" in doc["finding"] and "D=" in doc["finding"]
    pub = table(doc, "Published")
    assert {r["RMSE"] for r in pub} == {3.2e-4, 1.9e-4}


def test_no_softmax_row_over_the_bhh_bound(reports):
    rows = table(reports[1]["bounds"], "Per (dtype, accum, q scale)")
    assert len(rows) >= 6
    for r in rows:
        assert r["rows over bound"] == 0, r
        assert 0 < r["max"] < r["bound min"]


def test_backward_measured_against_the_naive_backward(reports):
    doc = reports[1]["backward"]
    naive = table(doc, "Naive")
    assert all(0 < r["dQ max abs"] < 1 for r in naive)
    rows = table(doc, "flashcupy.attention_backward")
    assert rows
    for r in rows:
        if r["accum"] == "fp32":
            assert max(r["dQ / naive"], r["dK / naive"], r["dV / naive"]) <= FACTOR["bwd"], r


def test_memory_naive_quadratic_flashcupy_linear(reports):
    doc = reports[1]["memory"]
    assert 1.7 < doc["data"]["slope_naive"] < 2.2
    assert 0.7 < doc["data"]["slope_flashcupy"] < 1.3
    assert "tracemalloc" in doc["setup"]["measured"]


def test_drift_positive_and_larger_with_fp16_accumulators(reports):
    rows = table(reports[1]["drift"], "Wasserstein")
    assert all(0 < r["W1 distance"] < 1e-2 for r in rows)
    w = {(r["method"], r["dtype"], r["accum"]): r["W1 distance"] for r in rows}
    assert w[("flashcupy", "f16", "fp16")] > w[("flashcupy", "f16", "fp32")]


def test_bench_tiny_config_positive_numbers(reports):
    doc = reports[1]["bench"]
    rows = table(doc, "TFLOP/s")
    assert rows and {r["direction"] for r in rows} == {"fwd", "bwd"}
    for r in rows:
        assert r["flashcupy mma TFLOP/s"] > 0 and r["naive TFLOP/s"] > 0
        assert r["mma / naive"] == pytest.approx(r["flashcupy mma TFLOP/s"] / r["naive TFLOP/s"], rel=1e-9)
    assert "meaningless" in doc["finding"] or "mean nothing" in doc["finding"]


def test_default_output_folders(tmp_path, monkeypatch):
    """From any directory, a checkout's experiments write into the checkout's reports/ (quick runs into
    reports/quick/), and create nothing where they were started."""
    from analysis.common import Context

    repo_reports = os.path.join(os.path.dirname(__file__), "..", "..", "reports")
    monkeypatch.chdir(tmp_path)
    assert os.path.samefile(Context.make("numpy", True).out, os.path.join(repo_reports, "quick"))
    ctx = Context.make("numpy", False)   # the NumPy backend forces the quick sizes (and says so)
    assert ctx.quick and ctx.forced_quick and os.path.samefile(ctx.out, os.path.join(repo_reports, "quick"))
    assert os.listdir(tmp_path) == []


def test_an_experiments_help_describes_it(capsys):
    """``python -m analysis overflow --help``: the experiment's own description and the options, not
    the general listing."""
    from analysis import EXPERIMENTS
    from analysis.__main__ import main

    assert main(["overflow", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("python -m analysis overflow") and EXPERIMENTS["overflow"][2] in text
    assert "--backend" in text and "rescaling  " not in text


def test_fp8_arms_lose_to_fp16_and_single_level_accumulation_grows_with_n(reports):
    doc = reports[1]["fp8"]
    arms = table(doc, "Arms against float64")
    for dist in {r["inputs"] for r in arms}:
        ref = max(r["RMSE"] for r in arms if r["inputs"] == dist and r["method"].startswith("f16"))
        fp8_rows = [r for r in arms if r["inputs"] == dist and r["method"].startswith("e4m3")]
        assert len(fp8_rows) == 24 and all(r["RMSE"] > ref for r in fp8_rows)
    sweep = [r for r in table(doc, "Error against N") if r["v mean"] == 1.0]
    assert sweep[-1]["single-level accumulation"] > 3 * sweep[-1]["two-level accumulation"]
    assert sweep[-1]["single-level accumulation"] > sweep[0]["single-level accumulation"]


def test_bench_fp8_rows_per_head_dim():
    """The bench's fp8 table from raw rows (no GPU): one row per forward cell where the fp8 kernel ran, its
    head dim, no two-level column at D=256 (that accumulation runs at D=128 only), ratios from the row."""
    from analysis.bench import FP8_PROVIDERS, HOPPER, _fp8_rows

    one, two = FP8_PROVIDERS

    def raw(d, direction, fp8, fp8_two, wgmma, cudnn):
        return {"dtype": "f16", "N": 4096, "D": d, "causal": False, "direction": direction,
                one: {"tflops": fp8} if fp8 else {"error": "x"}, two: {"tflops": fp8_two} if fp8_two else {},
                HOPPER: {"tflops": wgmma}, "torch cudnn": {"tflops": cudnn}}

    rows = _fp8_rows([raw(128, "fwd", 800.0, 700.0, 640.0, 660.0),
                      raw(256, "fwd", 1000.0, None, 680.0, 700.0),
                      raw(128, "bwd", 800.0, 700.0, 500.0, 550.0),
                      raw(64, "fwd", None, None, 500.0, 480.0)])
    assert [r[:4] for r in rows] == [["f16", 4096, 128, False], ["f16", 4096, 256, False]]
    assert rows[0][4:] == [800.0, 700.0, 640.0, 800.0 / 640.0, 700.0 / 640.0, 660.0, 800.0 / 660.0]
    assert rows[1][5] is None and rows[1][8] is None and rows[1][7] == 1000.0 / 680.0


def test_window_error_within_the_rule_at_every_width(reports):
    """The window experiment measures every (dtype, accumulator) at every width, narrowest first, the
    visible keys per row growing with the width, and with fp32 accumulators within the accuracy rule."""
    rows = table(reports[1]["window"], "Error against float64 by window width")
    combos = {(r["dtype"], r["accum"]) for r in rows}
    assert len(combos) == 4 and len(rows) == 4 * 5
    for combo in combos:
        keys = [r["visible keys per row"] for r in rows if (r["dtype"], r["accum"]) == combo]
        assert keys == sorted(keys) and keys[0] < 6
    for r in rows:
        assert r["o max abs"] > 0 and r["naive o max abs"] > 0
        if r["accum"] == "fp32":
            assert r["o / naive"] <= FACTOR["fwd"], r
            assert max(r["dQ / naive"], r["dK / naive"], r["dV / naive"]) <= FACTOR["bwd"], r


def test_merge_error_follows_the_running_outputs_dtype(reports):
    """Parts stored in bf16 and merged in float32 keep their error as S grows (the roundings average);
    a running output held in bf16 grows with S; the float32 merge stays near float32 roundoff; without
    the max subtraction the merge returns NaN once the LSEs pass ln(float32 max)."""
    rows = table(reports[1]["merge"], "Error of the merged output")

    def errs(arm, dtype, state, form="exp"):
        return [r["error"] for r in rows if (r["arm"], r["parts dtype"], r["running output"], r["form"])
                == (arm, dtype, state, form)]

    flat, grows, f32 = (errs("exact parts", "bf16", "float32"), errs("exact parts", "bf16", "bfloat16"),
                        errs("exact parts", "f32", "float32"))
    assert len(flat) == len(grows) >= 4
    assert max(flat) < 1.5 * flat[0] and grows[-1] > 5 * grows[0]
    assert max(f32) < 1e-5
    for state in ("float32", "bfloat16"):
        for a, b in zip(errs("exact parts", "bf16", state), errs("exact parts", "bf16", state, "logsigmoid")):
            assert abs(a - b) <= 0.5 * max(a, b)
    breaks = table(reports[1]["merge"], "The merge without the max subtraction")
    assert breaks[0]["NaN rows (no max)"] == 0 and breaks[-1]["NaN rows (no max)"] > 0.9
    assert all(r["intact max abs error"] < 1e-4 for r in breaks)


def test_ring_error_grows_with_ranks_only_with_a_bf16_state(reports):
    """The simulated ring: with float32 running output and gradients every error stays within 2x the
    single call's at every rank count; held in bf16 the errors grow with the ranks, the gradients past
    2x the single call's at the most ranks."""
    rows = table(reports[1]["ring"], "Error against float64 of the whole sequence")
    single = next(r for r in rows if r["ranks"] == "single call")
    names = ("o", "dQ", "dK", "dV")
    f32 = [r for r in rows if r["state and gradient dtype"] == "float32"]
    bf = [r for r in rows if r["state and gradient dtype"] == "bfloat16"]
    assert len(f32) == len(bf) >= 4
    for r in f32:
        assert all(r[n] <= 2 * single[n] for n in names), r
    assert max(bf[-1][n] / single[n] for n in ("dQ", "dK", "dV")) > 2
    assert bf[-1]["o"] > bf[0]["o"]
    # the fold without its stable softplus: past a gap of 88.72 the LSE overflows to inf; o is unchanged,
    # dV (the sink key's, from rows whose recomputed P is then 0) breaks; the stable form never overflows
    breaks = table(reports[1]["ring"], "The fold's LSE update without its stable form")
    stable = [r for r in breaks if r["LSE update"].startswith("stable")]
    broken = [r for r in breaks if r["LSE update"].startswith("log(1 + exp")]
    assert len(stable) == len(broken) >= 3
    assert all(r["rows with lse = inf"] == 0 and r["dV"] < 0.02 for r in stable), stable
    assert broken[0]["rows with lse = inf"] == 0 and broken[-1]["rows with lse = inf"] > 0
    assert broken[-1]["dV"] > 0.3 and all(a["o"] == b["o"] for a, b in zip(stable, broken))


def test_fp8_backward_study_prices_each_product(reports):
    """The model with every product on bf16 operands is the package's bf16 backward's accuracy (within
    1.5x); each product on fp8 operands costs more than it; dO and dS in e5m2 (2 mantissa bits) cost
    more than in e4m3 where they enter (dP, dV, dK, dQ) and the same where they do not (S)."""
    rows = table(reports[1]["fp8_backward"], "Gradient errors against float64")
    by = {(r["arm"], r["dO, dS format"], r["accumulation"]): r["worst / bf16"] for r in rows}
    assert by[("model, all bf16", "-", "-")] <= 1.5
    for p in ("S", "dP", "dV", "dK", "dQ"):
        for form in ("e4m3", "e5m2"):
            assert by[(f"{p} in fp8", form, "tc")] > 3, (p, form)
        if p != "S":
            assert by[(f"{p} in fp8", "e5m2", "tc")] > by[(f"{p} in fp8", "e4m3", "tc")]
        else:
            assert by[("S in fp8", "e5m2", "tc")] == pytest.approx(by[("S in fp8", "e4m3", "tc")])
    assert by[("all five in fp8", "e4m3", "tc")] > max(by[(f"{p} in fp8", "e4m3", "tc")]
                                                      for p in ("S", "dP", "dV", "dK", "dQ"))
    # the granularity study: every product and granularity priced; the slice rows are the arms above
    # with exact accumulation (the same model); no granularity, not even a scale per element (no range
    # effect at all), brings a product within 3x
    gran = {(r["arm"], r["scales per"]): r["worst / bf16"]
            for r in table(reports[1]["fp8_backward"], "Scale granularity")}
    assert len(gran) == 6 * 4
    for p in ("S", "dP", "dV", "dK", "dQ"):
        assert gran[(f"{p} in fp8", "slice")] == pytest.approx(by[(f"{p} in fp8", "e4m3", "exact")])
        assert min(gran[(f"{p} in fp8", g)] for g in ("tensor", "slice", "block64", "element")) > 3
    # stochastic rounding of dS: one draw is no better than round-to-nearest, the mean of draws is
    sr = {r["dS rounding"].split(",")[0] + ("" if r["draws averaged"] == 1 else " mean"): (r["dQ"], r["dK"])
          for r in table(reports[1]["fp8_backward"], "Stochastic rounding of dS")}
    assert min(sr["stochastic"]) > 0.9 * max(sr["round to nearest"])
    assert max(sr["stochastic mean"]) < min(sr["stochastic"])


def test_softcap_error_within_the_rule_at_every_cap(reports):
    """The softcap experiment measures every (dtype, accumulator) at every cap, smallest first, and with
    fp32 accumulators every cell lies within the accuracy rule (the package's bound, noise floor
    included: float32 inputs have a naive error at float32 roundoff too); the accurate-tanh columns are
    the CUDA backend's (NaN on the twin, whose tanh is NumPy's)."""
    rows = table(reports[1]["softcap"], "Error against float64 by cap")
    combos = {(r["dtype"], r["accum"]) for r in rows}
    assert len(combos) == 4 and len(rows) == 4 * 5
    for combo in combos:  # the control without a cap first, then the caps from 1 up
        caps = [r["cap"] for r in rows if (r["dtype"], r["accum"]) == combo]
        assert caps == sorted(caps) and caps[:2] == [0.0, 1.0]
    for r in rows:
        assert all(r[c] > 0 for c in ("o", "dQ", "dK", "dV"))
        assert math.isnan(r["o (accurate tanh)"]) and r["within the rule (accurate)"] is None
        if r["accum"] == "fp32":
            assert r["within the rule"] is True, r
    brk = table(reports[1]["softcap"], "The mask-order break on the twin")
    assert [r["cap"] for r in brk] == sorted(r["cap"] for r in brk)
    assert brk[0]["leaked, worst row"] > 0.5 and brk[-1]["leaked, worst row"] < 1e-4
    for r in brk:  # the leak is the predicted e^-c per masked key, to the float32 LSE's rounding
        assert r["|measured - predicted|, worst"] < 1e-4, r
    assert brk[0]["leaked, median of the first half of the rows (most masked keys)"] > \
        brk[0]["leaked, median of the second half"]
    # the fp8 forward at every cap, both accumulations: within e4m3's bound of float64, behind fp16 inputs
    # of the same values; relative to o, larger at a cap of 5 (a cap flattens P, and o's RMS falls)
    f8 = table(reports[1]["softcap"], "The fp8 (e4m3) forward by cap")
    assert len(f8) == 2 * 5 and {r["accumulation"] for r in f8} == {"single", "tile"}
    for r in f8:
        assert 0 < r["fp16 kernel, same values: relative RMS error"] < r["o relative RMS error"] < 0.05, r
    ctl = [r["o relative RMS error"] for r in f8 if r["cap"] == 0.0]
    assert max(r["o relative RMS error"] for r in f8 if r["cap"] == 5.0) > 1.5 * max(ctl)


def test_alibi_within_the_rule_and_far_rows_kept_by_measuring_from_key_0(reports):
    """The alibi experiment: every (dtype, accumulator) x case; 16-bit inputs with fp32 accumulators lie
    within the accuracy rule in every case, and fp16 accumulators too, rows far from their keys included,
    because the kernels measure those rows from key 0. Measured from i' (the twin's ``alibi_unshifted``)
    the far rows' error grows with the distance, in step with the fp16 rounding of the biased score
    (within 5x either way from d0 = 16); measured from key 0 it stays near the diagonal's."""
    doc = reports[1]["alibi"]
    rows = table(doc, "The accuracy rule with ALiBi")
    assert len(rows) == 4 * 4 and len({r["case"] for r in rows}) == 4
    for r in rows:
        assert all(r[c] > 0 for c in ("o", "dQ", "dK", "dV"))
        if r["dtype"] != "f32":
            assert r["within the rule"] is True, r
    far = table(doc, "Rows far from their keys")
    assert far[0]["d0"] == "[0, 1)" and len(far) >= 5
    unshifted = "fp16 accumulators, measured from i' (twin)"
    shifted = [r["fp16 accumulators"] for r in far]
    assert max(shifted) < 4 * shifted[0]
    assert max(r[unshifted] for r in far) > 3 * max(shifted) and far[-1][unshifted] > 5 * far[0][unshifted]
    f32 = [r["fp32 accumulators"] for r in far if r["rows"] >= 4]  # (a one-row bin can sit low by chance)
    assert max(f32) < 3 * min(f32)
    rounding = "fp16 rounding of the score measured from i', steepest head (logit units)"
    for r in far:
        if int(r["d0"].split(",")[0][1:]) >= 16:
            assert 0.2 < r[unshifted] / r[rounding] < 5, r


def test_sinks_collapse_p_only_when_they_start_the_softmax(reports):
    """The sinks experiment: at delta = 8 the sink-first order (the twin) collapses fp16 and e4m3 P, the
    merge after the loop (the kernels' order) does not; bf16 holds either way (``assert_sinks_findings``)."""
    from tests.helpers import assert_sinks_findings

    doc = reports[1]["sinks"]
    assert_sinks_findings(table(doc, "Forward: relative error of o"), table(doc, "Backward (merge order"))


def test_decode_twin_paths_within_the_rule(reports):
    """The decode experiment on the NumPy backend: the twin's decoding calls, contiguous and paged (pages of
    64 and 256 tokens, shuffled), every entry within the accuracy rule against float64, and the paged
    outputs the contiguous ones' bits; no speed table (the timing is the CUDA backend's)."""
    from analysis import decode

    doc = reports[1]["decode"]
    rows = table(doc, "Accuracy against float64")
    assert [(r["dtype"], r["B"], r["L"], r["layout"]) for r in rows] == \
        [(d, b, n, lay) for d in decode.DTYPES for b, n in decode.TWIN_CASES
         for lay in ("contiguous", "paged 64", "paged 256")]
    for r in rows:
        assert r["entries checked"] == r["B"] and 0 < r["max abs error"] <= r["rule bound"], r
        assert r["within the rule"] is True and r["max abs difference from the contiguous o"] == 0
    assert [t["title"] for t in doc["tables"]] == [t["title"] for t in doc["tables"]
                                                   if t["title"].startswith("Accuracy")]
    assert "CUDA backend only" in doc["finding"]


def test_decode_tables_from_measurements(tmp_path):
    """The CUDA side's tables, finding and figure from measurements made up here (no GPU): the best peer is
    the fastest that agreed, the ratios are of this run's times, a wrong or refused peer is not timed."""
    from types import SimpleNamespace

    from analysis import decode

    def fc(layout, us):
        return {"dtype": "f16", "B": 8, "L": 4096, "layout": layout, "kv_bytes": 2 ** 26, "device_us": us,
                "host_us": 300.0, "step_us": 310.0, "tb_s": 2 ** 26 / us / 1e6,
                "fraction": 2 ** 26 / us / 1e6 / 4.0, "covered": True, "plan_host_us": 200.0,
                "run": {"host_us": 100.0, "step_us": 110.0, "device_us": us},
                "layer": {"host_us": 90.0, "step_us": 95.0, "device_us": us}}

    fc_rows = [fc("contiguous", 20.0), fc("paged 64", 50.0), fc("paged 256", 30.0)]
    peer = ["f16", 8, 4096]
    peers = [peer + ["torch flash", "enable_gqa", "ok", 1e-4, 1e-3, 0.3, 0.5, 25.0, 30.0, 40.0, 2.7, 0.67],
             peer + ["torch math", "enable_gqa", "ok", 1e-4, 1e-3, 0.3, 0.1, 80.0, 50.0, 90.0, 0.8, 0.2],
             peer + ["torch cudnn", "-", "refused: RuntimeError: no kernel"] + [None] * 9,
             peer + [decode.FLEX, "enable_gqa", "wrong: not timed", 1.0, 1e-3, 9.0, 30.0] + [None] * 5]
    rows = decode._fc_table(fc_rows, peers)
    assert [r[10] for r in rows] == ["torch flash"] * 3
    assert [r[12] for r in rows] == pytest.approx([20 / 25, 50 / 25, 30 / 25])
    assert [r[13] for r in rows] == pytest.approx([1.0, 2.5, 1.5])
    acc = [["f16", 8, 4096, lay, 2, 1e-4, 1e-4, 4e-4, 0.25, True, 0.0]
           for lay in ("contiguous", "paged 64", "paged 256")]
    ctx = SimpleNamespace(backend="cuda")
    copy = {"tb_s": 4.0}
    finding = decode._finding(ctx, "NVIDIA H200", copy, acc, rows, peers, "torch 2.9")
    assert finding.startswith("On NVIDIA H200 (copy bandwidth 4.00 TB/s)")
    assert "0.80x the best peer's time (torch flash)" in finding and "1 peer calls disagreed" in finding
    assert "pages of 64 take 2.50x" in finding and "3 of 3 checks" in finding
    assert ("a plan's run (one layer of a step, `plan_kvcache`) takes 100 us of host time, in 3 rows"
            in finding)
    assert "a step of 4 layers (one plan, a run on each layer's cache) 90 us a layer" in finding
    fig = decode._figure(ctx, "NVIDIA H200", copy, acc, rows, peers)
    assert "NVIDIA H200" in fig._suptitle.get_text()
    fig.savefig(tmp_path / "decode.png")
