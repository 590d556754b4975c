"""A/B of kernel builds: the same calls timed under several builds of the kernels in one process, on the
same inputs, in alternating rounds, with their outputs compared bit for bit and their ptxas reports side
by side. For a kernel writer's question "is this change faster, and does it keep the bits?".

An *arm* is a build of the kernels (``flashcupy.inspect.Build``): extra ``-D`` values, which replace the
variant's own (a compile-time switch of the source such as FC_WG_PINGPONG), and/or a folder that holds a
changed copy of kernels_cu/. The tile may be an arm through FC_BLOCK_M / FC_BLOCK_N: inside a build
that sets them they are the calls' default tile (``default_tile``), so the variant is made with that tile
and the host launches its grid (``--arm bm64:FC_BLOCK_M=64 --arm bm80:FC_BLOCK_M=80``). The other knobs
the host also reads (head dim, dtype, the causal mask) are not arms: compare those through the cells. The
first arm is the baseline; every ratio is an arm's
best round over the baseline's best round; round r runs the arms in turn starting from arm r (mod the
number of arms), so no arm always runs first. Arms are written ``NAME``, ``NAME:FC_X=1,FC_Y=2``,
``NAME@FOLDER`` or ``NAME@FOLDER:FC_X=1``; on the device, a folder must travel with the tree (an ignored
folder named in the run's carry: ``git archive <rev> kernels_cu | tar -x -C scratch/base`` makes
``scratch/base/kernels_cu``, the arm ``old@scratch/base/kernels_cu``)::

    python -m analysis.ab --arm base --arm nopingpong:FC_WG_PINGPONG=0 \\
        --cells f16:4096:64:0,f16:4096:128:1 --directions fwd --peer cudnn --out $OUT/ab --name pingpong

A define that no file of the arm's kernels folder mentions is named in the report: a typo builds the
baseline's code (or a switch only the host reads, Variant.switch, as when an older kernels folder lacks
it).

Timing is ``bench``'s (CUDA events behind a GPU-holding kernel, median of repeated calls over input sets
that exceed the L2 cache; see analysis.bench). The outputs (fwd: o and the LSE; bwd: dq, dk, dv) of each
arm on the first input set are compared with the baseline's: "equal" is bitwise; otherwise the largest
difference relative to the largest magnitude of the baseline's output. An output that differs between
two runs of the baseline itself (the atomic dQ path adds in any order) is marked "varies". The backward
runs on one forward's o and LSE, made by the package's own kernels, so every arm sees the same inputs.

The host side is the package's in every arm: a switch that changes what the host launches must be read
by the host (``Variant.switch`` for its formulas, ``KernelHandle.defines`` for a module's values; shared
memory per kernel follows the module's FC_SMEM_<ROLE> by itself). An arm that a cell cannot build (a
layout past the device's shared memory, a compile error) is recorded for that cell and the run goes on.

``--clocks`` samples the SM clock, power and temperature while each measurement runs (analysis.clocks,
nvidia-smi) and adds a table of each arm's and the peer's best round beside them, with work per clock
cycle: where two kernels trade places at the wall clock, it says whether cycles or the clock moved.

Writes <out>/<name>.md and .json (rewritten after each cell and direction, so a run cut short keeps its
rows) and <name>.png: each arm's best round over the baseline's, per cell.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import numpy as np

from . import clocks, sdpa
from .common import Context, Table, jsonable, log, md_table, metadata

DIRECTIONS = ("fwd", "bwd", "bwd_det")


# ---------------------------------------------------------------------------------------------------
# arms and cells from the command line


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    defines: tuple[tuple[str, int], ...] = ()
    kernels_dir: str | None = None

    def describe(self) -> str:
        unread, note = set(self.unread_defines()), " (read by no file of its kernels; only the host's may)"
        parts = [f"{n}={v}" + (note if n in unread else "") for n, v in self.defines]
        if self.kernels_dir:
            parts.append(f"kernels from {self.kernels_dir}")
        return ", ".join(parts) or "the package's kernels"

    def build(self):
        """The context in which flashcupy's calls run this arm's build (flashcupy.inspect.kernel_build)."""
        from flashcupy.inspect import kernel_build

        return kernel_build(dict(self.defines), self.kernels_dir)

    def unread_defines(self) -> list[str]:
        """The arm's defines that no file of its kernels folder (default kernels_cu/) mentions."""
        from flashcupy.inspect import kernels_dir as _kernels_dir

        folder = self.kernels_dir or _kernels_dir()
        text = ""
        for name in sorted(os.listdir(folder)):
            if name.endswith((".cu", ".cuh", ".h")):
                with open(os.path.join(folder, name)) as f:
                    text += f.read()
        return [n for n, _ in self.defines if n not in text]


