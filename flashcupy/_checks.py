"""Argument checking shared by every backend (CUDA kernels and the NumPy twin).

Everything a user can get wrong raises here, before any array is allocated or any kernel is built:
``TypeError`` for the wrong kind of object or dtype, ``ValueError`` for a wrong value or shape, each
naming the argument and what is allowed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

import numpy as np

from ._families import (
    ABLATIONS,
    ACCUMS,
    FAMILIES,
    SMEM_LIMIT,
    TWIN_ABLATIONS,
    WGMMA_BWD_HEAD_DIMS,
    WGMMA_HEAD_DIMS,
)
from ._policy import auto_family, default_tile, wgmma_schedule
from ._variant import Variant, current_build
from .reference import check_softcap, check_window

KERNELS = ("auto", "mma", "simt", "wgmma")
_GRID_YZ_MAX = 65535


def dtype_name(dtype) -> str | None:
    """'f16', 'bf16' or 'f32' for the supported element types, else None."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "f16"
    if dtype == np.float32:
        return "f32"
    if dtype.name == "bfloat16":
        return "bf16"
    return None


def numpy_dtype(name: str):
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"f16": np.float16, "f32": np.float32}[name])


@dataclasses.dataclass(frozen=True)
class Problem:
    """A checked forward problem: shapes, knobs and the variant that computes it."""

    backend: str            # "cuda" or "numpy"
    batch: int
    heads_q: int
    heads_kv: int
    nq: int
    nk: int
    head_dim: int
    scale: float
    variant: Variant
    device: int = -1        # the CUDA device that holds the arrays (-1: NumPy)
    # a break the twin runs and no kernel compiles (_families.TWIN_ABLATIONS; NumPy inputs only): the
    # variant, which names a kernel, stays intact
    twin_ablate: str | None = None
    # packed sequences (the variant's varlen: flashcupy.attention_varlen): the packed lengths of q and of
    # k, v; batch is then the number of sequences and nq, nk the longest one's lengths (0: not packed)
    total_q: int = 0
    total_k: int = 0
    # a paged variant's page size (the rows of k, v per page; 0: not paged)
    page: int = 0
    # an fp8 variant's static scale of P before its e4m3 rounding (flashcupy.attention_fp8; 0: not fp8)
    p_scale: float = 0.0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def _backend_of(name: str, x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    try:
        import cupy
    except ImportError:  # pragma: no cover - cupy is a dependency
        cupy = None
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cuda"
    raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


# The accepted range of ``scale``. Every family folds scale * log2(e) into one float32 factor c and
# computes P = exp2(fma(S, c, -m c)) from raw scores S and their running max m. Below 2^-126 / log2(e)
# c flushes to zero under -ftz (then -inf * 0 = NaN in the first rescale); at the top, the exponent
# S c is held in float32, whose rounding (up to 2^-25 |S c|, with nothing to cancel it inside the fma)
# becomes P's relative error: 2^20 keeps it below 2^-5, and 2^31 makes P infinite. 2^12 keeps
# unit-variance inputs (|q.k| below about 100 at any D up to 256) under 2^20; larger inputs need a
# smaller scale by the same margin (the guarantee is on |scale q.k|, stated in the README).
SCALE_RANGE = (2.0 ** -64, 2.0 ** 12)


def check_scale(scale, d: int) -> float:
    """The score scale as a float: 1/sqrt(d) for None; TypeError unless a real number, ValueError
    unless finite and inside ``SCALE_RANGE`` (see there)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    lo, hi = SCALE_RANGE
    if not lo <= scale <= hi:
        why = ("the kernels fold scale * log2(e) into one float32 factor, which flushes to zero below about "
               "8e-39; 2^-64 keeps a wide margin above that" if scale < lo else
               "above it the float32 exponent scale * q.k * log2(e) of ordinary scores rounds by more than "
               "the softmax tolerates")
        raise ValueError(f"scale must lie in [2^-64, 2^12] = [{lo!r}, {hi!r}], got {scale!r}: {why}")
    return scale


# The softcaps the kernels run: cap tanh(S / cap) is computed as (cap / scale) tanh((scale / cap) s) on raw
# scores s, both factors float32; with the scale in SCALE_RANGE, this range keeps both normal floats
SOFTCAP_RANGE = (2.0 ** -16, 2.0 ** 32)


def check_kernel_softcap(softcap) -> float:
    """``softcap`` as a call's problem holds it: ``reference.check_softcap``, then 0.0 (off) or a value
    inside ``SOFTCAP_RANGE`` (ValueError naming the range)."""
    softcap = check_softcap(softcap)
    lo, hi = SOFTCAP_RANGE
    if softcap and not lo <= softcap <= hi:
        raise ValueError(f"softcap must be 0 (off) or lie in [2^-16, 2^32] = [{lo!r}, {hi!r}], got "
                         f"{softcap!r}: the kernels compute (cap / scale) tanh(scale s / cap) with both "
                         "factors in float32")
    return softcap


def check_tile(name: str, value, allowed=None):
    """A tile-size knob (block_m, block_n): None, or an int (a Python or NumPy integer, not a bool or a
    float: ``128.0`` would reach the compiler as a define) among ``allowed`` when given. TypeError for
    another type, ValueError for a value outside ``allowed``; returns the value as an int (or None)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value}")
    return int(value)


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def window_of(window_size, causal: bool, nq: int, nk: int) -> tuple[bool, tuple[int, int] | None]:
    """The mask a call asks for (``causal`` and ``window_size``, checked) in the one form a Variant holds
    it, (causal, window): a causal window (left, right) is the window (left, 0) (flash_attn_func's rule);
    a side that reaches past every key of every row of this Nq x Nk problem is unbounded (-1: left >=
    Nk - 1, right >= Nq - 1); then the window (-1, 0) is causal=True and (-1, -1) no window. Equal
    masks compile one module, and a window wider than the problem runs the kernel without one."""
    if window_size is None:
        return causal, None
    left, right = check_window(window_size)
    if (left, right) == (-1, -1):
        return causal, None
    right = 0 if causal else right
    left = -1 if left >= nk - 1 else left
    right = -1 if right >= nq - 1 else right  # (Nq = 1: a causal window reaches every key on the right)
    if right == -1 and left == -1:
        return False, None
    if (left, right) == (-1, 0):
        return True, None
    return False, (left, right)


