"""The tensor-core accumulation model of analysis/tensorcore.py on the CPU: it reproduces the committed
H200 measurement of the directed cases, and its fit recovers a model from cases that model produced.
Plus the analysis command line: --help lists every experiment, a single run says where its files went."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from analysis import EXPERIMENTS
from analysis import tensorcore as tc
from analysis.__main__ import main

REPORT = os.path.join(os.path.dirname(__file__), "..", "..", "reports", "tensorcore.json")


def test_round_to_bits_rz_rn_and_subnormals():
    x = np.array([1.0 + 0.75 * 2.0 ** -10, -(1.0 + 0.75 * 2.0 ** -10), 1.0 + 0.5 * 2.0 ** -10])
    assert list(tc.round_to_bits(x, 11, "rz")) == [1.0, -1.0, 1.0]
    assert list(tc.round_to_bits(x, 11, "rn")) == [1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -10), 1.0]  # tie: even
    # an fp16 subnormal result rounds on the 2^-24 grid
    assert tc.round_to_bits(np.array([15.5 * 2.0 ** -24]), 11, "rn", tc.MIN_ULP["fp16"])[0] == 16 * 2.0 ** -24


@pytest.mark.parametrize("acc,mode", [("fp32", "rz"), ("fp16", "rn")])
def test_model_reproduces_the_measured_directed_cases(acc, mode):
    """The directed cases measured on the H200 (reports/tensorcore.json) follow from the fitted model."""
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