def parse_arm(spec: str) -> Arm:
    """``NAME[@FOLDER][:NAME=INT,...]`` -> Arm; ValueError saying what is allowed."""
    head, _, defs = spec.partition(":")
    name, _, folder = head.partition("@")
    if not name or not name.replace("-", "_").replace(".", "_").isidentifier():
        raise ValueError(f"--arm {spec!r}: the arm needs a name of letters, digits, '_', '-' or '.' before "
                         f"any '@FOLDER' or ':DEFINES'")
    if "@" in head and not folder:
        raise ValueError(f"--arm {spec!r}: '@' must be followed by a folder holding kernels_cu's files")
    if folder and not os.path.isdir(folder):
        raise ValueError(f"--arm {spec!r}: {folder!r} is not a folder")
    defines = []
    for item in filter(None, (x.strip() for x in defs.split(","))) if defs else ():
        key, eq, value = item.partition("=")
        try:
            defines.append((key.strip(), int(value, 0)))
        except ValueError:
            raise ValueError(f"--arm {spec!r}: each define must be NAME=INT, got {item!r}") from None
        if not eq:
            raise ValueError(f"--arm {spec!r}: each define must be NAME=INT, got {item!r}")
    if ":" in spec and not defines:
        raise ValueError(f"--arm {spec!r}: ':' must be followed by NAME=INT[,NAME=INT...]")
    from flashcupy.inspect import Build

    build = Build(tuple(defines), folder or None)  # checks the names and values
    return Arm(name, build.defines, build.kernels_dir)


def parse_arms(specs) -> list[Arm]:
    arms = [parse_arm(s) for s in specs]
    for a in arms:
        for name in a.unread_defines():
            log(f"[ab] arm {a.name}: no file of its kernels reads {name} (only the host's formulas may)")
    if len(arms) < 2:
        raise ValueError(f"give at least two --arm (the first is the baseline), got {len(arms)}")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must differ, got {names}")
    return arms


def parse_cells(text: str) -> list[tuple[str, int, int, bool]]:
    """``dtype:N:D:causal,...`` (causal 0 or 1) -> [(dtype, N, D, causal)]."""
    from flashcupy.inspect import DTYPES

    cells = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        try:
            dname, n, d, causal = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
            if len(parts) != 4:
                raise IndexError
        except (IndexError, ValueError):
            raise ValueError(f"--cells: each cell is dtype:N:D:causal, e.g. f16:4096:128:0; "
                             f"got {item!r}") from None
        if dname not in DTYPES or n < 1 or d < 1 or causal not in (0, 1):
            raise ValueError(f"--cells {item!r}: dtype one of {sorted(DTYPES)}, N and D >= 1, causal 0 or 1")
        cells.append((dname, n, d, bool(causal)))
    if not cells:
        raise ValueError("--cells: no cell given")
    return cells


def parse_directions(text: str) -> list[str]:
    dirs = [x.strip() for x in text.split(",") if x.strip()]
    bad = [d for d in dirs if d not in DIRECTIONS]
    if bad or not dirs:
        raise ValueError(f"--directions: a comma-separated subset of {DIRECTIONS}, got {text!r}")
    return dirs