def check_forward(q, k, v, *, causal, scale, block_m, block_n, accum, kernel, ablate,
                  window_size=None, softcap=0.0, alibi: bool = False, direction: str = "fwd") -> Problem:
    """Validate the arguments of ``flashcupy.attention`` (``direction="bwd"``: the q, k, v part of
    ``flashcupy.attention_backward``) and resolve defaults."""
    arrays = {"q": q, "k": k, "v": v}
    backends = {name: _backend_of(name, x) for name, x in arrays.items()}
    if len(set(backends.values())) > 1:
        raise TypeError("q, k, v must all be NumPy arrays (NumPy twin) or all CuPy arrays (CUDA "
                        f"kernels); got {', '.join(f'{n}: {b}' for n, b in backends.items())}")
    backend = backends["q"]
    device = _common_device(arrays) if backend == "cuda" else -1

    for name, x in arrays.items():
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D); got shape {tuple(x.shape)}")
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError("q, k, v must have the same dtype; got "
                        + ", ".join(f"{n}: {d}" for n, d in dtypes.items()))
    dname = dtype_name(q.dtype)
    if dname is None:
        raise TypeError(f"q, k, v dtype must be float16, bfloat16 or float32; got {q.dtype}")

    b, hq, nq, d = q.shape
    bk, hkv, nk, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if bk != b:
        raise ValueError(f"batch size of k/v ({bk}) differs from q's ({b})")
    if dk != d:
        raise ValueError(f"head dim of k/v ({dk}) differs from q's ({d})")
    if min(b, hq, hkv) < 1:
        raise ValueError(f"batch and head counts must be >= 1; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if nq < 1 or nk < 1:
        raise ValueError(f"empty sequence: Nq={nq}, Nk={nk}; both must be >= 1")
    if hq % hkv:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of the number of key/value "
                         f"heads ({hkv})")
    if d % 8 or not 8 <= d <= 256:
        raise ValueError(f"head dim D must be a multiple of 8 from 8 to 256; got {d}")
    if b > _GRID_YZ_MAX or hq > _GRID_YZ_MAX:
        raise ValueError(f"batch ({b}) and query heads ({hq}) must each be <= {_GRID_YZ_MAX}")

    _check_bool("causal", causal)
    scale = check_scale(scale, d)
    _check_choice("accum", accum, ACCUMS)
    _check_choice("kernel", kernel, KERNELS)
    _check_choice("ablate", ablate, ABLATIONS + TWIN_ABLATIONS)
    if ablate in TWIN_ABLATIONS and backend == "cuda":
        raise ValueError(f"ablate={ablate!r} runs on NumPy inputs (the twin) only; no kernel compiles it")
    block_m, block_n = check_tile("block_m", block_m), check_tile("block_n", block_n)
    causal, window = window_of(window_size, bool(causal), nq, nk)
    softcap = check_kernel_softcap(softcap)

    family = resolve_family(kernel, dname, accum, direction, head_dim=d, block_m=block_m, block_n=block_n,
                            causal=causal, backend=backend, device=device, softcap=softcap, alibi=alibi)
    fam = FAMILIES[family]
    bm, bn = default_tile(family, dname, d, accum, causal, block_m, block_n, n=nq, softcap=softcap)
    for name, val, allowed in (("block_m", bm, fam.block_m), ("block_n", bn, fam.block_n)):
        if val not in allowed:
            which = (f"kernel={fam.kind!r}" if kernel != "auto" else
                     f"kernel='auto' (resolved to {fam.kind!r})")
            raise ValueError(f"{name}={val} is not supported by {which}; "
                             f"supported: {allowed}")
    schedule = wgmma_schedule(d, bool(causal), nq, (bm, bn)) if family == "fwd_wgmma" else None
    twin_ablate = ablate if ablate in TWIN_ABLATIONS else None
    if twin_ablate == "softcap_after_mask" and not softcap:
        raise ValueError(f"ablate={ablate!r} breaks the softcap: it needs softcap > 0")
    if twin_ablate == "alibi_unshifted" and not alibi:
        raise ValueError(f"ablate={ablate!r} measures ALiBi from i' itself: it needs alibi_slopes")
    variant = Variant(family, dname, accum, int(bm), int(bn), d, causal, None if twin_ablate else ablate,
                      schedule=schedule, window=window, softcap=softcap, alibi=alibi)
    if not variant.fits():
        raise ValueError(f"block_m={bm}, block_n={bn} with D={d} in {dname} needs "
                         f"{variant.smem_bytes} bytes of shared memory in {family}; the limit is "
                         f"{SMEM_LIMIT}. Choose smaller blocks.")
    return Problem(backend, b, hq, hkv, nq, nk, d, scale, variant, device, twin_ablate)


