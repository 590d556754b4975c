"""Nsight Compute hardware counters of flashcupy's kernels beside torch SDPA's FlashAttention-2 and cuDNN
kernels on the same inputs: occupancy, tensor pipe, warp stalls, bank conflicts, spills, issue slots, DRAM/L2.

On the device (ncu must leave the clocks alone; only the cudaProfilerStart/Stop range is profiled, so
NVRTC compilation, cuDNN plan building and warm-up stay out of the report)::

    ncu --clock-control none --profile-from-start off --nvtx --set full -o $OUT/prof -f \\
        python -m analysis.profile_ncu run --cells f16:4096:128:0,f16:4096:64:1 --b 4 --h 32
    ncu --import $OUT/prof.ncu-rep --page raw --csv --print-units base > $OUT/prof.csv && \\
        python -m analysis.profile_ncu summarize $OUT/prof.csv --out reports --name profile

Where a kernel's time goes inside it (warp-state samples per SASS instruction, same report)::

    ncu --import $OUT/prof.ncu-rep --page source --csv --print-source sass \\
        --kernel-name regex:dkdvdq_wgmma > $OUT/src_ours.csv
    python -m analysis.profile_ncu sass $OUT/src_ours.csv [more.csv ...] --out reports --name profile_sass

``sass`` groups each kernel's samples by opcode and by stretch of code between synchronization points
(mbarrier waits, named barriers, wgmma waits: where warps wait on each other or on the tensor cores),
each stretch named by the sync instruction that opens it and counted per execution of that instruction.

``run --arm NAME:FC_X=1`` profiles flashcupy's calls in that build of the kernels (``analysis.ab``'s
arms: -D values that replace the variant's own, and/or a changed copy of kernels_cu/), so a change can
be profiled before and after in one tree.

``run`` wraps each profiled call in an NVTX range ``<provider> <direction> <dtype> N<n> D<d> causal<0|1>``
(provider flashcupy / torch_flash / torch_cudnn, direction fwd / bwd / bwd_det), pushed on the calling
thread and also started process-wide, since torch's autograd launches backward kernels from its own
thread. ``summarize`` labels each launch from the NVTX column when there is one (CuPy helper kernels in a
flashcupy range count for flashcupy), else from the kernel name, and writes ``<out>/<name>.json`` (every
extracted number) and ``<out>/<name>.md`` (listed in the index.md of that folder by ``python -m analysis
all`` or ``index``); a metric missing from the report is None in the JSON and n/a in the Markdown. torch
SDPA runs through ``analysis.sdpa``, as in ``bench``.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import sys

from . import sdpa
from .common import Table, git_commit, log, md_table

LABEL_RE = re.compile(r"(flashcupy|torch_flash|torch_cudnn) (fwd|bwd_det|bwd) (\w+ N\d+ D\d+ causal[01])")
ACT, ELA = ".avg.pct_of_peak_sustained_active", ".avg.pct_of_peak_sustained_elapsed"
BANK = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_"
WAVE = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_"
LOCAL = "l1tex__t_sectors_pipe_lsu_mem_local_op_{}.sum"
# key -> candidate raw metric names, the first present wins; "name*32" scales sectors to bytes. Every
# first candidate was seen in the raw page of an ncu 2025.3.1 --set full report on an H200; the later
# ones are spellings of other ncu versions (absent there).
METRICS = {
    "sm_pct": ["sm__throughput" + ELA],
    "tensor_hmma_pct": ["sm__pipe_tensor_op_hmma_cycles_active" + ACT],  # mma.sync (and wgmma on sm90)
    "tensor_all_pct": ["sm__pipe_tensor_cycles_active" + ACT],
    "tensor_hmma_inst_pct": ["sm__inst_executed_pipe_tensor_op_hmma" + ACT],
    "tensor_gmma_inst_pct": ["sm__inst_executed_pipe_tensor_op_gmma" + ACT],  # wgmma issue share
    "occ_achieved_pct": ["sm__warps_active" + ACT],
    "occ_theoretical_pct": ["sm__maximum_warps_per_active_cycle_pct"],
    "regs": ["launch__registers_per_thread"], "waves_per_sm": ["launch__waves_per_multiprocessor"],
    "smem_dynamic_bytes": ["launch__shared_mem_per_block_dynamic"],
    "smem_static_bytes": ["launch__shared_mem_per_block_static"],
    "block_size": ["launch__block_size"], "grid_size": ["launch__grid_size"],
    "occ_limit_registers": ["launch__occupancy_limit_registers"],
    "occ_limit_shared_mem": ["launch__occupancy_limit_shared_mem"],
    "issue_pct": ["smsp__issue_active" + ACT, "sm__inst_issued" + ACT],
    # ldmatrix wavefronts count under op_ld (no ldsm-specific conflict counter in the full set)
    "smem_ld_conflicts": [BANK + "ld.sum"], "smem_st_conflicts": [BANK + "st.sum"],
    "smem_ldgsts_conflicts": [BANK + "ldgsts.sum"],
    "smem_all_conflicts": ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"],
    "smem_ld_wavefronts": [WAVE + "ld.sum"], "smem_st_wavefronts": [WAVE + "st.sum"],
    "ldsm_inst": ["smsp__inst_executed_op_ldsm.sum"],
    "warp_inst": ["smsp__inst_executed.sum"],                      # warp-level instructions executed
    "red_inst": ["smsp__inst_executed_op_global_red.sum"],
    "xu_pct": ["sm__inst_executed_pipe_xu" + ACT],                 # MUFU (ex2) and conversions
    "local_ld_bytes": [LOCAL.format("ld") + "*32"], "local_st_bytes": [LOCAL.format("st") + "*32"],
    "spill_inst": ["sass__inst_executed_register_spilling"],
    "dram_pct": ["gpu__dram_throughput" + ELA, "dram__throughput" + ELA],
    "dram_read_bytes": ["dram__bytes_read.sum"], "dram_write_bytes": ["dram__bytes_write.sum"],
    "l2_pct": ["lts__throughput" + ELA], "l2_bytes": ["lts__t_sectors.sum*32", "lts__t_bytes.sum"],
    "l2_red_requests": ["lts__t_requests_srcunit_tex_op_red.sum", "lts__t_requests_op_red.sum"],
    "global_red_sectors": ["l1tex__m_l1tex2xbar_write_sectors_mem_global_op_red.sum"],
    "global_tma_red_sectors": ["l1tex__m_l1tex2xbar_write_sectors_mem_global_op_tma_red.sum"],
    "global_atom_sectors": ["l1tex__m_l1tex2xbar_write_sectors_mem_global_op_atom.sum"],
}
# warp-stall families, the first present wins: cycles per issued instruction, latency, PC samples
STALL_FAMILIES = [re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$"),
                  re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+)\.ratio$"),
                  re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$")]
TIME_NS = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9}
BYTE_SCALE = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}

# ---------------------------------------------------------------------------------------------------
# run: launched under ncu


@contextlib.contextmanager
def nvtx_range(label):
    try:
        from cupy.cuda import nvtx
        ok = bool(nvtx.available)
    except Exception:
        ok = False
    rid = nvtx.RangeStart(label, 0xFF76B900) if ok else None   # process-wide: torch's autograd thread
    if ok:
        nvtx.RangePush(label)
    try:
        yield
    finally:
        if ok:
            nvtx.RangePop()
            nvtx.RangeEnd(rid)


def _calls(cell, b, h, seed):
    """[(NVTX label, fn)] of one cell: flashcupy fwd / bwd / bwd_det, then torch SDPA flash and cuDNN."""
    import cupy

    import flashcupy
    from flashcupy.inspect import numpy_dtype

    dname, n, d, causal = cell
    tag = f"{dname} N{n} D{d} causal{int(causal)}"
    rng = cupy.random.default_rng(seed)
    xs = [rng.standard_normal((b, h, n, d), dtype=cupy.float32) for _ in range(4)]
    try:
        q, k, v, do = (x.astype(numpy_dtype(dname)) for x in xs)
    except Exception:  # no device-side cast to this dtype: cast on the host
        q, k, v, do = (cupy.asarray(cupy.asnumpy(x).astype(numpy_dtype(dname))) for x in xs)
    del xs
    o, lse = flashcupy.attention(q, k, v, causal=causal, return_lse=True)
    calls = [(f"flashcupy fwd {tag}", lambda: flashcupy.attention(q, k, v, causal=causal, return_lse=True)),
             (f"flashcupy bwd {tag}",
              lambda: flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal)),
             (f"flashcupy bwd_det {tag}",
              lambda: flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=True))]
    try:
        torch = sdpa.load_torch()
    except Exception as e:
        log(f"[profile_ncu] torch skipped: {e}")
        return calls
    tq, tk, tv, tdo = sdpa.to_torch(torch, (q, k, v, do))
    for short in ("flash", "cudnn"):
        prov, peer = f"torch_{short}", sdpa.Sdpa(torch, short, causal)
        try:
            graph = peer.graph(tq, tk, tv, tdo)
        except Exception as e:
            log(f"[profile_ncu] {prov} {tag} skipped: {type(e).__name__}: {e}")
            continue
        calls += [(f"{prov} fwd {tag}", lambda peer=peer: peer.forward(tq, tk, tv)),
                  (f"{prov} bwd {tag}", lambda peer=peer, graph=graph: peer.backward(graph))]
    return calls


def run(cells, b, h, seed=0, arm=None):
    """Profile each cell's calls; with ``arm`` (an analysis.ab arm) the calls run in its build, while
    their inputs (the forward's o and lse included) are made in the default one, so an arm of a tile that
    only the backward runs (block_m=80) still gets its inputs; a call its build rejects is logged and
    left out."""
    import cupy

    sync = cupy.cuda.runtime.deviceSynchronize
    for i, cell in enumerate(cells):
        calls, ready = _calls(cell, b, h, seed + i), []
        with arm.build() if arm else contextlib.nullcontext():
            for label, fn in calls:  # warm-up outside the profiled range: compilation, plans, autotuning
                try:
                    fn()
                    fn()
                    sync()
                    ready.append((label, fn))
                except Exception as e:
                    log(f"[profile_ncu] {label}: failed in warm-up, not profiled: {type(e).__name__}: {e}")
            cupy.cuda.profiler.start()
            try:
                for label, fn in ready:
                    log(f"[profile_ncu] {label}")
                    with nvtx_range(label):
                        fn()
                        sync()
            finally:
                cupy.cuda.profiler.stop()
        del calls, ready
        cupy.get_default_memory_pool().free_all_blocks()


# ---------------------------------------------------------------------------------------------------
# summarize: ncu --page raw --csv --print-units base -> JSON + Markdown


def number(text):
    t = (text or "").strip().replace(",", "")
    try:
        return float(t) if t.lower() not in ("", "n/a", "nan", "-") else None
    except ValueError:
        return None


def to_base(value, unit):
    """Times to ns, byte counts to bytes, anything else unchanged."""
    u = (unit or "").strip()
    if u in TIME_NS:
        return value * TIME_NS[u]
    m = re.fullmatch(r"([KMGT]?)i?byte(/.*)?", u)
    return value * BYTE_SCALE[m.group(1)] if m else value


def infer_provider(name):
    if re.fullmatch(r"(void )?flash_(fwd|bwd)_\w+", name):  # extern "C": no namespace, template or arguments
        return "flashcupy"
    if re.search(r"flash_fwd_kernel|flash_fwd_splitkv|flash_bwd_|flash::", name):
        return "torch_flash"
    return "torch_cudnn" if re.search(r"cudnn|sdpa|fmha", name, re.I) else "other"


def infer_direction(name):
    if re.search(r"fwd|fprop", name, re.I):
        return "fwd"
    return "bwd" if re.search(r"bwd|bprop|dgrad", name, re.I) else "?"


def short_name(name, width=60):
    """``void ns::kernel<...>(args)`` -> ``ns::kernel<…>``, at most ``width`` characters."""
    s = re.sub(r"^void ", "", name.strip())
    cut = min([i for i in (s.find("<"), s.find("(")) if i > 0], default=len(s))
    s = s[:cut] + ("<…>" if s[cut:cut + 1] == "<" else "")
    return s if len(s) <= width else s[:width - 1] + "…"


def read_raw_csv(path):
    """(header, units, rows): the header, the units row as a dict ({} if absent), a dict per launch."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(('"ID"', "ID,"))), None)
    if start is None:
        raise ValueError(f"{path}: no ncu raw CSV header (a line starting with \"ID\")")
    table = [r for r in csv.reader(lines[start:]) if r]
    header, body, units = table[0], table[1:], {}
    if body and not body[0][0].strip():
        units, body = dict(zip(header, body[0])), body[1:]
    return header, units, [dict(zip(header, r)) for r in body]


def extract(row, units, nvtx_cols):
    """One launch: labels, the METRICS (None where absent), derived numbers and the top 4 stalls."""
    name = row.get("Kernel Name", "")
    m = next((m for m in (LABEL_RE.search(row.get(c) or "") for c in nvtx_cols) if m), None)
    kind = infer_provider(name)
    launch = {"id": row.get("ID"), "kernel": name, "short": short_name(name), "kind": kind,
              "provider": m.group(1) if m else kind, "direction": m.group(2) if m else infer_direction(name),
              "cell": m.group(3) if m else "?", "nvtx": m.group(0) if m else None,
              "block": row.get("Block Size"), "grid": row.get("Grid Size")}
    ns = number(row.get("gpu__time_duration.sum"))
    met = {"duration_us": None if ns is None else to_base(ns, units.get("gpu__time_duration.sum")) / 1e3}
    for key, cands in METRICS.items():
        met[key] = None
        for cand in cands:
            col, _, factor = cand.partition("*")
            if number(row.get(col)) is not None:
                met[key] = to_base(number(row[col]), units.get(col)) * float(factor or 1)
                break

    def total(*keys):
        vals = [met[k] for k in keys if met[k] is not None]
        return sum(vals) if vals else None
    smem = total("smem_dynamic_bytes", "smem_static_bytes")
    conf, wave = (total("smem_ld_conflicts", "smem_st_conflicts"),
                  total("smem_ld_wavefronts", "smem_st_wavefronts"))
    tensor = [met[k] for k in ("tensor_hmma_pct", "tensor_all_pct") if met[k] is not None]
    met.update(smem_kb=None if smem is None else smem / 1024, tensor_pct=max(tensor) if tensor else None,
               bank_conflict_pct=100 * conf / wave if conf is not None and wave else None,
               local_bytes=total("local_ld_bytes", "local_st_bytes"))
    launch.update(metrics=met, stall_family=None, stalls={})
    for fam in STALL_FAMILIES:
        hits = [(fam.match(c), number(t)) for c, t in row.items()]
        stalls = {s.group(1): v for s, v in hits if s and v is not None
                  and s.group(1) != "selected" and not s.group(1).endswith("not_issued")}
        if stalls:
            launch.update(stall_family=fam.pattern, stalls=stalls)
            break
    top = sorted(((r, v) for r, v in launch["stalls"].items() if v > 0), key=lambda rv: -rv[1])[:4]
    launch["top_stalls"] = [[r, v] for r, v in top]
    return launch


def summarize_csv(path):
    header, units, rows = read_raw_csv(path)
    nvtx_cols = [c for c in header if "Range" in c or "nvtx" in c.lower()]
    launches = [extract(r, units, nvtx_cols) for r in rows]
    sums = {}
    for ln in launches:
        key = (ln["cell"], ln["provider"], ln["direction"])
        s = sums.setdefault(key, dict(zip(("cell", "provider", "direction"), key), kernels=0, us=0.0))
        s["kernels"] += 1
        s["us"] += ln["metrics"]["duration_us"] or 0.0
    for (cell, _, direction), s in sums.items():
        ref = sums.get((cell, "torch_flash", "bwd" if direction == "bwd_det" else direction))
        s["vs_torch_flash"] = s["us"] / ref["us"] if ref and ref["us"] > 0 else None
    device = (rows[0].get("device__attribute_display_name") or rows[0].get("Device")) if rows else None
    return {"source": os.path.abspath(path), "nvtx": bool(nvtx_cols), "device": device,
            "finding": finding(sums), "launches": launches, "sums": list(sums.values())}


def finding(sums):
    parts = []
    for (cell, prov, direction), s in sums.items():
        ref, cudnn = sums.get((cell, "torch_flash", direction)), sums.get((cell, "torch_cudnn", direction))
        det = sums.get((cell, "flashcupy", "bwd_det")) if direction == "bwd" else None
        if prov == "flashcupy" and direction in ("fwd", "bwd") and ref:
            parts.append(f"{cell} {direction}: flashcupy {g(s['us'])} µs"
                         + (f" (deterministic {g(det['us'])} µs)" if det else "")
                         + f" vs torch flash {g(ref['us'])} µs ({g(s['vs_torch_flash'])}x)"
                         + (f", cuDNN {g(cudnn['us'])} µs" if cudnn else ""))
    if not parts:
        return "No cell has both flashcupy and torch flash kernels; see the per-launch table."
    return "Summed kernel time per call, " + "; ".join(parts) + "."


def g(x):
    """3 significant digits, plain notation below 10^6; None -> n/a."""
    if x is None or isinstance(x, str):
        return "n/a" if x is None else x
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    if 1e3 <= abs(x) < 1e6:
        return str(int(round(x, 2 - int(math.floor(math.log10(abs(x)))))))
    return f"{x:.3g}"


def write_reports(data, out, name):
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f"{name}.{k}") for k in ("json", "md")}
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1)
    cols = ["provider", "dir", "cell", "kernel", "µs", "SM %", "tensor %", "occ ach/theo %", "regs",
            "smem KB", "issue %", "top stalls", "bank confl %", "local B", "L2 red req", "DRAM %", "L2 %"]
    md = ["# Nsight Compute: flashcupy against torch SDPA (FlashAttention-2, cuDNN)", "",
          f"**Finding:** {data['finding']}", "",
          f"Source: `{os.path.basename(data['source'])}`, {len(data['launches'])} kernel launches"
          f"{', ' + data['device'] if data.get('device') else ''}"
          f"{', git commit ' + data['git_commit'] if data.get('git_commit') else ''}; labels from "
          f"{'NVTX ranges' if data['nvtx'] else 'kernel names (no NVTX column)'}. Top stalls: "
          "warp cycles per issued instruction "
          "(`smsp__average_warps_issue_stalled_*_per_issue_active.ratio`) where present. "
          "tensor % = tensor-pipe cycles active (busiest of `sm__pipe_tensor_op_hmma_cycles_active` and "
          "`sm__pipe_tensor_cycles_active`, % of peak, active); bank conflicts in % of shared-memory "
          "wavefronts (ld + st; ldmatrix counts as ld); local B = local-memory (spill) traffic; "
          "L2 red req = global reductions (atomics) reaching L2; n/a = metric not in the report.", ""]
    rows = []
    for ln in data["launches"]:
        m = ln["metrics"]
        rows.append([ln["provider"], ln["direction"], ln["cell"], f"`{ln['short'].replace('|', '/')}`",
                     m["duration_us"], m["sm_pct"], m["tensor_pct"],
                     f"{g(m['occ_achieved_pct'])} / {g(m['occ_theoretical_pct'])}", m["regs"], m["smem_kb"],
                     m["issue_pct"], ", ".join(f"{r} {g(v)}" for r, v in ln["top_stalls"]) or None,
                     m["bank_conflict_pct"], m["local_bytes"], m["l2_red_requests"], m["dram_pct"],
                     m["l2_pct"]])
    md.append(md_table(Table("Kernel launches", cols, rows), g))
    sums = [[s["cell"], s["provider"], s["direction"], s["kernels"], s["us"], s["vs_torch_flash"]]
            for s in sorted(data["sums"], key=lambda s: (s["cell"], s["direction"], s["provider"]))]
    md += ["", md_table(Table("Summed kernel time per (cell, provider, direction)",
                              ["cell", "provider", "direction", "kernels", "µs", "/ torch flash"], sums), g)]
    md += compare_table(data, "torch_flash", "FA2")
    md += compare_table(data, "torch_cudnn", "cuDNN")
    with open(paths["md"], "w") as f:
        f.write("\n".join(md) + "\n")
    return paths


