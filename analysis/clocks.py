"""The GPU's SM clock, power draw and temperature while a timed call runs, sampled by ``nvidia-smi``.

A ratio of two kernels' TFLOP/s measured over a few seconds each mixes two things: the cycles each kernel
needs and the clock the card holds while it runs. A Hopper card at its power limit lowers its SM clock,
and a kernel that keeps the tensor pipe busier draws more power, so it can lose at the wall clock what it
wins in cycles. ``Sampler`` reads
``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,temperature.gpu -lms 50`` in the
background; ``window(t0, t1)`` gives the median SM clock (MHz), the median power (W), the hottest reading
(°C) and the number of samples between two ``time.time()`` stamps. Dividing TFLOP/s by the clock gives
work per cycle, which compares kernels whatever the clock (``analysis.ab --clocks``).

The clock is the sample's own; ``power.draw`` is an average over about a second on recent drivers, so
the instant reading is asked for, and where the driver lacks it the average is used and said (``power``).
nvidia-smi's timestamps are the machine's local time to the millisecond, as ``time.time()`` read through
the local time zone; a window's number of samples (n) says how much each median rests on.
"""
from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile

FIELDS = ("timestamp", "clocks.sm", "{power}", "temperature.gpu")
POWER = ("power.draw.instant", "power.draw")  # the first the driver knows


def parse_line(line: str):
    """(seconds since the epoch, SM MHz, W, °C) of one CSV line of ``FIELDS``, or None (a header, a blank
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
    """nvidia-smi sampling the GPU with this PCI bus id every ``period_ms`` until ``close``; ``power`` is
    the power field it reads."""

    def __init__(self, pci_bus_id: str, period_ms: int = 50):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            raise RuntimeError("nvidia-smi is not on PATH: the clocks cannot be sampled")
        self.power = next((p for p in POWER if subprocess.run(
            [exe, f"--query-gpu={p}", "--format=csv,noheader", f"--id={pci_bus_id}"],
            capture_output=True).returncode == 0), None)
        if self.power is None:
            raise RuntimeError(f"nvidia-smi reads no power field ({', '.join(POWER)}) of GPU {pci_bus_id}")
        query = ",".join(FIELDS).format(power=self.power)
        self._out = tempfile.NamedTemporaryFile("w+", prefix="clocks_", suffix=".csv", delete=False)
        self._err = tempfile.TemporaryFile("w+")
        try:
            self._proc = subprocess.Popen([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                           f"-lms={period_ms}", f"--id={pci_bus_id}"],
                                          stdout=self._out, stderr=self._err)
        except OSError:
            self._remove()
            raise

    def samples(self) -> list:
        """Every complete line so far (the last one may still be being written); raises if nvidia-smi
        has stopped with an error."""
        code = self._proc.poll()
        if code:
            self._err.seek(0)
            raise RuntimeError(f"nvidia-smi stopped sampling (exit {code}): {self._err.read().strip()[:300]}")
        with open(self._out.name) as f:
            lines = f.read().split("\n")[:-1]  # the text after the last newline is not a whole line
        return [s for s in map(parse_line, lines) if s is not None]

    def window(self, t0: float, t1: float) -> dict:
        return summarize(self.samples(), t0, t1)

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._remove()

    def _remove(self) -> None:
        self._out.close()
        self._err.close()
        os.unlink(self._out.name)


def for_current_device(period_ms: int = 50) -> Sampler:
    """A Sampler of the GPU that CuPy's current device is (nvidia-smi numbers GPUs its own way, so the
    PCI bus id names it)."""
    import cupy

    return Sampler(cupy.cuda.Device().pci_bus_id, period_ms)