# ---------------------------------------------------------------------------------------------------
# comparing outputs


def compare(base_outs, outs, varies) -> str:
    """'equal' when every output is bitwise equal to the baseline's; else per output that is not: name
    and max |difference| / max |baseline| (outputs the baseline itself does not repeat: 'varies')."""
    parts = []
    for name in base_outs:
        b, x = np.asarray(base_outs[name]), np.asarray(outs[name])
        if b.shape != x.shape:
            parts.append(f"{name}: shape {x.shape} against {b.shape}")
            continue
        if np.array_equal(b.view(np.uint8), x.view(np.uint8)):
            continue
        b64, x64 = b.astype(np.float64), x.astype(np.float64)
        finite = np.isfinite(b64) & np.isfinite(x64)
        if not np.array_equal(np.isfinite(b64), np.isfinite(x64)):
            parts.append(f"{name}: non-finite values differ")
            continue
        scale = float(np.max(np.abs(b64[finite]))) if finite.any() else 1.0
        rel = float(np.max(np.abs(x64[finite] - b64[finite]))) / (scale or 1.0)
        parts.append(f"{name}: {rel:.3g}" + (" (varies)" if name in varies else ""))
    return "; ".join(parts) or "equal"


def repeat_varies(first, second) -> set:
    """The names of the outputs that differ between two runs of the same build."""
    def bits(x):
        return np.asarray(x).view(np.uint8)

    return {name for name in first if not np.array_equal(bits(first[name]), bits(second[name]))}


# ---------------------------------------------------------------------------------------------------
# one cell on the device


class _CellRun:
    """One (dtype, N, D, causal) cell: its input sets (bench's), the package's forward of each for the
    backward, and the calls of every direction."""

    def __init__(self, ctx: Context, timer, cell, b: int, h: int, kernel: str, l2: int):
        import flashcupy

        from .bench import _Cell

        self.c = _Cell(ctx, timer, cell, b, h, l2)
        self.kernel, self.causal = kernel, cell[3]
        # o and LSE from the package's own kernels: every arm's backward sees the same inputs
        outs = [flashcupy.attention(s[0], s[1], s[2], causal=self.causal, kernel=kernel, return_lse=True)
                for s in self.c.sets]
        self.bsets = [(*s, *o) for s, o in zip(self.c.sets, outs)]

    def call(self, direction):
        """(fn over one input set returning {name: output}, the input sets)."""
        import flashcupy

        causal, kernel = self.causal, self.kernel
        if direction == "fwd":
            def fn(s):
                o, lse = flashcupy.attention(s[0], s[1], s[2], causal=causal, kernel=kernel, return_lse=True)
                return {"o": o, "lse": lse}
            return fn, self.c.sets
        det = direction == "bwd_det"

        def fn(s):
            dq, dk, dv = flashcupy.attention_backward(s[3], s[0], s[1], s[2], s[4], s[5], causal=causal,
                                                      kernel=kernel, deterministic=det)
            return {"dq": dq, "dk": dk, "dv": dv}
        return fn, self.bsets

    def variant_row(self, direction) -> list:
        """[key, kernels launched, registers, smem, spill bytes] of the variant the call runs (bench's
        compile-report summary), in the current build."""
        from flashcupy.inspect import backward_variant, forward_variant

        from .bench import _summarize_report

        s = self.bsets[0]
        knobs = dict(causal=self.causal, kernel=self.kernel)
        if direction == "fwd":
            var = forward_variant(s[0], s[1], s[2], **knobs)
        else:
            var = backward_variant(s[3], s[0], s[1], s[2], s[4], s[5], deterministic=direction == "bwd_det",
                                   **knobs)
        try:
            rep = _compile_report(var)
        except Exception as e:
            return [var.key, f"{type(e).__name__}: {str(e)[:80]}", None, None, None]
        return _summarize_report(var, rep, direction == "bwd_det", int(s[0].shape[2]))


