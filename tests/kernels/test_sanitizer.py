"""compute-sanitizer memcheck and racecheck report no error on small ragged runs of every family."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_reports_no_errors(tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.fail("compute-sanitizer is not on PATH on this GPU machine")
    cmd = [exe, f"--tool={tool}", "--error-exitcode=1", sys.executable, "-m",
           "tests.kernels.sanitizer_driver"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert "all launches done" in out, out[-4000:]
    # memcheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, ..."
    summary = re.search(r"ERROR SUMMARY: (\d+) error|hazards displayed \((\d+) error", out)
    assert summary is not None, out[-4000:]
    assert res.returncode == 0 and int(summary.group(1) or summary.group(2)) == 0, out[-4000:]
    print(summary.group(0))
