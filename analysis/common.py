"""What every experiment shares: the run context (backend, sizes, seed, output folder), the report
writer (JSON + Markdown + PNG, with the run's device, versions, commit and seed), error metrics and input
makers.

An experiment is a function ``run(ctx) -> Report``; it computes on the backend's arrays (``ctx.dev``)
through the public ``flashcupy`` API, measures against ``flashcupy.reference`` (float64) and hands back a
``Report`` whose tables are lists of raw numbers: the JSON stores them as they are and the Markdown shows the
same numbers formatted by ``fmt`` (4 significant digits), so the two always agree.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import backward_reduction, tolerance
from flashcupy.inspect import numpy_dtype
from flashcupy.reference import to_float64

# unit roundoff and largest finite value per storage type
UNIT_ROUNDOFF = {"f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8, "fp32": 2.0 ** -24,
                 "fp16": 2.0 ** -11}
MAX_FINITE = {"f32": float(np.finfo(np.float32).max), "f16": 65504.0,
              "bf16": 3.3895313892515355e38, "fp32": float(np.finfo(np.float32).max),
              "fp16": 65504.0}
SMALLEST_NORMAL = {"f32": float(np.finfo(np.float32).tiny), "f16": 2.0 ** -14, "bf16": 2.0 ** -126}


def log(msg: str) -> None:
    """Progress goes to stderr, so reports on stdout stay clean."""
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# the run context


def cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def reports_root() -> str:
    """The default output folder: the checkout's ``reports/`` when this package runs from a checkout
    (where the README's commands put them, whatever the current directory), else ``./reports``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "setup.cfg")) and os.path.isdir(os.path.join(root, "reports")):
        return os.path.join(root, "reports")
    return os.path.abspath("reports")


@dataclasses.dataclass
class Context:
    backend: str            # "cuda" or "numpy"
    quick: bool
    seed: int
    out: str
    forced_quick: bool = False   # the NumPy backend always runs the quick sizes

    @classmethod
    def make(cls, backend: str = "auto", quick: bool = False, seed: int = 0, out: str | None = None):
        if backend == "auto":
            backend = "cuda" if cuda_available() else "numpy"
        if backend == "cuda" and not cuda_available():
            raise SystemExit("--backend cuda: no CUDA device (cupy.cuda.is_available() is False)")
        if backend not in ("cuda", "numpy"):
            raise SystemExit(f"--backend must be auto, cuda or numpy, got {backend!r}")
        forced = backend == "numpy" and not quick
        quick = quick or backend == "numpy"
        if out is None:
            out = os.path.join(reports_root(), "quick") if quick else reports_root()
        os.makedirs(out, exist_ok=True)
        return cls(backend, quick, seed, out, forced)

    def rng(self, salt: str) -> np.random.Generator:
        """A generator per experiment (and sub-sweep): reruns with the same seed give the same inputs."""
        import zlib

        return np.random.default_rng([self.seed, zlib.crc32(salt.encode())])

    def dev(self, *arrays):
        """Host arrays -> the backend's arrays (CuPy on the device, or the NumPy arrays themselves)."""
        if self.backend == "cuda":
            import cupy

            out = tuple(cupy.asarray(a) for a in arrays)
        else:
            out = tuple(arrays)
        return out if len(out) > 1 else out[0]

    def sync(self):
        if self.backend == "cuda":
            import cupy

            cupy.cuda.Device().synchronize()

    def sizes(self, quick, full):
        return quick if self.quick else full

    def device_name(self) -> str:
        if self.backend == "cuda":
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            return f"{props['name'].decode()} (CUDA kernels)"
        return f"CPU (NumPy twin; {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def git_commit() -> str | None:
    """HEAD of the checkout (``+dirty`` with uncommitted changes), or FLASHCUPY_GIT_COMMIT where the
    tree was copied without its .git (as onto a lent GPU machine)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("FLASHCUPY_GIT_COMMIT"):
        return os.environ["FLASHCUPY_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return None


def metadata(ctx: Context) -> dict:
    versions = {"python": platform.python_version(), "numpy": np.__version__,
                "flashcupy": flashcupy.__version__}
    try:
        import cupy

        versions["cupy"] = cupy.__version__
    except Exception:
        versions["cupy"] = None
    try:
        import scipy

        versions["scipy"] = scipy.__version__
    except Exception:
        pass
    return {
        "device": ctx.device_name(),
        "backend": ctx.backend,
        "versions": versions,
        "git_commit": git_commit(),
        "seed": ctx.seed,
        "quick": ctx.quick,
        "quick_forced_by_numpy_backend": ctx.forced_quick,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": f"python -m {__package__} " + " ".join(sys.argv[1:]) if sys.argv else None,
    }


# ---------------------------------------------------------------------------------------------------
# numbers


def fmt(x: Any) -> str:
    """How a table cell is shown in Markdown (tests parse it back and compare with the JSON)."""
    if x is None:
        return "n/a"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        if 1e-3 <= abs(x) < 1e4:
            return f"{x:.4g}"
        return f"{x:.3e}"
    return str(x)


def errors(out, ref) -> dict:
    """max abs error and RMSE over all elements (inf if any output element is not finite), and the
    number of non-finite output elements."""
    o = to_float64(out)
    ref = np.asarray(ref, dtype=np.float64)
    bad = ~np.isfinite(o)
    if bad.any():
        return {"max_abs": math.inf, "rmse": math.inf, "nonfinite": int(bad.sum())}
    d = o - ref
    return {"max_abs": float(np.abs(d).max(initial=0.0)), "rmse": float(np.sqrt(np.mean(d * d))),
            "nonfinite": 0}


def normal_inputs(rng, shape_q, shape_kv, dname, q_scale=1.0):
    """q, k, v with N(0,1) entries (q times ``q_scale``), rounded to ``dname`` on the host."""
    dt = numpy_dtype(dname)
    return ((q_scale * rng.standard_normal(shape_q)).astype(dt),
            rng.standard_normal(shape_kv).astype(dt), rng.standard_normal(shape_kv).astype(dt))


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    return x


def from_json_number(x):
    """Inverse of ``jsonable`` for numbers ("inf", "nan" strings back to floats)."""
    if x in ("inf", "-inf", "nan"):
        return float(x)
    return x


# ---------------------------------------------------------------------------------------------------
# reports


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclasses.dataclass
class Report:
    name: str
    title: str
    finding: str                 # one line, stated from the numbers
    setup: dict                  # exact shapes, dtypes, distributions, knobs
    tables: list[Table]
    data: dict = dataclasses.field(default_factory=dict)   # everything else, for the JSON
    notes: list[str] = dataclasses.field(default_factory=list)
    figure: Any = None           # a matplotlib Figure, saved as <name>.png
    figure_caption: str = ""


def new_figure(ncols: int = 1, width: float = 7.0, height: float = 4.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols if ncols > 1 else width, height),
                             squeeze=False)
    return fig, list(axes[0])


def rule_ratios(dev, host, kw, dname, accum):
    """The accuracy rule's measure of one call (``kw``: attention's knobs; ``dev``: q, k, v, do as the
    backend's arrays, ``host``: the same as NumPy arrays): max error over the naive same-precision max
    error of o, dq, dk, dv against float64; and whether all four lie within the accuracy rule's bound
    (``flashcupy.accuracy.tolerance``: the factor times the naive error plus the rule's noise floor, which
    is what float32 inputs, their naive error at float32 roundoff too, meet)."""
    q, k, v, do = dev
    o, lse = flashcupy.attention(q, k, v, accum=accum, return_lse=True, **kw)
    grads = flashcupy.attention_backward(do, q, k, v, o, lse, accum=accum, **kw)
    o_ref = reference.attention(*host[:3], **kw)
    refs = reference.attention_backward(host[3], *host[:3], **kw)
    naives = (naive.attention(q, k, v, **kw), *naive.attention_backward(do, q, k, v, **kw))
    outs, truths = (o, *grads), (o_ref, *refs)
    errs = [(errors(x, r)["max_abs"], errors(nv, r)["max_abs"]) for x, r, nv in zip(outs, truths, naives)]
    red = backward_reduction(*host[:2])
    within = all(e <= tolerance(dname, accum, ne, "fwd" if i == 0 else "bwd", float(np.abs(r).max()), red)
                 for i, ((e, ne), r) in enumerate(zip(errs, truths)))
    return [e / max(ne, 1e-300) for e, ne in errs], within


def finish_log_axes(ax, xlabel: str, ylabel: str, title: str, legend_size: int = 7) -> None:
    """A log-log panel's scales, labels, title and legend, the experiments' one style."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=legend_size)


def plot_cost_ratios(ax, labels, fwd, bwd, ylabel: str, title: str, targets=None) -> None:
    """A variant's cost panel: per shape (``labels``), the forward's and the backward's time over the plain
    kernel's as paired bars, with the issue's targets (forward, backward) as dashed lines when given."""
    x = np.arange(len(labels))
    ax.bar(x - 0.2, fwd, width=0.4, label="forward / plain")
    ax.bar(x + 0.2, bwd, width=0.4, label="backward / plain")
    top = 1.3
    if targets:
        for value, colour, which in zip(targets, ("C0", "C1"), ("forward", "backward")):
            ax.axhline(value, color=colour, lw=1, ls="--", label=f"{which} target ({value:g})")
    else:
        top = 1.5
    ax.set_xticks(x, labels, rotation=30, fontsize=6, ha="right")
    ax.set_ylim(0.9, max(top, max(max(fwd), max(bwd)) * 1.05))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot_rule_ratios(ax, series) -> None:
    """The accuracy rule's panel: per (label, x values, o ratios, worst-gradient ratios), the forward's
    and the gradients' error over the naive same-precision error, against the rule's 2x and 3x lines, on
    a log x axis (the caller labels it)."""
    for i, (label, xs, o, grads) in enumerate(series):
        ax.plot(xs, o, marker="o", color=f"C{i}", label=f"o, {label}")
        ax.plot(xs, grads, marker="x", ls="--", color=f"C{i}", label=f"worst gradient, {label}")
    ax.axhline(2.0, color="k", lw=1, label="the forward rule (2x)")
    ax.axhline(3.0, color="k", lw=1, ls="--", label="the backward rule (3x)")
    ax.set_xscale("log")
    ax.set_ylabel("max error / naive same-precision max error")
    ax.legend(fontsize=6)


def md_table(t: Table, cell=fmt) -> str:
    """The table in Markdown under its bold title, each value shown by ``cell``."""
    lines = [f"**{t.title}**", "", "| " + " | ".join(t.columns) + " |",
             "|" + "|".join("---" for _ in t.columns) + "|"]
    for r in t.rows:
        lines.append("| " + " | ".join(cell(c) for c in r) + " |")
    return "\n".join(lines)


def write_report(ctx: Context, rep: Report, elapsed_s: float) -> dict:
    """Write <out>/<name>.json, .md and .png; return the paths."""
    meta = metadata(ctx)
    meta["elapsed_s"] = round(elapsed_s, 2)
    paths = {k: os.path.join(ctx.out, f"{rep.name}.{k}") for k in ("json", "md", "png")}
    if rep.figure is not None:
        rep.figure.savefig(paths["png"], dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(rep.figure)
    else:
        paths.pop("png")
    doc = {"name": rep.name, "title": rep.title, "finding": rep.finding, "meta": meta,
           "setup": rep.setup, "notes": rep.notes,
           "tables": [{"title": t.title, "columns": t.columns, "rows": t.rows} for t in rep.tables],
           "data": rep.data}
    with open(paths["json"], "w") as f:
        json.dump(jsonable(doc), f, indent=1)
    md = [f"# {rep.title}", "", f"**Finding:** {rep.finding}", ""]
    md += ["## Setup", ""] + [f"- {k}: {v}" for k, v in rep.setup.items()] + [""]
    md += ["## Run", "", f"- device: {meta['device']}",
           "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
           f"- git commit: {meta['git_commit'] or 'unknown'}", f"- seed: {ctx.seed}",
           f"- sizes: {'quick' if ctx.quick else 'full'}"
           + (" (forced: the NumPy backend always runs the quick sizes)" if ctx.backend == "numpy"
              else ""),
           f"- wall time: {meta['elapsed_s']} s", ""]
    if rep.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in rep.notes] + [""]
    md += ["## Results", ""]
    for t in rep.tables:
        md += [md_table(t), ""]
    if "png" in paths:
        md += [f"![{rep.figure_caption or rep.title}]({rep.name}.png)", ""]
        if rep.figure_caption:
            md += [f"*{rep.figure_caption}*", ""]
    with open(paths["md"], "w") as f:
        f.write("\n".join(md))
    return paths
