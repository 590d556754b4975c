"""The tensor-core accumulation model of analysis/tensorcore.py on the CPU: it reproduces the H200
measurement of the directed cases (frozen in data/), and its fit recovers a model from cases that model
produced. Plus the analysis command line: --help lists every experiment, a single run says where its
files went."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from analysis import EXPERIMENTS
from analysis import tensorcore as tc
from analysis.__main__ import main
from flashcupy.inspect import tensorcore as tcm

# the H200 measurement the model was fitted to, frozen here (reports/tensorcore.json is rewritten by each
# run of the experiment)
REPORT = os.path.join(os.path.dirname(__file__), "data", "tensorcore_h200.json")


def test_round_to_bits_rz_rn_and_subnormals():
    x = np.array([1.0 + 0.75 * 2.0 ** -10, -(1.0 + 0.75 * 2.0 ** -10), 1.0 + 0.5 * 2.0 ** -10])
    assert list(tcm.round_to_bits(x, 11, "rz")) == [1.0, -1.0, 1.0]
    assert list(tcm.round_to_bits(x, 11, "rn")) == [1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -10), 1.0]  # tie: even
    # an fp16 subnormal result rounds on the 2^-24 grid
    assert tcm.round_to_bits(np.array([15.5 * 2.0 ** -24]), 11, "rn", tcm.MIN_ULP["fp16"])[0] == 2.0 ** -20


@pytest.mark.parametrize("acc,mode", [("fp32", "rz"), ("fp16", "rn")])
def test_model_reproduces_the_measured_directed_cases(acc, mode):
    """The directed cases measured on the H200 (data/tensorcore_h200.json) follow from the fitted model."""
    with open(REPORT) as f:
        data = json.load(f)["data"]
    names, a, b, c = tc.directed_cases(acc)
    pred = tc.accumulate(a, b, c, 26, acc, mode)
    measured = data[f"mma f16 acc {acc}"]["directed"]
    assert data[f"mma f16 acc {acc}"]["best"] == {"reference": "exponent sum", "align_bits": 26, "mode": mode,
                                                   "agreement": 1.0}
    for name, p in zip(names, pred):
        assert measured[name] == p, name


def test_fit_recovers_the_model_that_made_the_cases():
    rng = np.random.default_rng(3)
    a, b, c = tc.random_cases(rng, 2000, "f16", "fp32")
    d = tc.accumulate(a, b, c, 26, "fp32", "rz")
    best = tc.fit(a, b, c, d, "fp32")[0]
    assert best == ("exponent sum", 26, "rz", 1.0)
    # the value-aligned model of the same width does not explain these cases: the two are distinguishable
    assert np.mean(tc.accumulate(a, b, c, 26, "fp32", "rz", ref="value") == d) < 0.95


def test_help_lists_every_experiment_and_profile(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, (_, _, desc) in EXPERIMENTS.items():
        assert name in out and desc in out
    assert "analysis.profile_ncu" in out and "``" not in out


def test_one_experiment_says_where_its_files_went(tmp_path, capsys):
    assert main(["tensorcore", "--backend", "numpy", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for ext in ("md", "json", "png"):
        path = os.path.join(str(tmp_path), f"tensorcore.{ext}")
        assert os.path.exists(path) and path in out


@pytest.mark.parametrize("acc", ["fp32", "fp16"])
def test_e4m3_cases_are_exact_in_e4m3_and_the_accumulator(rng, acc):
    """Every input of the e4m3 cases is an e4m3 value (32 per case), every c an accumulator value, and
    the directed alignment cases reach 2^-s of c's ulp with normal factors."""
    names, a, b, c = tc.directed_cases(acc, "e4m3")
    ra, rb, rc = tc.random_cases(rng, 300, "e4m3", acc)
    dt = tc.input_dtype("e4m3")
    for x in (a, b, ra, rb):
        assert x.shape[1] == 32
        assert np.array_equal(x.astype(dt).astype(np.float64), x)
    for x in (c, rc):
        assert np.array_equal(x.astype(tc.ACC_DTYPE[acc]).astype(np.float64), x)
    c_big, steps = tc.align_setup("e4m3", acc)
    ulp = c_big * 2.0 ** (1 - tc.PRECISION[acc])
    assert steps >= 16 and (a[:steps] * b[:steps] == -ulp * 2.0 ** -np.arange(1, steps + 1)[:, None]).all()
    assert np.abs(a[a != 0]).min() >= 2.0 ** -6 and np.abs(b[b != 0]).min() >= 2.0 ** -6


