"""Compiling variants: their sources and NVRTC options, the modules memoized per (variant, device), and
the compile check that needs no GPU (PTX, ptxas's resource report, the covering sets of variants).

``compile_report`` works on a machine with no GPU: CuPy's NVRTC bindings need no driver, only the
NVRTC library and the CUDA headers (the ``nvidia-cuda-nvrtc`` and ``nvidia-cuda-runtime`` wheels).
"""
from __future__ import annotations

import functools
import os
import re
import threading

from ._families import ABLATIONS, FAMILIES, FP8_ACCUMULATIONS, FP8_KSCALES, VARLEN_FAMILIES
from ._policy import default_blocks, fp8_block_m
from ._variant import Variant

__all__ = [
    "CHECK_ARCH", "CompileError", "KernelHandle", "compile_options", "compile_report", "covering_variants",
    "get_kernel", "nvrtc_options", "ptx", "source_text", "toolkit_ptxas", "variant_source",
]

_DEFAULT_SMEM_LIMIT = 48 * 1024        # without opting in
CHECK_ARCH = "sm_90"                   # what the CPU compile check targets: the H200's architecture

# --------------------------------------------------------------------------------------------------
# sources and options


@functools.lru_cache(maxsize=None)
def _kernels_dir() -> str:
    """The package's kernel sources: ``flashcupy/kernels_cu`` where flashcupy is installed (the wheel
    maps the checkout's top-level kernels_cu/ there), the checkout's ``kernels_cu/`` beside this
    flashcupy/ otherwise: always the sources of the flashcupy that runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "kernels_cu")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(here), "kernels_cu")


def source_text(filename: str, kernels_dir: str | None = None) -> str:
    """A kernel source (of kernels_cu/, or of ``kernels_dir``) with a ``#line`` prefix so NVRTC errors
    name the real file and line, after a comment with a digest of the folder's headers: CuPy's on-disk
    kernel cache is keyed by the source text and the options, not by the files it includes, so without
    it a changed header would load the cubin compiled before the change."""
    if kernels_dir is None:
        return _package_source(filename)
    # read each time: an experiment edits the folder between calls
    path = os.path.join(kernels_dir, filename)
    with open(path) as f:
        text = f.read()
    return f'// headers {_headers_digest(kernels_dir)}\n#line 1 "{path}"\n{text}'


def _headers_digest(folder: str) -> str:
    import hashlib

    h = hashlib.sha1()
    for name in sorted(os.listdir(folder)):
        if name.endswith((".cuh", ".h")):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _package_source(filename: str) -> str:
    with open(os.path.join(_kernels_dir(), filename)) as f:
        text = f.read()
    return f'// headers {_headers_digest(_kernels_dir())}\n#line 1 "kernels_cu/{filename}"\n' + text


def variant_source(v: Variant) -> str:
    """The source text a variant compiles: its family's, from its Build's folder if it names one."""
    folder = v.build.kernels_dir if v.build else None
    return source_text(v.fam.source) if folder is None else source_text(v.fam.source, folder)


@functools.lru_cache(maxsize=None)
def _cuda_include_dir() -> str | None:
    """Where cuda_fp16.h lives: CuPy's CUDA path (a toolkit or the nvidia-cuda-runtime wheel)."""
    candidates = []
    try:
        import cupy

        path = cupy.cuda.get_cuda_path()
        if path:
            candidates.append(os.path.join(path, "include"))
    except Exception:  # pragma: no cover - CuPy without a CUDA path
        pass
    try:  # the CUDA 13 wheels share nvidia/cu13/include; CUDA 12's runtime wheel has its own folder
        import nvidia

        for base in nvidia.__path__:
            candidates += [os.path.join(base, sub, "include") for sub in ("cu13", "cuda_runtime")]
    except Exception:
        pass
    for c in candidates:
        if os.path.exists(os.path.join(c, "cuda_fp16.h")):
            return c
    return None


def nvrtc_options(defines: dict[str, int], kernels_dir: str | None = None) -> tuple[str, ...]:
    """NVRTC options for a source of kernels_cu/ (or of ``kernels_dir``, whose headers then replace the
    package's) compiled with these -D knobs (the architecture is added by the caller)."""
    opts = ["-std=c++17", f"-I{kernels_dir or _kernels_dir()}"]
    inc = _cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    opts += [f"-D{k}={val}" for k, val in defines.items()]
    return tuple(opts)