def check_alibi_slopes(slopes, batch: int, heads_q: int, like):
    """ALiBi slopes of a call on CuPy arrays (``like``: q): a float array of shape (Hq,) or (B, Hq), NumPy
    (checked finite, then copied to q's GPU) or CuPy on q's GPU (its values are not read: that would
    synchronize); returned as a CuPy array in its own float dtype, which ``_launch.alibi_raw`` divides
    by the scale in float64. ValueError/TypeError name ``alibi_slopes`` before any launch."""
    if isinstance(slopes, (list, tuple)):
        slopes = np.asarray(slopes)
    if not (isinstance(slopes, np.ndarray) or type(slopes).__module__.split(".")[0] == "cupy"):
        raise TypeError(f"alibi_slopes must be a NumPy or CuPy array, got {type(slopes).__name__}")
    if slopes.shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({heads_q},) or (B, Hq) = ({batch}, "
                         f"{heads_q}); got {tuple(slopes.shape)}")
    if slopes.dtype.kind != "f" or slopes.dtype.itemsize < 4:
        raise TypeError(f"alibi_slopes must be float32 or float64, got {slopes.dtype}")
    if isinstance(slopes, np.ndarray):
        if not np.isfinite(slopes).all():
            raise ValueError("alibi_slopes must be finite")
        import cupy

        with cupy.cuda.Device(like.data.device_id):
            return cupy.asarray(slopes)
    if slopes.data.device_id != like.data.device_id:
        raise ValueError(f"alibi_slopes is on GPU {slopes.data.device_id} but q on GPU {like.data.device_id}")
    return slopes


