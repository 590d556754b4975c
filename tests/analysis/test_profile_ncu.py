"""analysis.profile_ncu's summarize on a synthetic ``ncu --page raw --csv --print-units base`` export
(CPU only): provider labels, units, stall ordering, missing metrics, and the Markdown it writes."""
from __future__ import annotations

import csv
import json

import pytest

from analysis.profile_ncu import infer_provider, main, short_name, summarize_csv, write_reports

NVTX = ["thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg",
        "Id:Domain:Start/Stop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"]
TORCH_BWD = ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<"
             "Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::half_t, "
             "Flash_kernel_traits<128, 64, 128, 8, cutlass::half_t>>, "
             "true, false, false, false, false, false>(Flash_bwd_params)")
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
# metric -> (unit, values for the 4 launches: flashcupy fwd, flashcupy dkdv, torch bwd, cupy reduction)
METRICS = {
    "gpu__time_duration.sum": ("nsecond", ["1,234,567", "2,500,000", "1,000,000", "5,120"]),
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": ("%", ["61.5", "55", "70.25", "3.1"]),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active":
        ("%", ["40.2", "35", "52", "0"]),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("%", ["12.1", "11.8", "18.7", "80"]),
    "sm__maximum_warps_per_active_cycle_pct": ("%", ["12.5", "12.5", "18.75", "100"]),
    "launch__registers_per_thread": ("register/thread", ["168", "255", "255", "16"]),
    "launch__shared_mem_per_block_dynamic": ("byte/block", ["49,152", "81,920", "0", "0"]),
    "launch__shared_mem_per_block_static": ("byte/block", ["0", "0", "98,304", "1,024"]),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("", ["1,000", "0", "250", "0"]),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("", ["0", "0", "250", "0"]),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": ("", ["9,000", "4,000", "4,000", "0"]),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": ("", ["1,000", "1,000", "1,000", "0"]),
    "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum": ("sector", ["0", "128", "0", "0"]),
    "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum": ("sector", ["0", "64", "0", "0"]),
    "lts__t_requests_srcunit_tex_op_red.sum": ("", ["0", "524,288", "131,072", "0"]),
    # the DRAM metric is n/a for the torch kernel; no issue-slot or L2-throughput metric at all
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": ("%", ["20", "15", "n/a", "40"]),
    "device__attribute_display_name": ("", ["NVIDIA H200"] * 4),
    STALL.format("long_scoreboard"): ("", ["0.8", "1.5", "3.2", "9"]),
    STALL.format("barrier"): ("", ["2.5", "0.2", "1.1", "0"]),
    STALL.format("math_pipe_throttle"): ("", ["1.7", "0.9", "0.4", "0"]),
    STALL.format("short_scoreboard"): ("", ["0.6", "2.2", "0.3", "0"]),
    STALL.format("mio_throttle"): ("", ["0.1", "0.1", "2.0", "0"]),
    STALL.format("selected"): ("", ["1", "1", "1", "1"]),
}
KERNELS = ["flash_fwd_mma", "flash_bwd_dkdv_mma", TORCH_BWD, "cupy_sum"]
FC = '1  "<default domain>:flashcupy {} f16 N4096 D128 causal0:none:none:none:none:none:none"'
# (push/pop range of the launching thread, process-wide start/end range): torch's autograd thread has no
# push/pop range, only the start/end one
RANGES = [(FC.format("fwd"), ""), (FC.format("bwd"), ""),
          ("", '3:<default domain>:torch_flash bwd f16 N4096 D128 causal0:none:none:argb:ff76b900:none:none'),
          (FC.format("bwd"), "")]


def write_csv(path, nvtx):
    ident = ["ID", "Process ID", "Process Name", "Host Name"] + (NVTX if nvtx else []) + \
        ["Kernel Name", "Context", "Stream", "Block Size", "Grid Size", "Device", "CC"]
    rows = [ident + list(METRICS), [""] * len(ident) + [u for u, _ in METRICS.values()]]
    for i, name in enumerate(KERNELS):
        rows.append([str(i), "4242", "python", "h200"] + (list(RANGES[i]) if nvtx else []) +
                    [name, "1", "7", "(128, 1, 1)", "(32, 128, 1)", "0", "9.0"] +
                    [vals[i] for _, vals in METRICS.values()])
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return path


@pytest.fixture
def data(tmp_path):
    return summarize_csv(write_csv(tmp_path / "prof.csv", nvtx=False))