def compile_options(v: Variant) -> tuple[str, ...]:
    """NVRTC options for a variant (the architecture is added by the caller)."""
    return nvrtc_options(v.defines(), v.build.kernels_dir if v.build else None)


# --------------------------------------------------------------------------------------------------
# run time: modules memoized per (variant, device)


class KernelHandle:
    """A compiled kernel with its launch geometry, and ``defines``: the -D values its module was
    compiled with (host code that must follow a compile-time switch reads it here)."""

    def __init__(self, variant: Variant, role: str, function, smem_bytes: int, defines: dict[str, int]):
        self.variant = variant
        self.role = role
        self.name = variant.kernel_name(role)
        self.function = function
        self.smem_bytes = smem_bytes
        self.defines = defines
        self.threads = variant.threads
        self.block = (self.threads,)

    def __call__(self, grid, args):
        self.function(grid, self.block, args, shared_mem=self.smem_bytes)


_MODULES: dict = {}                      # (variant, device id) -> {role: KernelHandle}
_MODULE_LOCKS: dict = {}                 # (variant, device id) -> the lock its first build holds
_LOCKS_LOCK = threading.Lock()


def _module_on_device(v: Variant, device_id: int):
    """The variant's kernels on a device, built once per process: threads that ask for the same module
    at once wait for one build (other modules build in parallel)."""
    key = (v, device_id)
    handles = _MODULES.get(key)
    if handles is None:
        with _LOCKS_LOCK:
            lock = _MODULE_LOCKS.setdefault(key, threading.Lock())
        with lock:
            handles = _MODULES.get(key)
            if handles is None:
                handles = _MODULES[key] = _build_module(v, device_id)
    return handles


def _build_module(v: Variant, device_id: int):
    import cupy

    dev = cupy.cuda.Device(device_id)
    limit = dev.attributes.get("MaxSharedMemoryPerBlockOptin", _DEFAULT_SMEM_LIMIT)
    defines = v.defines()
    # each kernel's dynamic shared memory as compiled: the variant's, unless its Build replaced it
    smem_of = {role: defines[f"FC_SMEM_{role.upper()}"] for role in v.roles}
    if max(smem_of.values()) > limit:
        raise ValueError(f"{v.key} needs {max(smem_of.values())} bytes of shared memory per block; this "
                         f"device allows {limit}. Choose smaller block_m/block_n.")
    # The architecture: CuPy appends the device's own -arch; a family that names one (wgmma: sm_90a)
    # passes it here, and an explicit -arch overrides CuPy's.
    arch = (f"-arch={v.fam.arch}",) if v.fam.arch else ()
    module = cupy.RawModule(code=variant_source(v), options=compile_options(v) + arch)
    handles = {}
    for role in v.roles:
        fn = module.get_function(v.kernel_name(role))
        smem = smem_of[role]
        if smem > _DEFAULT_SMEM_LIMIT:
            fn.max_dynamic_shared_size_bytes = smem
        handles[role] = KernelHandle(v, role, fn, smem, defines)
    return handles


def get_kernel(v: Variant, role: str | None = None) -> KernelHandle:
    """A compiled kernel of ``v`` on the current device (the module is compiled once per process and
    device); ``role`` picks one of the family's kernels ("fwd"; "prep", "dkdv", "dq", ...; default: the
    first)."""
    import cupy

    handles = _module_on_device(v, cupy.cuda.Device().id)
    return handles[role or v.roles[0]]


# --------------------------------------------------------------------------------------------------
# compile check without a GPU

_PTXAS_LINE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem_static": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


class CompileError(RuntimeError):
    pass