@pytest.mark.parametrize("bits,group", [(14, None), (24, None), (14, 16)])
def test_fit_recovers_a_narrow_e4m3_accumulator(rng, bits, group):
    """From cases that a 14-bit (or fp32) truncating accumulator, with or without rounding after every 16
    products, produced, the narrow fit names that model; the 16-bit inputs' model does not explain a
    14-bit accumulator's results."""
    names, da, db, dc = tc.directed_cases("fp32", "e4m3")
    ra, rb, rc = tc.random_cases(rng, 400, "e4m3", "fp32")
    a, b, c = np.concatenate([da, ra]), np.concatenate([db, rb]), np.concatenate([dc, rc])
    d = tc.accumulate(a, b, c, bits + 2, "fp32", "rz", out_bits=bits, group=group)
    best = tc.fit(a, b, c, d, "fp32", narrow=True)[0]
    assert best[3] == 1.0 and best[4] == bits and best[5] == group and best[2] == "rz"
    if bits == 14:
        assert np.mean(tc.accumulate(a, b, c, 26, "fp32", "rz") == d) < 0.9


@pytest.mark.cupy
@pytest.mark.parametrize("dname,acc", tc.CONFIGS)
def test_probe_compiles_for_every_configuration(dname, acc):
    """kernels_cu/tc_probe.cu builds with NVRTC for sm_90a (ptxas included) in every configuration the
    experiment measures: the e4m3 wgmma form (k32, no transpose immediates) included."""
    from cupy_backends.cuda.libs import nvrtc

    from flashcupy._compile import nvrtc_options, source_text

    prog = nvrtc.createProgram(source_text("tc_probe.cu"), "tc_probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(nvrtc_options(tc.probe_defines(dname, acc))) + ["-arch=sm_90a"])
        ptx = nvrtc.getPTX(prog)
    except nvrtc.NVRTCError as e:
        pytest.fail(f"{dname} {acc}: {e}\n{nvrtc.getProgramLog(prog)}")
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    want = "m64n64k32.f32.e4m3.e4m3" if (dname, acc) == ("e4m3", "fp32") else (
        "m64n64k32.f16.e4m3.e4m3" if dname == "e4m3" else "m64n64k16")
    assert want in ptx
    assert ("tc_probe_mma" in ptx) == (dname != "e4m3")


@pytest.mark.gpu
@pytest.mark.parametrize("dname,acc", tc.CONFIGS)
def test_probe_measures_what_the_report_says(rng, dname, acc):
    """On the GPU: the measured facts (data/tensorcore_h200.json, H200) explain every directed case and
    1000 fresh random ones: 16-bit inputs align to the largest exponent sum with 24 + 2 bits (fp16
    accumulators too), rz into fp32 and rn into fp16, mma.sync and wgmma bit for bit alike; e4m3 on
    wgmma aligns with 14 bits and truncates the sum to 14 bits into fp32, rounds to nearest into fp16.
    A model with one more or one fewer alignment bit must miss some case (the cases pin W)."""
    import cupy

    names, da, db, dc = tc.directed_cases(acc, dname)
    ra, rb, rc = tc.random_cases(rng, 1000, dname, acc)
    a, b, c = np.concatenate([da, ra]), np.concatenate([db, rb]), np.concatenate([dc, rc])
    got = tc.measure(dname, acc, a, b, c)
    assert set(got) == set(tc.instructions(dname, int(cupy.cuda.Device().compute_capability) == 90))
    w, mode, bits = tc.MEASURED[(dname, acc)]
    for instr, d in got.items():
        model = tc.accumulate(a, b, c, w, acc, mode, out_bits=bits)
        miss = np.flatnonzero(model != d)
        assert miss.size == 0, f"{instr} {dname} {acc}: the model misses {miss.size} cases, e.g. {miss[:5]}"
        for w_other in (w - 1, w + 1):
            other = tc.accumulate(a, b, c, w_other, acc, mode, out_bits=bits)
            assert np.any(other != d), f"{instr} {dname} {acc}: W = {w_other} explains every case too"
    if "mma" in got and "wgmma" in got:
        assert np.array_equal(got["mma"], got["wgmma"])