def _common_device(arrays: dict) -> int:
    """The id of the GPU that holds every array of ``arrays`` (name -> CuPy array); ValueError naming
    the devices when they differ (a kernel reads all of them from one device)."""
    devices = {name: x.data.device_id for name, x in arrays.items()}
    if len(set(devices.values())) > 1:
        raise ValueError("the arrays must live on one GPU; got "
                         + ", ".join(f"{n} on device {d}" for n, d in devices.items()))
    return next(iter(devices.values()))


def _device_capability(device: int | None = None) -> int:
    """Compute capability of a CUDA device (default: the current one) as an int (90 for Hopper)."""
    import cupy

    return _capability_of(cupy.cuda.runtime.getDevice() if device is None else device)


@functools.lru_cache(maxsize=None)
def _capability_of(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def _wgmma_problem(dname: str, accum: str, direction: str, head_dim: int | None) -> str | None:
    """Why the wgmma family cannot run this call (None: it can, device aside)."""
    wgmma = FAMILIES[f"{direction}_wgmma"]
    if dname not in wgmma.dtypes:
        return (f"kernel='wgmma' runs float16 and bfloat16 inputs; {dname} inputs run on kernel='simt' "
                "(or kernel='auto')")
    if accum not in wgmma.accums(dname):
        if direction == "bwd":
            return ("kernel='wgmma' backward supports accum='fp32' only; accum='fp16' runs on kernel='mma' "
                    "(float16) or kernel='simt' (kernel='auto' picks mma)")
        return ("kernel='wgmma' with bfloat16 inputs supports accum='fp32' only (wgmma has no bf16 form "
                "with f16 accumulators); use kernel='simt' for accum='fp16'")
    dims = WGMMA_HEAD_DIMS if direction == "fwd" else WGMMA_BWD_HEAD_DIMS
    if head_dim is not None and head_dim not in dims:
        return (f"kernel='wgmma' {'forward' if direction == 'fwd' else 'backward'} runs head dims {dims}; "
                f"D={head_dim} runs on kernel='mma' (float16/bfloat16) or kernel='simt' (every multiple of 8 "
                "up to 256)")
    return None


def resolve_family(kernel: str, dname: str, accum: str, direction: str = "fwd", *,
                   head_dim: int | None = None, block_m=None, block_n=None, causal: bool = False,
                   backend: str = "numpy", device: int | None = None, softcap: float = 0.0,
                   alibi: bool = False) -> str:
    """Which family computes this call.

    kernel='auto' picks 'wgmma' on a Hopper GPU (compute capability 9.0) where that family has the
    variant (float16/bfloat16, fp32 accumulators in the backward, its head dims, the requested tile
    among its tiles), else 'mma' where tensor cores apply, else 'simt' (``_policy.auto_family``).
    kernel='wgmma' on another GPU raises ValueError.
    ``device`` is the GPU that holds the arrays (None: the current one).
    """
    if device is not None and device < 0:
        device = None
    mma = FAMILIES[f"{direction}_mma"]
    if kernel == "wgmma":
        problem = _wgmma_problem(dname, accum, direction, head_dim)
        if problem:
            raise ValueError(problem)
        if backend == "cuda" and _device_capability(device) != 90:
            raise ValueError(f"kernel='wgmma' needs a Hopper GPU (compute capability 9.0, sm_90a); "
                             f"this device has compute capability {_device_capability(device)}. "
                             f"Use kernel='mma' or 'auto'")
        return f"{direction}_wgmma"
    if kernel == "mma":
        if dname not in mma.dtypes:
            raise ValueError(f"kernel='mma' runs float16 and bfloat16 inputs; {dname} inputs run on "
                             "kernel='simt' (or kernel='auto')")
        if accum not in mma.accums(dname):
            raise ValueError("kernel='mma' with bfloat16 inputs supports accum='fp32' only (mma.sync has "
                             "no bf16 form with f16 accumulators); use kernel='simt' for accum='fp16'")
        return mma.name
    if kernel == "simt":
        return f"{direction}_simt"
    hopper = (backend == "cuda" and _wgmma_problem(dname, accum, direction, head_dim) is None
              and _device_capability(device) == 90)
    return auto_family(direction, dname, accum, head_dim, block_m, block_n, causal, hopper=hopper,
                       softcap=softcap, alibi=alibi)


def check_backward(do, q, k, v, o, lse, *, causal, scale, block_m, block_n, accum, kernel,
                   deterministic, dlse=None, window_size=None, softcap=0.0, alibi: bool = False) -> Problem:
    """Validate the arguments of ``flashcupy.attention_backward`` and resolve defaults."""
    p = check_forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                      accum=accum, kernel=kernel, ablate=None, window_size=window_size, softcap=softcap,
                      alibi=alibi, direction="bwd")
    _check_bool("deterministic", deterministic)
    for name, x in (("do", do), ("o", o), ("lse", lse)):
        if _backend_of(name, x) != p.backend:
            raise TypeError(f"{name} must be a {'CuPy' if p.backend == 'cuda' else 'NumPy'} array like q")
    if dlse is not None and _backend_of("dlse", dlse) != p.backend:
        raise TypeError(f"dlse must be None or a {'CuPy' if p.backend == 'cuda' else 'NumPy'} array like q")
    if p.backend == "cuda":
        _common_device({"q": q, "k": k, "v": v, "do": do, "o": o, "lse": lse,
                        **({} if dlse is None else {"dlse": dlse})})
    for name, x in (("do", do), ("o", o)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}; got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
    want = (p.batch, p.heads_q, p.nq)
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (B, Hq, Nq) = {want}; got {tuple(lse.shape)}")
    if lse.dtype != np.float32:
        raise TypeError(f"lse must be float32 (as attention(..., return_lse=True) returns it); "
                        f"got {lse.dtype}")
    if dlse is not None:
        if tuple(dlse.shape) != want:
            raise ValueError(f"dlse must have lse's shape (B, Hq, Nq) = {want}; got {tuple(dlse.shape)}")
        if dlse.dtype != np.float32:
            raise TypeError(f"dlse must be float32 like lse; got {dlse.dtype}")
    return p