# The options cupy.RawModule appends to every NVRTC compile (CuPy 14, non-jitify): subnormals flushed, and
# unannotated functions compiled as __device__ (NVRTC 13.0 rejects a generic lambda in a kernel without
# it; 13.5 accepts it). The compile check adds them too, so that it compiles the code that runs.
RAWMODULE_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def _nvrtc():
    """CuPy's NVRTC binding (no GPU needed), or ImportError saying what to install."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise ImportError("compiling a kernel variant needs CuPy and its NVRTC (pip install "
                          "'flashcupy[cuda13]' or '[cuda12]'; no GPU needed)") from e
    return nvrtc


def _nvrtc_log(variant: Variant, arch: str) -> str:
    """NVRTC's log of one variant, with ptxas's -v resource report."""
    nvrtc = _nvrtc()

    prog = nvrtc.createProgram(variant_source(variant), variant.fam.source, [], [])
    opts = list(compile_options(variant)) + [f"-arch={arch}", *RAWMODULE_OPTIONS, "--ptxas-options=-v"]
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{variant.key}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _nvrtc_log_fresh_process(variant: Variant, arch: str) -> str:
    """``_nvrtc_log`` in a new Python process with NVRTC's compile cache off (CUDA_CACHE_DISABLE=1), so
    that ptxas runs and reports (see ``compile_report``). Returns "" if that process fails."""
    import pickle
    import subprocess
    import sys

    code = ("import pickle, sys; from flashcupy._compile import _nvrtc_log; "
            "sys.stdout.write(_nvrtc_log(*pickle.loads(sys.stdin.buffer.read())))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "CUDA_CACHE_DISABLE": "1"}
    try:
        res = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((variant, arch)),
                             capture_output=True, env=env, timeout=900)
    except (subprocess.SubprocessError, OSError):
        return ""
    return res.stdout.decode(errors="replace") if res.returncode == 0 else ""


def ptx(variant: Variant, arch: str | None = None) -> str:
    """The variant's PTX as NVRTC builds it (no GPU needed), for the CUDA toolkit's ptxas and cuobjdump:
    the cubin bytes of CuPy's NVRTC binding can come back truncated, and NVRTC's log can be empty."""
    nvrtc = _nvrtc()

    prog = nvrtc.createProgram(variant_source(variant), variant.fam.source, [], [])
    arch = arch or variant.fam.arch or CHECK_ARCH
    opts = list(compile_options(variant)) + [f"-arch={arch}", *RAWMODULE_OPTIONS]
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{variant.key}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        out = nvrtc.getPTX(prog)
        return out.decode() if isinstance(out, bytes) else out
    finally:
        nvrtc.destroyProgram(prog)


def toolkit_ptxas(ptx_text: str, arch: str, cubin: str):
    """``ptxas -v`` of the CUDA toolkit on PTX text, writing ``cubin``: the CompletedProcess, or None when
    no ptxas is on PATH. A toolkit older than NVRTC refuses the text's ``.version`` ("current version is
    'X'"); the text is then assembled once more at version X (the kernels use no newer PTX feature, and
    ptxas says so if one does)."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx_text)
            res = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", cubin], capture_output=True,
                                 text=True)
            older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", res.stderr)
            if res.returncode == 0 or not older:
                break
            ptx_text = re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", ptx_text, count=1,
                              flags=re.M)
    return res


