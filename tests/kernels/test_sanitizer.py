"""compute-sanitizer memcheck, racecheck and synccheck report no error on small ragged runs of every
family."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_sanitizer_reports_no_errors(tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.fail("compute-sanitizer is not on PATH on this GPU machine")
    # Failed host API calls are not what this checks: cuda.bindings (TMA tensor maps of the wgmma family)
    # probes the driver with cuGetProcAddress for entry points this driver lacks, which memcheck would
    # count as errors. Kernel memory errors, races and barrier misuse are all still reported.
    cmd = [exe, f"--tool={tool}", "--report-api-errors", "no", "--error-exitcode=1", sys.executable, "-m",
           "tests.kernels.sanitizer_driver"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert "all launches done" in out, out[-4000:]
    # memcheck, synccheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed
    # (0 errors, ..."
    summary = re.search(r"ERROR SUMMARY: (\d+) error|hazards displayed \((\d+) error", out)
    assert summary is not None, out[-4000:]
    assert res.returncode == 0 and int(summary.group(1) or summary.group(2)) == 0, out[-4000:]
    print(summary.group(0))