# --------------------------------------------------------------------------------------------------
# memoized checks: a call whose arrays and knobs describe the same problem as an earlier call gets the
# earlier Problem without checking again


_MEMO: dict = {}
_MEMO_LIMIT = 4096  # distinct problems remembered; past that the memo starts over


def _array_key(x):
    """What the checks read of an array: its type, shape, strides, dtype and (CuPy) device; None for
    an object that is neither a NumPy nor a CuPy array (never memoized: the checks reject it)."""
    if type(x) is np.ndarray:
        return (np.ndarray, x.shape, x.strides, x.dtype)
    data = getattr(x, "data", None)
    device = getattr(data, "device_id", None)
    if device is None:
        return None
    return (type(x), x.shape, x.strides, x.dtype, device)


def _memoized(check, arrays: tuple, knobs: tuple, kwargs: dict) -> Problem:
    """``check(*arrays, **kwargs)``, remembered under what the checks read: every array's type, shape,
    strides, dtype and device, every knob's value *and type* (so ``causal=1`` is still refused after
    ``causal=True`` passed), and the enclosing ``kernel_build`` (its variants are others). The checks
    are a function of exactly these, so a remembered Problem is the one a fresh check would return; a
    call that raises is not remembered. The GPU's compute capability enters through the device id."""
    try:
        key = (check, current_build() or (), *map(_array_key, arrays), knobs, tuple(map(type, knobs)))
        problem = _MEMO.get(key)
    except TypeError:  # an unhashable knob: the checks will say what is allowed
        return check(*arrays, **kwargs)
    if problem is None or None in key:
        problem = check(*arrays, **kwargs)
        if None not in key:
            if len(_MEMO) >= _MEMO_LIMIT:
                _MEMO.clear()
            _MEMO[key] = problem
    return problem


