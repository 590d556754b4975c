"""``python -m analysis <experiment|all> [--backend auto|cuda|numpy] [--quick] [--out DIR] [--seed S]``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from . import EXPERIMENTS, OTHER_REPORTS_PREFIX, run_experiment
from .common import Context, log, reports_root


def write_index(ctx, results, elapsed):
    lines = ["# flashcupy analysis reports", "",
             f"Backend: {ctx.backend}, sizes: {'quick' if ctx.quick else 'full'}, seed {ctx.seed}, "
             f"total wall time {elapsed:.0f} s.", "",
             "| experiment | finding | table | figure | data |", "|---|---|---|---|---|"]
    for name, (paths, rep, err) in results.items():
        if err:
            lines.append(f"| {name} | FAILED: {err} | | | |")
            continue
        fig = f"[{name}.png]({name}.png)" if "png" in paths else "none"
        finding = rep.finding.replace("|", "/")
        lines.append(f"| {name} | {finding} | [{name}.md]({name}.md) | {fig} | [{name}.json]({name}.json) |")
    others = sorted(f[:-5] for f in os.listdir(ctx.out)
                    if f.startswith(OTHER_REPORTS_PREFIX) and f.endswith(".json"))
    for name in others:  # written by analysis.profile_ncu into the same folder
        with open(os.path.join(ctx.out, f"{name}.json")) as f:
            finding = json.load(f)["finding"].replace("|", "/")
        lines.append(f"| {name} | {finding} | [{name}.md]({name}.md) | none | [{name}.json]({name}.json) |")
    lines.append("")
    for name, (paths, rep, err) in results.items():
        if not err and "png" in paths:
            lines += [f"## {name}", "", f"![{name}]({name}.png)", ""]
    path = os.path.join(ctx.out, "index.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def rebuild_index(out: str) -> str:
    """index.md from the JSON reports already in ``out`` (after re-running single experiments)."""
    from types import SimpleNamespace

    results = {}
    for name in EXPERIMENTS:
        path = os.path.join(out, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            paths = {ext: os.path.join(out, f"{name}.{ext}") for ext in ("json", "md", "png")
                     if os.path.exists(os.path.join(out, f"{name}.{ext}"))}
            results[name] = (paths, SimpleNamespace(finding=data["finding"]), None)
    meta = json.load(open(os.path.join(out, next(iter(results)) + ".json")))["meta"] if results else {}
    ctx = SimpleNamespace(out=out, backend=meta.get("backend", "?"), quick=meta.get("quick", False),
                          seed=meta.get("seed", "?"))
    return write_index(ctx, results, sum(json.load(open(p["json"]))["meta"].get("elapsed_s", 0.0)
                                         for p, _, _ in results.values()))


def experiment_help(name: str, parser: argparse.ArgumentParser) -> str:
    """``python -m analysis <name> --help``: what the experiment measures (its line and its module's
    description), what it writes, and the options."""
    import importlib
    import inspect

    module, _, line = EXPERIMENTS[name]
    doc = inspect.getdoc(importlib.import_module(f"{__package__}.{module}")) or ""
    options = parser.format_help().split("options:", 1)[-1].split("experiments:", 1)[0].rstrip()
    return (f"python -m {__package__} {name} [options]: {line}\n\n{doc}\n\nWrites {name}.json, {name}.md and "
            f"(most experiments) {name}.png into the output folder.\n\noptions:{options}\n")


def main(argv=None) -> int:
    width = max(len(n) for n in EXPERIMENTS) + 2
    listing = "\n".join(f"  {name:<{width}}{desc}" for name, (_, _, desc) in EXPERIMENTS.items())
    ap = argparse.ArgumentParser(
        prog=f"python -m {__package__}", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="flashcupy's break-it experiments and numerical reports (and the benchmark). Each "
                    "experiment writes <name>.json, <name>.md and usually <name>.png into the output "
                    "folder; 'all' runs every one and writes index.md.",
        epilog=f"experiments:\n{listing}\n  {'all':<{width}}every experiment above, then index.md\n"
               f"  {'index':<{width}}rebuild index.md from the JSON reports in --out\n\n"
               "Nsight Compute counters beside FlashAttention-2 and cuDNN (needs ncu and torch): "
               f"python -m {__package__}.profile_ncu --help")
    ap.add_argument("experiment", choices=list(EXPERIMENTS) + ["all", "index"], metavar="EXPERIMENT",
                    help="one of the experiments listed below, 'all' or 'index'")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "numpy"],
                    help="cuda: the GPU kernels; numpy: the NumPy twin (no GPU needed); auto (default): "
                         "cuda when a CUDA device is present")
    ap.add_argument("--quick", action="store_true", help="small sizes (always on for the NumPy backend)")
    ap.add_argument("--out", default=None, help="output folder (default: the checkout's reports/, or "
                                                "reports/quick/ with --quick)")
    ap.add_argument("--seed", type=int, default=0, help="seed of every random input (default 0)")
    argv = sys.argv[1:] if argv is None else list(argv)
    named = [a for a in argv if a in EXPERIMENTS]
    if named and {"-h", "--help"} & set(argv):
        print(experiment_help(named[0], ap))
        return 0
    args = ap.parse_args(argv)
    if args.experiment == "index":
        print(f"index: {rebuild_index(args.out or reports_root())}")
        return 0
    ctx = Context.make(args.backend, args.quick, args.seed, args.out)
    log(f"writing into {os.path.abspath(ctx.out)}")
    if ctx.forced_quick:
        log("NumPy backend (no CUDA device or --backend numpy): running the --quick sizes")
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    t0 = time.perf_counter()
    results, failed = {}, 0
    for name in names:
        try:
            paths, rep = run_experiment(name, ctx)
            results[name] = (paths, rep, None)
            print(f"{name}: {rep.finding}")
            print(f"{name}: wrote " + ", ".join(paths[k] for k in ("md", "json", "png") if k in paths))
        except Exception as e:  # one failing experiment must not hide the others' reports
            if args.experiment != "all":
                raise
            failed += 1
            traceback.print_exc()
            results[name] = ({}, None, f"{type(e).__name__}: {e}")
    if args.experiment == "all":
        path = write_index(ctx, results, time.perf_counter() - t0)
        print(f"index: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