def compare_table(data, peer="torch_flash", short="FA2"):
    """The longest flashcupy kernel of each (cell, direction) beside the peer's (``torch_flash``:
    FlashAttention-2; ``torch_cudnn``: cuDNN, the peer of the Hopper forward): time, work issued (warp
    instructions, ldmatrix) as ratios, and where the time goes (pipes, occupancy, waves, atomics)."""
    main = {}
    for ln in data["launches"]:
        key = (ln["cell"], ln["provider"], ln["direction"])
        if ln["metrics"]["duration_us"] is not None and (key not in main or ln["metrics"]["duration_us"] >
                                                         main[key]["metrics"]["duration_us"]):
            main[key] = ln
    cols = ["cell", "dir", f"kernel (ours / {short})", "time ratio", "warp inst ratio", "ldmatrix ratio",
            f"tensor % (ours / {short})", "issue %", "XU %", "occ ach %", "waves/SM", "L2 red req",
            "bank confl %", "local B"]
    rows = []

    def ratio(a, b, k):
        x, y = a["metrics"].get(k), b["metrics"].get(k)
        return x / y if x is not None and y else None

    def pair(a, b, k):
        return f"{g(a['metrics'].get(k))} / {g(b['metrics'].get(k))}"

    for (cell, prov, direction), ours in sorted(main.items()):
        fa = main.get((cell, peer, "bwd" if direction == "bwd_det" else direction))
        if prov != "flashcupy" or fa is None:
            continue
        rows.append([
            cell, direction, f"`{ours['short']}` / `{fa['short'][:40]}`", ratio(ours, fa, "duration_us"),
            ratio(ours, fa, "warp_inst"), ratio(ours, fa, "ldsm_inst"), pair(ours, fa, "tensor_pct"),
            pair(ours, fa, "issue_pct"), pair(ours, fa, "xu_pct"), pair(ours, fa, "occ_achieved_pct"),
            pair(ours, fa, "waves_per_sm"), pair(ours, fa, "l2_red_requests"),
            pair(ours, fa, "bank_conflict_pct"), pair(ours, fa, "local_bytes")])
    if not rows:
        return []
    title = {"FA2": "FlashAttention-2's"}.get(short, f"{short}'s")
    return ["", md_table(Table(f"Main kernel against {title} (ratios ours / {short})", cols, rows), g)]