def _toolkit_ptxas_log(variant: Variant, arch: str) -> str | None:
    """ptxas -v's report of the variant's NVRTC PTX through the CUDA toolkit's ptxas, or None when no
    ptxas is on PATH or it does not assemble this PTX."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = toolkit_ptxas(ptx(variant, arch), arch, os.path.join(tmp, "k.cubin"))
    return res.stdout + res.stderr if res is not None and res.returncode == 0 else None


def compile_report(variant: Variant, arch: str | None = None) -> dict:
    """Compile one variant to a cubin with NVRTC (no GPU needed) and read ptxas's resource report.

    Returns a dict with key, registers, smem_static, smem_dynamic, stack, spill_stores, spill_loads (the
    worst over the module's kernels; per kernel under "kernels") and ptxas's warning lines.
    Raises CompileError with the NVRTC log on failure.
    """
    arch = arch or variant.fam.arch or CHECK_ARCH
    log = _nvrtc_log(variant, arch)
    if "Function properties for" not in log:
        # NVRTC >= 12.9 keeps compiled cubins in the CUDA compute cache on disk (shared by processes); a
        # compile served from it never runs ptxas, so the log holds no -v report (measured on the H200
        # machine, NVRTC 13.0: three identical compiles of a one-line kernel log 306, 0, 0 bytes;
        # NVIDIA/cuda-python#1124 describes the same). The report is compiled again in a fresh process
        # with CUDA_CACHE_DISABLE=1; the toolkit's ptxas on NVRTC's PTX is the last resort.
        fresh = _nvrtc_log_fresh_process(variant, arch)
        log = fresh if "Function properties for" in fresh else (_toolkit_ptxas_log(variant, arch) or log)
    # ptxas reports each entry function in turn; a backward source holds several. Per kernel:
    defines = variant.defines()
    rep = {"key": variant.key, "threads": variant.threads, "kernels": {}}
    for role in variant.roles:
        name = variant.kernel_name(role)
        i = log.find(f"Function properties for {name}")
        if i < 0:
            raise CompileError(f"{variant.key}: ptxas reported no resources for {name}; "
                               f"NVRTC log:\n{log[:2000]}")
        section = log[i:]
        j = section.find("Compiling entry function", 1)
        section = section[:j] if j > 0 else section
        krep = {}
        for field, rx in _PTXAS_LINE.items():
            m = rx.search(section)
            krep[field] = int(m.group(1)) if m else 0
        krep["smem_dynamic"] = defines[f"FC_SMEM_{role.upper()}"]
        rep["kernels"][name] = krep
    # ptxas warnings, and the "Potential Performance Loss" notes (C75xx, printed as info lines) that
    # silently serialize wgmma (C7515, C7513, C7511) or ignore setmaxnreg (C7508)
    rep["warnings"] = [line.strip() for line in log.splitlines()
                       if "warning" in line.lower() or re.search(r"\bC75\d\d\b", line)]
    # summary over the kernels: the worst of each
    for field in list(_PTXAS_LINE) + ["smem_dynamic"]:
        rep[field] = max(k[field] for k in rep["kernels"].values())
    return rep


def covering_variants(family: str) -> list[Variant]:
    """A covering set for the compile check: every value of every knob at least once, and the pairs
    dtype x accum, block_m x block_n, causal x ablate, window x ablate, softcap x dtype x accum,
    alibi x dtype x accum, varlen x dtype x accum and (fwd_wgmma) paged x dtype in full (variants that
    do not fit in shared memory are left out)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    fam = FAMILIES[family]
    head_dims = (8, 32, 40, 64, 96, 128, 256)
    base = dict(family=family, dtype=fam.dtypes[0], accum="fp32", head_dim=64, causal=False,
                ablate=None)
    base["block_m"], base["block_n"] = default_blocks(family, fam.dtypes[0], 64, "fp32", False)
    out: dict[str, Variant] = {}

    def add(**kw):
        args = {**base, **kw}
        if "block_m" not in kw:  # the default tile of this dtype, head dim, accumulator and mask
            args["block_m"], args["block_n"] = default_blocks(family, args["dtype"], args["head_dim"],
                                                              args["accum"], args["causal"],
                                                              softcap=bool(args.get("softcap")))
        try:
            v = Variant(**args)
        except ValueError:  # outside the family's limits
            return
        if v.fits():
            out.setdefault(v.key, v)

    for dt in fam.dtypes:
        for acc in fam.accums(dt):
            add(dtype=dt, accum=acc)
    for bm in fam.block_m:
        for bn in fam.block_n:
            add(block_m=bm, block_n=bn)
    for d in head_dims:
        add(head_dim=d)
    for causal in (False, True):
        for ab in ABLATIONS:
            add(causal=causal, ablate=ab)
    # the widest head dim with the largest tiles that fit, in every dtype
    for dt in fam.dtypes:
        add(dtype=dt, head_dim=256, causal=True)
    # the Hopper family's register budget depends on the tile and D together: every tile at D=128,
    # causal, with each break
    if fam.kind == "wgmma":
        for bm in fam.block_m:
            for bn in fam.block_n:
                for ab in ABLATIONS:
                    add(block_m=bm, block_n=bn, head_dim=128, causal=True, ablate=ab)
    # the tile loops at D=128 for short sequences (wgmma_schedule): the dynamic scheduler with a causal
    # mask, the static split without, on every tile they run on, with each break, and fp16 accumulators
    if family == "fwd_wgmma":
        for bm in (64, 128):
            for bn in (64, 128, 176):
                for ab in ABLATIONS:
                    if bn <= 128:
                        add(block_m=bm, block_n=bn, head_dim=128, causal=True, ablate=ab, schedule="dynamic")
                    add(block_m=bm, block_n=bn, head_dim=128, ablate=ab, schedule="static")
        add(head_dim=128, causal=True, accum="fp16", schedule="dynamic")
        add(head_dim=128, accum="fp16", schedule="static")
    # sliding windows (FC_WINDOW): a left reach only, a right reach only, both (with each break), and
    # a causal window at D=128
    for window in ((37, -1), (-1, 21)):
        add(window=window)
    for ab in ABLATIONS:
        add(window=(64, 64), ablate=ab)
    add(head_dim=128, window=(128, 0))
    # the softcap (FC_SCORE_HOOK 2): every dtype x accumulator (so both tanh), D = 128 causal, each break,
    # and with a window
    for dt in fam.dtypes:
        for acc in fam.accums(dt):
            add(dtype=dt, accum=acc, softcap=30.0)
    add(head_dim=128, causal=True, softcap=30.0)
    for ab in ABLATIONS[1:]:
        add(softcap=30.0, ablate=ab)
    add(window=(64, 64), softcap=30.0)
    # ALiBi (FC_ALIBI): every dtype x accumulator, D = 128 causal (with the softcap too), a window, and
    # the static and dynamic tile loops of fwd_wgmma (whose tiles change heads)
    for dt in fam.dtypes:
        for acc in fam.accums(dt):
            add(dtype=dt, accum=acc, alibi=True)
    add(head_dim=128, causal=True, alibi=True)
    add(head_dim=128, causal=True, softcap=30.0, alibi=True)
    add(window=(64, 64), alibi=True)
    if family == "fwd_wgmma":
        add(head_dim=128, causal=True, alibi=True, schedule="dynamic")
        add(head_dim=128, alibi=True, schedule="static")
    # packed sequences (FC_VARLEN, VARLEN_FAMILIES): every dtype x accumulator, causal at D = 128, a
    # window with the softcap and ALiBi, and fwd_wgmma's tile loops (whose tiles change sequences)
    if family in VARLEN_FAMILIES:
        for dt in fam.dtypes:
            for acc in fam.accums(dt):
                add(dtype=dt, accum=acc, varlen=True)
        add(head_dim=128, causal=True, varlen=True)
        add(window=(64, 64), softcap=30.0, alibi=True, varlen=True)
        if family == "fwd_wgmma":
            add(head_dim=128, causal=True, schedule="dynamic", varlen=True)
            add(head_dim=128, block_m=128, block_n=128, schedule="static", varlen=True)
            # a paged cache read in place (FC_PAGED): every dtype on the decoding tile at D = 128, the
            # 128-row tile with the softcap, and the dynamic tile loop with 64-key tiles
            for dt in fam.dtypes:
                add(dtype=dt, head_dim=128, block_m=64, block_n=128, varlen=True, paged=True)
            add(head_dim=128, block_m=128, block_n=128, varlen=True, paged=True, softcap=30.0)
            add(head_dim=128, block_m=64, block_n=64, causal=True, schedule="dynamic", varlen=True,
                paged=True)
        if family == "bwd_wgmma":  # (its other tiles: dQ by columns, one consumer, dQ formed transposed)
            add(head_dim=128, block_m=64, block_n=128, causal=True, varlen=True)
            add(block_m=64, block_n=64, varlen=True)
            add(head_dim=128, block_m=80, block_n=128, varlen=True)
    # fp8 (fwd_wgmma): every accumulation x k-descale x causal on its default tile, the 64- and 128-row
    # tiles, and the breaks
    if family == "fwd_wgmma":
        for acc in FP8_ACCUMULATIONS:
            for ks in FP8_KSCALES:
                for causal in (False, True):
                    add(head_dim=128, block_m=fp8_block_m(acc, 128), block_n=128, causal=causal, fp8=acc,
                        fp8_kscale=ks)
            for bm in (64, 128):
                add(head_dim=128, block_m=bm, block_n=128, causal=True, fp8=acc)
            for ab in ABLATIONS[1:]:
                add(head_dim=128, block_m=fp8_block_m(acc, 128), block_n=128, causal=True, fp8=acc, ablate=ab)
        for causal in (False, True):
            for ks in FP8_KSCALES:
                add(head_dim=256, block_m=128, block_n=128, causal=causal, fp8="single", fp8_kscale=ks)
        for acc in FP8_ACCUMULATIONS:
            add(head_dim=128, block_m=fp8_block_m(acc, 128), block_n=128, fp8=acc, window=(200, 0))
        # the softcap on fp8 operands: each accumulation x k-descale (the per-tile descale taken element by
        # element there), and D = 256
        for acc in FP8_ACCUMULATIONS:
            for ks in FP8_KSCALES:
                add(head_dim=128, block_m=fp8_block_m(acc, 128, True), block_n=128, causal=True, fp8=acc,
                    fp8_kscale=ks, softcap=30.0)
        add(head_dim=256, block_m=128, block_n=128, fp8="single", fp8_kscale="key", softcap=30.0)
    return list(out.values())
