"""The GPU's SM clock, power draw and temperature while a timed call runs, sampled by ``nvidia-smi``.

A ratio of two kernels' TFLOP/s measured over a few seconds each mixes two things: the cycles each kernel
needs and the clock the card holds while it runs. A Hopper card at its power limit lowers its SM clock,
and a kernel that keeps the tensor pipe busier draws more power, so it can lose at the wall clock what it
wins in cycles. ``Sampler`` reads ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu
-lms 50`` in the background; ``window(t0, t1)`` gives the median SM clock (MHz), the median power (W), the
hottest reading (°C) and the number of samples between two ``time.time()`` stamps. Dividing TFLOP/s by the
clock gives work per cycle, which compares kernels whatever the clock (``analysis.ab --clocks``).

nvidia-smi's timestamps are the machine's local time to the millisecond; a window of fewer samples than
two is reported as such (n) rather than guessed.
"""
from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"


def parse_line(line: str):
    """(seconds since the epoch, SM MHz, W, °C) of one CSV line of ``QUERY``, or None (a header, a blank
    line, a field nvidia-smi reports as "[N/A]" or "[Not Supported]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return t, float(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:
        return None


def summarize(samples, t0: float, t1: float) -> dict:
    """The samples of [t0, t1]: {"mhz": median SM clock, "w": median power, "c": hottest, "n": count};
    None values where there are none."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return {"mhz": None, "w": None, "c": None, "n": 0}
    return {"mhz": statistics.median(s[1] for s in inside), "w": statistics.median(s[2] for s in inside),
            "c": max(s[3] for s in inside), "n": len(inside)}


class Sampler:
    """nvidia-smi sampling the GPU with this PCI bus id every ``period_ms`` until ``close``."""

    def __init__(self, pci_bus_id: str, period_ms: int = 50):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            raise RuntimeError("nvidia-smi is not on PATH: the clocks cannot be sampled")
        fd, self.path = tempfile.mkstemp(prefix="clocks_", suffix=".csv")
        self._file = os.fdopen(fd, "w")
        self._proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                       f"-lms={period_ms}", f"--id={pci_bus_id}"],
                                      stdout=self._file, stderr=subprocess.DEVNULL)

    def samples(self) -> list:
        self._file.flush()
        with open(self.path) as f:
            return [s for s in map(parse_line, f) if s is not None]

    def window(self, t0: float, t1: float) -> dict:
        return summarize(self.samples(), t0, t1)

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._file.close()
        os.unlink(self.path)


def for_current_device(period_ms: int = 50) -> Sampler:
    """A Sampler of the GPU that CuPy's current device is (nvidia-smi numbers GPUs its own way, so the
    PCI bus id names it)."""
    import cupy

    return Sampler(cupy.cuda.Device().pci_bus_id, period_ms)