# ---------------------------------------------------------------------------------------------------
# sass: ncu's source page (per SASS instruction) -> where each kernel's warp samples fall

# instructions at which warps wait on each other or on asynchronous units: a stretch starts at each
SYNC_RE = re.compile(r"^(SYNCS\.PHASECHK|BAR\.SYNC|BAR\.RED|WARPGROUP\.DEPBAR|DEPBAR|WARPSYNC|EXIT)")


def read_source_csv(path):
    """One kernel's ``--page source --csv --print-source sass`` export: (kernel name, rows), each row
    {address, sass, opcode, samples, executed, stalls: {reason: samples}} in address order."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    if len(lines) < 2 or not lines[0] or lines[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source-page CSV (first row should name the kernel)")
    kernel, header = lines[0][1], lines[1]
    need = ("Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")
    missing = [c for c in need if c not in header]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing (export with --print-source sass)")
    idx = {c: header.index(c) for c in need}
    stall_cols = [(i, c[len("stall_"):]) for i, c in enumerate(header)
                  if c.startswith("stall_") and "(Not Issued)" not in c]
    rows = []
    for r in lines[2:]:
        if len(r) < len(header):
            continue
        sass = r[idx["Source"]].strip()
        words = sass.split()
        if words and words[0].startswith("@"):  # a predicate
            words = words[1:]
        op = words[0] if words else ""
        rows.append({"address": r[idx["Address"]], "sass": sass, "opcode": op.split(".")[0],
                     "sync": op if SYNC_RE.match(op) else None,
                     "samples": number(r[idx["Warp Stall Sampling (All Samples)"]]) or 0.0,
                     "executed": number(r[idx["Instructions Executed"]]) or 0.0,
                     "stalls": {name: number(r[i]) or 0.0 for i, name in stall_cols}})
    return kernel, rows


def _top(counter, total, k=3):
    ranked = sorted(counter.items(), key=lambda kv: -kv[1])[:k]
    return [[name, 100 * v / total] for name, v in ranked if v > 0]


def sass_summary(path, top=15, min_region_pct=0.5):
    """Samples of one kernel by stall reason, opcode, stretch after a sync point and instruction, in % of
    all its warp samples (every warp of the CTA is sampled: producer warps included)."""
    kernel, rows = read_source_csv(path)
    total = sum(r["samples"] for r in rows)
    if total <= 0:
        raise ValueError(f"{path}: no warp samples (profile with the SourceCounters section)")
    reasons, ops, op_exec, op_stalls = {}, {}, {}, {}
    for r in rows:
        for k, v in r["stalls"].items():
            reasons[k] = reasons.get(k, 0.0) + v
        o = r["opcode"]
        ops[o] = ops.get(o, 0.0) + r["samples"]
        op_exec[o] = op_exec.get(o, 0.0) + r["executed"]
        st = op_stalls.setdefault(o, {})
        for k, v in r["stalls"].items():
            st[k] = st.get(k, 0.0) + v
    regions, cur = [], None
    for i, r in enumerate(rows):
        if cur is None or r["sync"]:
            cur = {"first": i, "opener": r["sass"] if r["sync"] else "(kernel entry)",
                   "address": r["address"], "executed": r["executed"], "instructions": 0, "samples": 0.0,
                   "stalls": {}}
            regions.append(cur)
        cur["instructions"] += 1
        cur["samples"] += r["samples"]
        for k, v in r["stalls"].items():
            cur["stalls"][k] = cur["stalls"].get(k, 0.0) + v
    out_regions = [{"first_instruction": g["first"], "address": g["address"], "opener": g["opener"],
                    "executed": g["executed"], "instructions": g["instructions"],
                    "pct": 100 * g["samples"] / total, "top_stalls": _top(g["stalls"], total)}
                   for g in regions if 100 * g["samples"] / total >= min_region_pct]
    by_op = sorted(ops, key=lambda o: -ops[o])
    hot = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])[:top]
    return {
        "kernel": kernel, "source": os.path.basename(path), "instructions": len(rows), "samples": total,
        "warp_instructions_executed": sum(r["executed"] for r in rows),
        "stall_reasons": _top(reasons, total, k=len(reasons)),
        "opcodes": [{"opcode": o, "pct": 100 * ops[o] / total, "executed": op_exec[o],
                     "top_stalls": _top(op_stalls[o], total)} for o in by_op[:top]],
        "regions": out_regions,
        "hot": [{"index": i, "address": rows[i]["address"], "sass": rows[i]["sass"],
                 "executed": rows[i]["executed"], "pct": 100 * rows[i]["samples"] / total,
                 "top_stalls": _top(rows[i]["stalls"], total)} for i in hot if rows[i]["samples"] > 0],
    }


def _stalls_text(pairs):
    return ", ".join(f"{n} {v:.1f}" for n, v in pairs) or "n/a"


def write_sass_reports(kernels, out, name, device=None, commit=None):
    """<out>/<name>.json and .md of ``sass_summary`` results (one per kernel); ``device`` and ``commit``
    (default: this tree's) name where the profile was taken."""
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f"{name}.{k}") for k in ("json", "md")}
    finding = "; ".join(
        f"`{short_name(k['kernel'], 40)}`: {_stalls_text(k['stall_reasons'][:3])} (% of warp samples), "
        f"hottest instruction {k['hot'][0]['pct']:.1f}% ({_stalls_text(k['hot'][0]['top_stalls'][:1])})"
        for k in kernels if k["hot"])
    data = {"finding": finding, "device": device, "git_commit": commit or git_commit(), "kernels": kernels}
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1)
    md = ["# Nsight Compute: where the warp samples fall inside each kernel (per SASS instruction)", "",
          f"**Finding:** {finding}", "",
          "Warp-state samples of every warp (producer and writer warps included), in % of the kernel's "
          "samples; the stall reason is the state a warp was sampled in (selected = issuing). A stretch "
          "starts at each instruction where warps wait on each other or on an asynchronous unit "
          "(mbarrier try-wait, named barrier, wgmma wait) and its samples fall mostly on the waits inside "
          "it; 'executed' counts the warp-level executions of its first instruction (per tile and warp "
          "inside a main loop). Stretches under 0.5% are left out."
          + (f" Device: {device}." if device else "")
          + (f" Profiled tree: git commit {data['git_commit']}." if data["git_commit"] else ""), ""]
    for k in kernels:
        md += [f"## `{short_name(k['kernel'], 90)}`", "",
               f"{k['instructions']} SASS instructions, {g(k['samples'])} warp samples, "
               f"{g(k['warp_instructions_executed'])} warp instructions executed "
               f"(`{os.path.basename(k['source'])}`).",
               "", "Stall reasons: " + _stalls_text(k["stall_reasons"][:10]) + ".", ""]
        md.append(md_table(Table("By opcode", ["opcode", "% samples", "executed", "top stalls (% samples)"],
                                 [[o["opcode"], o["pct"], o["executed"], _stalls_text(o["top_stalls"])]
                                  for o in k["opcodes"]]), g))
        md += ["", md_table(Table("By stretch after a sync point (address order)",
                                  ["#", "opened by", "executed", "instructions", "% samples", "top stalls"],
                                  [[str(r["first_instruction"]), f"`{r['opener'][:60]}`", r["executed"],
                                    r["instructions"], r["pct"], _stalls_text(r["top_stalls"])]
                                   for r in k["regions"]]), g)]
        md += ["", md_table(Table("Hottest instructions",
                                  ["#", "SASS", "executed", "% samples", "top stalls"],
                                  [[str(h["index"]), f"`{h['sass'][:70]}`", h["executed"], h["pct"],
                                    _stalls_text(h["top_stalls"])] for h in k["hot"]]), g), ""]
    with open(paths["md"], "w") as f:
        f.write("\n".join(md) + "\n")
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {__package__}.profile_ncu",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the profiled calls (launch under ncu, see the module docstring)")
    r.add_argument("--cells", default="f16:4096:128:0,f16:4096:64:1", help="dtype:N:D:causal,...")
    r.add_argument("--b", type=int, default=4)
    r.add_argument("--h", type=int, default=32)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--arm", default=None, metavar="NAME[@FOLDER][:FC_X=1,...]",
                   help="run flashcupy's calls in this build of the kernels (as analysis.ab's --arm)")
    s = sub.add_parser("summarize", help="ncu raw-page CSV -> <out>/<name>.json and .md")
    s.add_argument("csv")
    s.add_argument("--out", default="reports")
    s.add_argument("--name", default="profile")
    q = sub.add_parser("sass", help="ncu source-page CSVs (one kernel each) -> <out>/<name>.json and .md")
    q.add_argument("csv", nargs="+")
    q.add_argument("--out", default="reports")
    q.add_argument("--name", default="profile_sass")
    q.add_argument("--device", default=None, help="the GPU the profile was taken on (for the Markdown)")
    q.add_argument("--commit", default=None, help="the profiled tree's git commit (default: this tree's)")
    a = p.parse_args(argv)
    if a.cmd == "sass":
        paths = write_sass_reports([sass_summary(c) for c in a.csv], a.out, a.name, a.device, a.commit)
        log(f"[profile_ncu] wrote {paths['md']} and {paths['json']}")
        return 0
    if a.cmd == "run":
        from .ab import parse_arm, parse_cells

        try:
            cells, arm = parse_cells(a.cells), parse_arm(a.arm) if a.arm else None
        except ValueError as e:
            r.error(str(e))
        run(cells, a.b, a.h, a.seed, arm)
    else:
        data = summarize_csv(a.csv)
        data["git_commit"] = git_commit()
        paths = write_reports(data, a.out, a.name)
        log(f"[profile_ncu] {data['finding']}\n[profile_ncu] wrote {paths['md']} and {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