@functools.lru_cache(maxsize=None)
def _compile_report(variant):
    """compile_report, once per variant (a build's variant is its own; bwd and bwd_det share one)."""
    from flashcupy.inspect import compile_report

    return compile_report(variant)


def _host(outs) -> dict:
    import cupy

    return {k: cupy.asnumpy(v) for k, v in outs.items()}


def _build_errors():
    """What a build that cannot run this cell raises (it is recorded for that arm and cell, and the run
    goes on): the checks' and the build layer's refusals (a layout past the device's shared memory) and
    NVRTC's errors. A CUDA error at run time is not among them: it leaves the context unusable."""
    from cupy.cuda.compiler import CompileException

    from flashcupy.inspect import CompileError

    return (ValueError, TypeError, CompileError, CompileException)


def measure(ctx: Context, arms, cells, directions, *, b: int, h: int, kernel: str, rounds: int,
            peer: str | None, budget_s: float, compile_reports: bool, on_row=None,
            sampler=None) -> list[dict]:
    """A row per (cell, direction): per arm its TFLOP/s in each round, the bits against the baseline and
    (compile_reports) its ptxas summary, or the error that kept it from running; the peer's TFLOP/s per
    round where one is asked for; with a ``clocks.Sampler``, beside each round's TFLOP/s the SM clock,
    power and temperature while it ran ("clocks"). ``on_row(rows)`` after each row (the report so far)."""
    import cupy

    from .bench import Timer

    errors = _build_errors()

    timer = Timer(ctx, budget_s=budget_s, min_reps=5, max_reps=50)
    l2 = cupy.cuda.Device().attributes.get("L2CacheSize", 50 * 2 ** 20)
    torch = None
    if peer:
        try:
            torch = sdpa.load_torch()
        except Exception as e:
            log(f"[ab] peer {peer} skipped: {type(e).__name__}: {e}")
    rows = []
    for cell in cells:
        run = _CellRun(ctx, timer, cell, b, h, kernel, l2)
        for direction in directions:
            fn, sets = run.call(direction)
            row = {"dtype": cell[0], "N": cell[1], "D": cell[2], "causal": cell[3], "direction": direction,
                   "arms": {a.name: {"tflops": []} for a in arms}}
            tdir = "fwd" if direction == "fwd" else "bwd"
            # bits and compile reports first (each arm's module is built here, outside the timing)
            base_outs, varies = None, set()
            for i, arm in enumerate(arms):
                res = row["arms"][arm.name]
                with arm.build():
                    try:
                        outs = _host(fn(sets[0]))
                    except errors as e:
                        res["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                        log(f"[ab] {cell} {direction} arm {arm.name}: {res['error']}")
                        continue
                    if i == 0:
                        base_outs, varies = outs, repeat_varies(outs, _host(fn(sets[0])))
                        row["varies"] = sorted(varies)
                    res["bits"] = compare(base_outs, outs, varies) if base_outs is not None else "n/a"
                    if compile_reports:
                        res["compile"] = run.variant_row(direction)
            peer_fn = _peer_call(torch, peer, run, direction) if torch is not None else None
            if peer_fn is not None:
                row["peer"] = {"name": peer, "tflops": []}
            spans = []  # (result dict, start, end) of each timed measurement, for the sampler

            def timed(res, f, inputs, cell=run.c, tdir=tdir):
                t0 = time.time()
                res["tflops"].append(cell.timed(f, inputs, tdir)["tflops"])
                spans.append((res, t0, time.time()))

            for r in range(rounds):
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    if "error" in row["arms"][arm.name]:
                        continue
                    with arm.build():
                        timed(row["arms"][arm.name], fn, sets)
                if peer_fn is not None:
                    timed(row["peer"], *peer_fn)
            if sampler is not None:
                time.sleep(0.2)  # the last samples reach the file
                samples = sampler.samples()
                for res, t0, t1 in spans:
                    res.setdefault("clocks", []).append(clocks.summarize(samples, t0, t1))
            log(f"[ab] {cell} {direction}: " + ", ".join(
                f"{a}: {max(v['tflops']):.1f}" for a, v in row["arms"].items() if v["tflops"]) + " TFLOP/s")
            rows.append(row)
            if on_row is not None:
                on_row(rows)
        del run
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _peer_call(torch, peer, run: _CellRun, direction):
    """(fn, input sets) of torch SDPA's ``peer`` backend for this direction (its backward on a graph
    built once per set), or None where it does not run."""
    p = sdpa.Sdpa(torch, peer, run.causal)
    tsets = [sdpa.to_torch(torch, s) for s in run.c.sets]
    try:
        if direction == "fwd":
            p.forward(*tsets[0][:3])
            return (lambda s: p.forward(s[0], s[1], s[2])), tsets
        gsets = [p.graph(*s) for s in tsets]
        p.backward(gsets[0])
        return p.backward, gsets
    except Exception as e:
        log(f"[ab] peer {peer} {direction} skipped: {type(e).__name__}: {str(e)[:100]}")
        return None


# ---------------------------------------------------------------------------------------------------
# report


def table(rows, arms) -> Table:
    """Columns: the cell, each arm's rounds and its best / the baseline's best, its bits, the peer."""
    base = arms[0].name
    with_peer = any("peer" in r for r in rows)
    with_compile = any("compile" in a for r in rows for a in r["arms"].values())
    cols = ["dtype", "N", "D", "causal", "direction"]
    for a in arms:
        cols.append(f"{a.name} TFLOP/s")
        if a.name != base:
            cols += [f"{a.name} / {base}", f"{a.name} bits"]
    if with_peer:
        peer = next(r["peer"]["name"] for r in rows if "peer" in r)
        cols += [f"{peer} TFLOP/s", f"{base} / {peer}"] + [f"{a.name} / {peer}" for a in arms[1:]]
    if with_compile:
        cols += [f"{a.name} regs (spill bytes)" for a in arms]
    def ratio(x, y):
        return f"{x / y:.3f}" if x and y else "n/a"

    out = []
    for r in rows:
        best = {name: max(v["tflops"], default=None) for name, v in r["arms"].items()}
        line = [r["dtype"], r["N"], r["D"], "yes" if r["causal"] else "no", r["direction"]]
        for a in arms:
            res = r["arms"][a.name]
            rounds = ", ".join(f"{t:.1f}" for t in res["tflops"])
            line.append("error: " + res["error"] if "error" in res else rounds)
            if a.name != base:
                line += [ratio(best[a.name], best[base]), res.get("bits", "n/a")]
        if with_peer:
            if "peer" in r:
                pb = max(r["peer"]["tflops"])
                line.append(", ".join(f"{t:.1f}" for t in r["peer"]["tflops"]))
                line += [ratio(best[a.name], pb) for a in arms]
            else:
                line += ["n/a"] * (1 + len(arms))
        if with_compile:
            for a in arms:
                c = r["arms"][a.name].get("compile")
                line.append("n/a" if not c else c[1] if c[2] is None else f"{c[2]} ({c[4]})")  # c[1]: why
        out.append(line)
    return Table("TFLOP/s per round, best round over best round, bits against the baseline", cols, out)


def clock_table(rows, arms, power: str = "power.draw.instant") -> Table | None:
    """With --clocks: per (cell, direction), each arm's (and the peer's) best round beside the SM clock,
    power (nvidia-smi's field ``power``) and hottest temperature while it ran, and its work per clock
    cycle (TFLOP/s over MHz) against the baseline's and the peer's; None where no row was sampled."""
    if not any("clocks" in res for r in rows for res in [*r["arms"].values(), r.get("peer", {})]):
        return None
    base = arms[0].name
    peer = next((r["peer"]["name"] for r in rows if "peer" in r), None)
    names = [a.name for a in arms] + ([peer] if peer else [])
    cols = ["dtype", "N", "D", "causal", "direction"]
    for n in names:
        cols += [f"{n} TFLOP/s", f"{n} MHz", f"{n} W", f"{n} °C"]
    cols += [f"{a.name} / {base} per clock" for a in arms[1:]]
    cols += [f"{a.name} / {peer} per clock" for a in arms] if peer else []

    def best(res):
        """(TFLOP/s, clocks) of the best round, or None."""
        if not res or not res.get("tflops") or "clocks" not in res:
            return None
        i = int(np.argmax(res["tflops"]))
        return res["tflops"][i], res["clocks"][i]

    def per_clock(x, y):
        if x is None or y is None or not x[1]["mhz"] or not y[1]["mhz"]:
            return "n/a"
        return f"{(x[0] / x[1]['mhz']) / (y[0] / y[1]['mhz']):.3f}"

    out = []
    for r in rows:
        got = {a.name: best(r["arms"][a.name]) for a in arms}
        if peer:
            got[peer] = best(r.get("peer"))
        line = [r["dtype"], r["N"], r["D"], "yes" if r["causal"] else "no", r["direction"]]
        for n in names:
            g = got[n]
            line += ["n/a"] * 4 if g is None else [f"{g[0]:.1f}", g[1]["mhz"], g[1]["w"], g[1]["c"]]
        line += [per_clock(got[a.name], got[base]) for a in arms[1:]]
        line += [per_clock(got[a.name], got[peer]) for a in arms] if peer else []
        out.append(line)
    title = ("Best round beside the SM clock, power and temperature while it ran (medians of nvidia-smi's "
             f"samples, W: {power}; °C: hottest); per clock: TFLOP/s over MHz, one over the other")
    return Table(title, cols, out)


def figure(rows, arms):
    """Grouped bars per (cell, direction): each arm's best round over the baseline's (and over the peer's
    where one ran), with the parity line; None without rows to draw."""
    import numpy as np

    from .common import new_figure

    others = arms[1:]
    cells = [r for r in rows if r["arms"][arms[0].name]["tflops"]]
    if not cells or not others:
        return None
    fig, (ax,) = new_figure(width=max(6.0, 0.9 * len(cells) + 2.0), height=4.0)
    x, width = np.arange(len(cells)), 0.8 / len(others)
    top = 1.0
    for i, a in enumerate(others):
        ys = [max(r["arms"][a.name]["tflops"], default=np.nan) / max(r["arms"][arms[0].name]["tflops"])
              for r in cells]
        top = max([top] + [y for y in ys if y == y])
        ax.bar(x + (i - (len(others) - 1) / 2) * width, ys, width, label=f"{a.name} / {arms[0].name}")
    ax.axhline(1.0, color="k", lw=1, ls="--")
    lo = min([1.0] + [h.get_height() for c in ax.containers for h in c if h.get_height() == h.get_height()])
    ax.set_ylim(max(0.0, lo - 0.1 * (top - lo + 0.05)), top + 0.1 * (top - lo + 0.05))
    labels = [f"{r['dtype']} N={r['N']} D={r['D']}{' causal' if r['causal'] else ''}\n{r['direction']}"
              for r in cells]
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("best round / baseline's best round")
    ax.set_title(f"A/B against {arms[0].name} (> 1: faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def render(meta: dict, arms, rows, args: dict) -> str:
    base = arms[0].name
    lines = [f"# A/B: {', '.join(a.name for a in arms[1:])} against {base}", ""]
    lines += ["## Arms", ""] + [f"- **{a.name}**{' (baseline)' if a.name == base else ''}: {a.describe()}"
                                for a in arms]
    cells = ", ".join(f"{c[0]}:{c[1]}:{c[2]}:{int(c[3])}" for c in args["cells"])
    lines += ["", "## Setup", "",
              f"- cells (dtype:N:D:causal): {cells}; B={args['b']}, H={args['h']}; "
              f"kernel={args['kernel']!r}; directions {', '.join(args['directions'])}",
              f"- rounds: {args['rounds']}, the arms in turn within each round; each number is the median of "
              f"repeated calls (about {args['budget_s']} s of calls, 5 to 50) behind a GPU-holding kernel, "
              "over input sets that exceed the L2 cache (analysis.bench's timer); ratios are best round over "
              "best round",
              "- bits: each arm's outputs on the first input set against the baseline's; 'equal' is bitwise, "
              "else max |difference| / max |baseline| per output; '(varies)': the baseline's own repeat "
              "differs there",
              f"- device: {meta.get('device')}; git commit: {meta.get('git_commit')}; "
              f"seed {meta.get('seed')}", ""]
    lines += ["## Results", "", md_table(table(rows, arms)), "",
              f"![ratios of each arm to the baseline]({args.get('name', 'ab')}.png)", ""]
    ct = clock_table(rows, arms, args.get("power", "power.draw.instant"))
    if ct is not None:
        lines += ["## Clocks", "", md_table(ct), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}.ab", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME[@FOLDER][:FC_X=1,...]",
                    help="a build of the kernels; the first is the baseline (at least two)")
    ap.add_argument("--cells", default="f16:4096:128:0", help="dtype:N:D:causal,... (default %(default)s)")
    ap.add_argument("--directions", default="fwd",
                    help=f"comma-separated, of {DIRECTIONS} (default %(default)s)")
    ap.add_argument("--kernel", default="wgmma", help="the kernel= of every call (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of calls per measurement")
    ap.add_argument("--peer", choices=sorted(sdpa.BACKENDS), default=None,
                    help="a torch SDPA backend timed in the same rounds")
    ap.add_argument("--no-compile", action="store_true", help="leave out the ptxas reports of the arms")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the SM clock, power and temperature during each timing (nvidia-smi)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("reports", "ab"))
    ap.add_argument("--name", default="ab")
    a = ap.parse_args(argv)
    try:
        arms, cells, directions = parse_arms(a.arm), parse_cells(a.cells), parse_directions(a.directions)
        for name, val, lo in (("--rounds", a.rounds, 1), ("--b", a.b, 1), ("--h", a.h, 1)):
            if val < lo:
                raise ValueError(f"{name} must be >= {lo}, got {val}")
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    from .common import cuda_available

    if not cuda_available():
        ap.error("analysis.ab times compiled kernels: it needs a CUDA device "
                 "(cupy.cuda.is_available() is False)")
    ctx = Context.make("cuda", seed=a.seed, out=a.out)
    t0 = time.perf_counter()
    args = {"cells": cells, "b": a.b, "h": a.h, "kernel": a.kernel, "directions": directions,
            "rounds": a.rounds, "budget_s": a.budget, "name": a.name}
    command = f"python -m {__package__}.ab " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(rows, done=False):
        """The report of the rows so far (each row rewrites it: a run cut short keeps what it measured)."""
        meta = {**metadata(ctx), "wall_time_s": time.perf_counter() - t0, "command": command,
                "complete": done}
        with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
            tail = "" if done else "\n(incomplete: the run goes on, or was cut short)\n"
            f.write(render(meta, arms, rows, args) + tail)
        with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
            json.dump(jsonable({"meta": meta, "arms": [dataclasses.asdict(x) for x in arms], "args": args,
                                "rows": rows}), f, indent=1)

    sampler = clocks.for_current_device() if a.clocks else None
    if sampler is not None:
        args["power"] = sampler.power
    try:
        rows = measure(ctx, arms, cells, directions, b=a.b, h=a.h, kernel=a.kernel, rounds=a.rounds,
                       peer=a.peer, budget_s=a.budget, compile_reports=not a.no_compile, on_row=write,
                       sampler=sampler)
    finally:
        if sampler is not None:
            sampler.close()
    write(rows, done=True)
    fig = figure(rows, arms)
    if fig is not None:
        fig.savefig(os.path.join(a.out, f"{a.name}.png"), dpi=120)
    print(md_table(table(rows, arms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