def test_providers_from_kernel_names(data):
    got = [(ln["provider"], ln["direction"], ln["cell"]) for ln in data["launches"]]
    assert got == [("flashcupy", "fwd", "?"), ("flashcupy", "bwd", "?"), ("torch_flash", "bwd", "?"),
                   ("other", "?", "?")]
    assert not data["nvtx"]
    assert data["launches"][2]["short"] == "flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<…>"
    assert len(short_name("x" * 100)) == 60


@pytest.mark.parametrize("name, provider", [
    ("flash_fwd_mma", "flashcupy"), ("flash_bwd_dkdvdq_mma", "flashcupy"),
    ("flash_bwd_dq_convert", "flashcupy"), ("flash_bwd_prep", "flashcupy"), ("flash_fwd_wgmma", "flashcupy"),
    ("flash_bwd_dkdvdq_wgmma", "flashcupy"), ("flash_bwd_dkdvdq_ordered_wgmma", "flashcupy"),
    ("flash_bwd_dkdvdq_rotated_wgmma", "flashcupy"),
    ("flash_bwd_dq_simt", "flashcupy"), (TORCH_BWD, "torch_flash"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, false>"
     "(Flash_fwd_params)", "torch_flash"),
    ("void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<>>(Flash_bwd_params)",
     "torch_flash"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
     "torch_cudnn"),
    ("cupy_sum", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>()", "other")])
def test_infer_provider(name, provider):
    assert infer_provider(name) == provider


def test_units_and_derived_numbers(data):
    fwd, dkdv, torch_bwd, red = (ln["metrics"] for ln in data["launches"])
    assert fwd["duration_us"] == pytest.approx(1234.567)
    assert red["duration_us"] == pytest.approx(5.12)
    assert fwd["smem_kb"] == pytest.approx(48) and torch_bwd["smem_kb"] == pytest.approx(96)
    assert fwd["bank_conflict_pct"] == pytest.approx(10.0)
    assert torch_bwd["bank_conflict_pct"] == pytest.approx(10.0)
    assert red["bank_conflict_pct"] is None  # no wavefronts at all
    assert dkdv["local_bytes"] == 6144 and fwd["local_bytes"] == 0  # sectors * 32
    assert dkdv["l2_red_requests"] == 524288 and torch_bwd["l2_red_requests"] == 131072
    assert fwd["tensor_pct"] == pytest.approx(40.2) and fwd["regs"] == 168


def test_missing_metrics_are_none(data, tmp_path):
    torch_bwd = data["launches"][2]["metrics"]
    assert torch_bwd["dram_pct"] is None  # "n/a" in the CSV
    assert torch_bwd["issue_pct"] is None and torch_bwd["l2_pct"] is None  # column absent
    assert data["launches"][0]["metrics"]["dram_pct"] == 20
    paths = write_reports(data, str(tmp_path / "out"), "profile")
    row = next(ln for ln in open(paths["md"]) if "seqk_parallel" in ln)
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert cells[-2] == "n/a" and cells[10] == "n/a"  # DRAM %, issue %


def test_top_stalls_ordered(data):
    fwd, dkdv, torch_bwd, red = data["launches"]
    assert [r for r, _ in fwd["top_stalls"]] == ["barrier", "math_pipe_throttle", "long_scoreboard",
                                                 "short_scoreboard"]
    assert torch_bwd["top_stalls"][0] == ["long_scoreboard", 3.2]
    assert [r for r, _ in torch_bwd["top_stalls"]] == ["long_scoreboard", "mio_throttle", "barrier",
                                                       "math_pipe_throttle"]
    assert red["top_stalls"] == [["long_scoreboard", 9.0]]  # zeros and "selected" left out
    assert all("selected" not in ln["stalls"] for ln in data["launches"])


def test_markdown_and_json_written(tmp_path):
    csv_path = write_csv(tmp_path / "prof.csv", nvtx=False)
    assert main(["summarize", str(csv_path), "--out", str(tmp_path / "rep"), "--name", "p"]) == 0
    md = (tmp_path / "rep" / "p.md").read_text()
    doc = json.loads((tmp_path / "rep" / "p.json").read_text())
    assert len(doc["launches"]) == 4 and doc["device"] == "NVIDIA H200"
    assert "| ? | flashcupy | bwd | 1 | 2500 | 2.5 |" in md
    assert "| ? | torch_flash | bwd | 1 | 1000 | 1 |" in md
    assert "| ? | flashcupy | fwd | 1 | 1230 | n/a |" in md
    assert "| ? | other | ? | 1 | 5.12 | n/a |" in md
    assert "bwd: flashcupy 2500 µs vs torch flash 1000 µs (2.5x)" in md
    assert "barrier 2.5, math_pipe_throttle 1.7" in md


def test_nvtx_labels_win(tmp_path):
    data = summarize_csv(write_csv(tmp_path / "prof.csv", nvtx=True))
    assert data["nvtx"]
    red = data["launches"][3]
    # CuPy's reduction inside flashcupy's backward range counts for flashcupy
    assert (red["provider"], red["kind"], red["direction"]) == ("flashcupy", "other", "bwd")
    assert red["cell"] == "f16 N4096 D128 causal0"
    sums = {(s["cell"], s["provider"], s["direction"]): s for s in data["sums"]}
    bwd = sums[("f16 N4096 D128 causal0", "flashcupy", "bwd")]
    assert bwd["kernels"] == 2 and bwd["us"] == pytest.approx(2505.12)
    torch_bwd = data["launches"][2]
    assert (torch_bwd["provider"], torch_bwd["cell"]) == ("torch_flash", "f16 N4096 D128 causal0")
    assert "f16 N4096 D128 causal0 bwd: flashcupy 2510 µs vs torch flash 1000 µs (2.51x)" in data["finding"]


def test_main_kernel_beside_cudnn_and_fa2():
    """The Hopper forward's peer is cuDNN: the summary compares the longest flashcupy kernel of a cell with
    cuDNN's as well as with FlashAttention-2's, as ratios ours / peer."""
    from analysis.profile_ncu import compare_table

    keys = ("warp_inst", "ldsm_inst", "tensor_pct", "issue_pct", "xu_pct", "occ_achieved_pct", "waves_per_sm",
            "l2_red_requests", "bank_conflict_pct", "local_bytes")

    def launch(provider, short, us):
        return {"cell": "f16 N4096 D128 causal0", "provider": provider, "direction": "fwd", "short": short,
                "metrics": {"duration_us": us, **{k: 1.0 for k in keys}}}

    data = {"launches": [launch("flashcupy", "flash_fwd_wgmma", 210.0),
                         launch("flashcupy", "cupy_helper", 3.0),
                         launch("torch_cudnn", "cudnn_fprop", 200.0),
                         launch("torch_flash", "flash_fwd", 350.0)]}
    cudnn = "\n".join(compare_table(data, "torch_cudnn", "cuDNN"))
    fa2 = "\n".join(compare_table(data, "torch_flash", "FA2"))
    assert "Main kernel against cuDNN's (ratios ours / cuDNN)" in cudnn
    assert "`flash_fwd_wgmma` / `cudnn_fprop` | 1.05 |" in cudnn
    assert "`flash_fwd_wgmma` / `flash_fwd` | 0.6 |" in fa2
    assert compare_table({"launches": data["launches"][:2]}, "torch_cudnn", "cuDNN") == []


# ---------------------------------------------------------------------------------------------------
# sass: a synthetic ``ncu --page source --csv --print-source sass`` export

SRC_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
              "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_barrier",
              "stall_long_sb", "stall_wait", "stall_selected", "stall_barrier (Not Issued)"]
# (sass, samples, executed, barrier, long_sb, wait, selected)
SRC_ROWS = [("LDC R1, c[0x0][0x28]", 2, 100, 0, 0, 1, 1),
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR12+0x30808], R18", 1, 6400, 0, 1, 0, 0),
            ("@!P0  BRA 0x7fe9637d7c90", 30, 6400, 0, 30, 0, 0),
            ("HGMMA.64x128x16.F32 R88, gdesc[UR16], RZ, !UPT", 7, 6400, 0, 0, 5, 2),
            ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", 1, 6400, 0, 0, 0, 1),
            ("STS.64 [R5+0x28000], R18", 50, 6400, 49, 0, 0, 1),
            ("MUFU.EX2 R109, R109", 9, 12800, 0, 0, 6, 3),
            ("EXIT", 0, 100, 0, 0, 0, 0)]


def _write_src(path, kernel="flash_bwd_dkdvdq_wgmma", rows=SRC_ROWS):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", kernel, ""])
        w.writerow(SRC_HEADER)
        for i, (sass, n, ex, bar, lsb, wt, sel) in enumerate(rows):
            w.writerow([hex(0x7000 + 16 * i), "      " + sass, n, n - sel, f"{ex:,}", bar, lsb, wt, sel, bar])
    return path


def test_sass_groups_samples_by_opcode_stretch_and_instruction(tmp_path):
    from analysis.profile_ncu import sass_summary

    s = sass_summary(_write_src(tmp_path / "src.csv"), top=3, min_region_pct=0.0)
    total = sum(r[1] for r in SRC_ROWS)
    assert s["kernel"] == "flash_bwd_dkdvdq_wgmma" and s["samples"] == total and s["instructions"] == 8
    assert s["warp_instructions_executed"] == sum(r[2] for r in SRC_ROWS)  # "6,400" read as 6400
    reasons = dict(s["stall_reasons"])
    assert reasons["barrier"] == pytest.approx(100 * 49 / total) and "barrier (Not Issued)" not in reasons
    ops = {o["opcode"]: o for o in s["opcodes"]}
    assert list(ops)[:2] == ["STS", "BRA"]  # the predicate does not hide the branch's opcode
    assert ops["STS"]["top_stalls"][0] == ["barrier", pytest.approx(100 * 49 / total)]
    # stretches: the entry, then one per sync point (mbarrier wait, named barrier, exit)
    regions = s["regions"]
    assert [r["first_instruction"] for r in regions] == [0, 1, 4, 7]
    assert [r["instructions"] for r in regions] == [1, 3, 3, 1]
    assert regions[1]["pct"] == pytest.approx(100 * 38 / total) and regions[1]["executed"] == 6400
    assert regions[2]["top_stalls"][0][0] == "barrier"
    assert sum(r["pct"] for r in regions) == pytest.approx(100)
    assert [h["index"] for h in s["hot"]] == [5, 2, 6]


def test_sass_cli_writes_both_kernels_and_names_the_profiled_tree(tmp_path):
    a = _write_src(tmp_path / "ours.csv")
    b = _write_src(tmp_path / "peer.csv", kernel="cudnn_generated_fort_native_sdpa_sm90_flash_bprop",
                   rows=SRC_ROWS[::-1])
    assert main(["sass", str(a), str(b), "--out", str(tmp_path), "--name", "ps", "--device", "H100",
                 "--commit", "abc1234"]) == 0
    md = (tmp_path / "ps.md").read_text()
    data = json.loads((tmp_path / "ps.json").read_text())
    assert [k["kernel"] for k in data["kernels"]] == ["flash_bwd_dkdvdq_wgmma",
                                                      "cudnn_generated_fort_native_sdpa_sm90_flash_bprop"]
    assert data["git_commit"] == "abc1234" and "git commit abc1234" in md and "Device: H100" in md
    assert md.count("**By stretch after a sync point") == 2 and "`STS.64 [R5+0x28000], R18`" in md
    assert "**Finding:**" in md and "barrier" in data["finding"]


def test_sass_rejects_other_exports(tmp_path):
    from analysis.profile_ncu import sass_summary

    p = tmp_path / "raw.csv"
    p.write_text('"ID","Kernel Name"\n"0","x"\n')
    with pytest.raises(ValueError, match="not an ncu source-page CSV"):
        sass_summary(p)
    q = tmp_path / "nosass.csv"
    q.write_text('"Kernel Name","k"\n"Address","Source"\n"0x1","X"\n')
    with pytest.raises(ValueError, match="missing"):
        sass_summary(q)


def test_index_lists_every_profile_report_of_its_folder(tmp_path):
    """index.md lists the experiments' reports, then every profile*.json that profile_ncu wrote there
    (summarize's and sass's), with their findings; other JSON files are not reports."""
    from analysis.__main__ import rebuild_index

    meta = {"backend": "cuda", "quick": False, "seed": 0, "elapsed_s": 12.0}
    (tmp_path / "accum.json").write_text(json.dumps({"finding": "fp16 accumulators cost 2x", "meta": meta}))
    (tmp_path / "accum.md").write_text("# accum\n")
    _write_src(tmp_path / "src.csv")
    assert main(["sass", str(tmp_path / "src.csv"), "--out", str(tmp_path), "--name", "profile_sass_x",
                 "--commit", "abc1234"]) == 0
    (tmp_path / "profile.json").write_text(json.dumps({"finding": "counters | beside cuDNN"}))
    (tmp_path / "notes.json").write_text(json.dumps({"finding": "not a report"}))
    text = open(rebuild_index(str(tmp_path))).read()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| experiment")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["accum", "profile", "profile_sass_x"]
    assert "counters / beside cuDNN" in rows[1] and "[profile_sass_x.md](profile_sass_x.md)" in rows[2]
    assert "barrier" in rows[2] and "notes" not in text


@pytest.mark.parametrize("argv, match", [(["--cells", "f16:4096"], "dtype:N:D:causal"),
                                         (["--arm", "x:FC_X"], "NAME=INT")])
def test_run_refuses_bad_cells_and_arms_before_profiling(argv, match, capsys):
    with pytest.raises(SystemExit):
        main(["run", *argv])
    assert match in capsys.readouterr().err