def _knobs(kwargs: dict) -> tuple:
    """The memo's knobs: the values, and the window's entries' types (``(True, 3)`` equals ``(1, 3)``)."""
    window = kwargs["window_size"]
    return (*kwargs.values(), tuple(map(type, window)) if isinstance(window, tuple) else type(window))


def forward_problem(q, k, v, *, causal, scale, block_m, block_n, accum, kernel, ablate,
                    window_size=None, softcap=0.0, alibi: bool = False) -> Problem:
    """``check_forward`` memoized (see ``_memoized``): what ``flashcupy.attention`` calls."""
    kwargs = dict(causal=causal, scale=scale, block_m=block_m, block_n=block_n, accum=accum, kernel=kernel,
                  ablate=ablate, window_size=window_size, softcap=softcap, alibi=alibi)
    return _memoized(check_forward, (q, k, v), _knobs(kwargs), kwargs)


def backward_problem(do, q, k, v, o, lse, *, causal, scale, block_m, block_n, accum, kernel,
                     deterministic, dlse=None, window_size=None, softcap=0.0, alibi: bool = False) -> Problem:
    """``check_backward`` memoized (see ``_memoized``): what ``flashcupy.attention_backward`` calls."""
    kwargs = dict(causal=causal, scale=scale, block_m=block_m, block_n=block_n, accum=accum, kernel=kernel,
                  deterministic=deterministic, window_size=window_size, softcap=softcap, alibi=alibi)
    if dlse is not None:  # rare: checked every time
        return check_backward(do, q, k, v, o, lse, dlse=dlse, **kwargs)
    return _memoized(check_backward, (do, q, k, v, o, lse), _knobs(kwargs), kwargs)


# --------------------------------------------------------------------------------------------------
# the backward's contract: o and lse from a forward with the same score function

_LSE_ORIGINS: dict = {}  # id(lse) -> (a weak reference to it, the forward's score function)


def _score_function(p: Problem) -> dict:
    """What P = exp(t(scale q k^T) - lse) depends on besides q and k: the knobs a backward must share with
    the forward that made its lse."""
    v = p.variant
    mask = f"window {v.window}" if v.window else ("causal" if v.causal else "none")  # (as resolved)
    return {"scale": p.scale, "mask": mask, "softcap": v.softcap,
            "alibi_slopes": "given" if v.alibi else None}


def remember_lse_origin(lse, p: Problem) -> None:
    """Note that ``lse`` was returned by a forward of problem ``p`` (for ``check_lse_origin``): a weak
    reference, dropped with the array, and its score function."""
    import weakref

    key = id(lse)
    _LSE_ORIGINS[key] = (weakref.ref(lse, lambda _, key=key: _LSE_ORIGINS.pop(key, None)), _score_function(p))


def check_lse_origin(lse, p: Problem) -> None:
    """ValueError when ``lse`` is an array a forward returned (this very object, not a copy) with another
    scale, mask, window, softcap or ALiBi than the backward problem ``p``: the backward recomputes P from
    it, and the gradients would be silently wrong. An lse of unknown origin (a copy, a view, another
    library's) is not checked."""
    seen = _LSE_ORIGINS.get(id(lse))
    if seen is None or seen[0]() is not lse:
        return
    want = _score_function(p)
    # (1 / sqrt(D), D ** -0.5 and their float32 rounding are one scale to the kernels and the rule)
    same = {"scale": lambda a, b: math.isclose(a, b, rel_tol=2.0 ** -20)}
    differ = [f"{name}={seen[1][name]!r} there, {want[name]!r} here" for name in want
              if not same.get(name, operator.eq)(seen[1][name], want[name])]
    if differ:
        raise ValueError("lse comes from a forward with another score function than this backward's ("
                         + "; ".join(differ) + "): the backward recomputes P from it, so the gradients "
                         "would be wrong; pass the forward's arguments")
