"""Launching the kernels on CuPy arrays (shapes and knobs already checked)."""
from __future__ import annotations

import ctypes
import functools
import math
import threading

import numpy as np

from ._checks import Problem, numpy_dtype
from ._compile import get_kernel
from ._families import DETERMINISTIC_DQ_ROLES
from ._policy import backward_roles, bwd_wgmma_ordered_heads
from ._tma import STRIDE_LIMIT, TMA_MAP_BYTES, MapTemplate

_LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------------------------------
# layouts: what the kernels read in place, and one copy of what they cannot

def _strides_readable(shape, strides, itemsize: int, tma: bool) -> bool:
    """Whether the kernels read an array of these shape and strides (bytes) in place, its start aside:
    the last axis contiguous and every step along another axis of extent > 1 a multiple of 16 bytes
    (the families move 16 bytes at a time: cp.async, TMA, the backward prep kernel's vector loads; only
    the simt forward has a scalar fallback, and it takes the same rule, so that one rule serves every
    call); zero and negative steps are fine for pointer arithmetic, but ``tma`` (the wgmma family and the
    fp8 forward, whose TMA maps take positive strides below 2^40 bytes: ``_tma.tensor_map``) rules them
    out."""
    if shape[-1] > 1 and strides[-1] != itemsize:
        return False
    return all(s % 16 == 0 and (not tma or 0 < s < STRIDE_LIMIT)
               for s, n in zip(strides[:-1], shape[:-1]) if n > 1)


def _readable(x, tma: bool) -> bool:
    """``_strides_readable`` of x, and x starts on a 16-byte boundary."""
    return x.data.ptr % 16 == 0 and _strides_readable(x.shape, x.strides, x.itemsize, tma)


def _as_readable(x, tma: bool, scratch: "_Scratch"):
    """x where the kernels read it in place, else one C-contiguous copy of it (``scratch``'s memory,
    256-byte aligned). ``cupy.ascontiguousarray`` would not do: it returns a contiguous x itself, also
    when x starts at a misaligned address."""
    return x if _readable(x, tma) else _copy(x, scratch)


# --------------------------------------------------------------------------------------------------
# temporaries: CuPy's pool, or memory a captured CUDA graph keeps

_CAPTURE_WORKSPACE: dict = {}


class _Scratch:
    """Where one call's temporaries come from: the copies of layouts the kernels cannot read, the
    backward's fp32 dQ buffer, delta and counters, the forward's tile counter under capture.

    Outside stream capture: CuPy's memory pool, to which they return when the call lets them go; the pool
    hands memory out again in stream order, after the kernels that use it. While the current stream is
    being captured into a CUDA graph that would be wrong: the graph keeps their addresses and every
    replay writes them, long after the pool has given them to other arrays. There each request comes
    from a workspace that is never freed, one array per (thread, device, stream, and the call's requests
    up to this one): a graph's addresses stay its own for the life of the process (destroying the graph
    frees nothing), and capturing the same call on the same stream again reuses that memory; each new
    (thread, stream, call signature) captured adds its temporaries' size. Graphs captured on one stream
    therefore share their temporaries: replay them one at a time (on one stream), as the forward's tile
    counter already asked. The torch bridge passes its own scratch (torch's allocator, whose graph pools
    keep a capture's memory for as long as the graph lives)."""

    __slots__ = ("stream", "capturing", "taken", "keep")

    def __init__(self, stream):
        self.stream = stream
        self.capturing = None  # asked on the first request
        self.taken = ()
        self.keep = []  # buffer()'s arrays

    def is_capturing(self) -> bool:
        """Whether the stream is being captured into a CUDA graph (asked once)."""
        if self.capturing is None:
            self.capturing = self.stream.is_capturing()
        return self.capturing

    def empty(self, shape, dtype):
        import cupy

        if not self.is_capturing():
            return cupy.empty(shape, dtype=dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        self.taken += ((shape, np.dtype(dtype).str),)
        key = (threading.get_ident(), cupy.cuda.runtime.getDevice(), self.stream.ptr, self.taken)
        x = _CAPTURE_WORKSPACE.get(key)
        if x is None:
            x = _CAPTURE_WORKSPACE[key] = cupy.empty(shape, dtype=dtype)
        return x

    def zeros(self, shape, dtype):
        x = self.empty(shape, dtype)
        x.fill(0)
        return x

    def buffer(self, shape, dtype, zero: bool = False) -> int:
        """The device address of a temporary (zeroed if ``zero``) that lives as long as this scratch
        (one call): the launch plans' form of ``empty`` and ``zeros``."""
        x = self.zeros(shape, dtype) if zero else self.empty(shape, dtype)
        self.keep.append(x)
        return x.data.ptr


def _copy(x, scratch):
    """A C-contiguous copy of x (any strides: zero, negative, misaligned) in memory from ``scratch``
    (``_Scratch``, or the torch bridge's, whose ``empty`` gives a CuPy view of a torch tensor)."""
    import cupy

    out = scratch.empty(x.shape, x.dtype)
    cupy.copyto(out, x)
    return out


def _wgmma_ctas(tiles: int) -> int:
    """CTAs of a persistent wgmma forward launch over ``tiles`` tiles: one per SM, at most one per tile
    (the kernel runs on any grid size and writes the same bits)."""
    import cupy

    return min(tiles, _sm_count(cupy.cuda.Device().id))


_COUNTERS_LIMIT = 64  # streams whose tile counter a thread keeps; past that the cache starts over


def _tile_counter(stream: int, scratch: "_Scratch") -> int:
    """The device address of the tile counter of the wgmma forward's dynamic scheduler
    (FC_WG_PERSISTENT 2) for a launch on the stream with handle ``stream`` from this thread: two int32,
    zero before each launch and zero again after it (the kernel's last CTA resets them). Launches that
    run one after another share one: those of a thread on one stream (another thread, whose per-thread
    default stream has the same handle, gets its own; a thread keeps those of its last 64 streams: a
    dropped one returns to the pool in its stream's order). While the stream is captured into a CUDA
    graph the launch takes one from ``scratch`` (memory the graph keeps) and a memset to zero is
    captured before it, so that each replay starts from zero whatever ran before."""
    if scratch.is_capturing():
        return scratch.buffer((2,), np.int32, zero=True)
    import cupy

    counters = getattr(_THREAD, "tile_counters", None)
    if counters is None:
        counters = _THREAD.tile_counters = {}
    key = (cupy.cuda.runtime.getDevice(), stream)
    counter = counters.get(key)
    if counter is None:
        if len(counters) >= _COUNTERS_LIMIT:
            counters.clear()
        with _external_stream(stream):  # zeroed, and one day freed, in that stream's order
            counter = counters[key] = cupy.zeros(2, dtype=cupy.int32)
    return counter.data.ptr


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a device."""
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


def element_strides(x) -> tuple[np.int64, np.int64, np.int64]:
    """(batch, head, row) strides of a 4-D array in elements, as 64-bit kernel arguments."""
    return _element_strides(x.strides, x.itemsize)


def _element_strides(strides, itemsize: int) -> tuple[np.int64, np.int64, np.int64]:
    return tuple(np.int64(s // itemsize) for s in strides[:3])


# --------------------------------------------------------------------------------------------------
# launch plans: everything a call computes from its Problem and its arrays' strides (kernel handles,
# grids, scalar arguments), made once per (problem, strides) and reused; a call then adds only what
# depends on its arrays' addresses (the TMA maps, remembered per address) and its outputs.

_PLAN_LIMIT = 1024   # plans remembered; past that the memo starts over
_MAPS_LIMIT = 128    # TMA maps remembered per mapped argument of a plan (one per address: a decoding
                     # step's layers each read their own cache, every step)
FP8_VT_KEYS = 64     # fwd_wgmma.cu's fp8 V transposition: keys per CTA (V^T's key axis is padded to it)


PTR, MAP = "ptr", "map"  # the argument kinds of a launch layout besides fixed scalars

# The address slots of the plans' ``program``s, in the order of flashcupy/_torch_node.cpp's FWD_* and
# BWD_* (a test compares the two): what a forward or backward run of the compiled torch node fills in.
FORWARD_SLOTS = ("q", "k", "v", "o", "lse", "counter")
BACKWARD_SLOTS = ("do", "q", "k", "v", "o", "lse", "dlse", "dq", "dk", "dv", "delta", "dq_accum", "sem")


def _slots(order: tuple, names: str) -> tuple:
    return tuple(order.index(n) for n in names.split())
DRIVER_LAUNCH = True     # False: launchers made from now on launch through CuPy (a test compares the two)


class _Launcher:
    """One kernel's launches with a fixed argument layout: ``layout`` lists each argument as ``PTR`` (a
    device address), ``MAP`` (a 128-byte TMA map, by value) or a NumPy scalar of a fixed width (written
    once). A call passes the stream handle, the addresses and the maps' bytes, in layout order.

    With ``cuda.bindings``: the driver's ``cuLaunchKernel`` on an argument array built once, of which a
    call rewrites only the addresses and the maps that changed (CuPy's launch converts every argument on
    every call: 10.4 us against 6.0 us for the 23 arguments of the Hopper forward, measured on the
    H200). Without it: CuPy's launch of the same bytes on the same stream."""

    def __init__(self, kern, grid, layout):
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self._kern, self._grid = kern, grid
        self._layout = tuple(layout)
        self._lock = threading.Lock()  # one argument array: one launch at a time
        try:
            import cupy
            from cuda.bindings import driver
        except ImportError:
            driver = None
        if driver is None or not DRIVER_LAUNCH:
            self._driver = None
            return
        self._driver = driver
        self._device = cupy.cuda.runtime.getDevice()
        self._fn = driver.CUfunction(kern.function.kernel.ptr)  # the kernel on the current device
        self._dims = (*grid, kern.threads, 1, 1, kern.smem_bytes)
        self._slots = [_c_value(a) for a in self._layout]
        self._ptrs = [s for a, s in zip(self._layout, self._slots) if a is PTR]
        self._maps = [s for a, s in zip(self._layout, self._slots) if a is MAP]
        self._last_maps = [None] * len(self._maps)
        self._params = (ctypes.c_void_p * len(self._slots))(*map(ctypes.addressof, self._slots))
        self._addr = ctypes.addressof(self._params)
        self._ok = driver.CUresult.CUDA_SUCCESS

    def __call__(self, stream: int, pointers, maps=()) -> None:
        if self._driver is None:
            return self._cupy_launch(stream, pointers, maps)
        _bind_context(self._device)
        with self._lock:
            for slot, ptr in zip(self._ptrs, pointers):
                slot.value = ptr
            for i, (slot, m) in enumerate(zip(self._maps, maps)):
                if m is not self._last_maps[i]:
                    ctypes.memmove(slot, m, len(slot))
                    self._last_maps[i] = m
            err, = self._driver.cuLaunchKernel(self._fn, *self._dims, stream, self._addr, 0)
        if err != self._ok:
            raise RuntimeError(f"cuLaunchKernel of {self._kern.name} failed: {err}")

    def spec(self, slots, maps=()) -> tuple:
        """This launch as ``flashcupy/_torch_node.cpp`` runs it: (kernel handle, grid, threads, shared
        memory, arguments, kernel name), each argument (kind, index, bytes): fixed bytes (0), the value
        slot of an address (1; ``slots`` in the order ``__call__`` takes addresses) or a map template (2;
        ``maps`` in the order it takes maps)."""
        slots, maps = iter(slots), iter(maps)
        args = [(1, next(slots), b"") if a is PTR else (2, next(maps), b"") if a is MAP else
                (0, 0, bytes(_c_value(a))) for a in self._layout]
        kern = self._kern
        return (int(kern.function.kernel.ptr), self._grid, kern.threads, kern.smem_bytes, args, kern.name)

    def _cupy_launch(self, stream: int, pointers, maps) -> None:
        ptrs, tmaps = iter(pointers), iter(maps)
        args = tuple(np.uint64(next(ptrs)) if a is PTR else
                     np.frombuffer(next(tmaps), dtype=_MAP_DTYPE)[0] if a is MAP else a for a in self._layout)
        with _external_stream(stream):
            self._kern(self._grid, args)


class RawKernelLaunch:
    """A ``cupy.RawKernel`` as ``_Launcher`` takes a kernel (no dynamic shared memory), so that a small
    kernel launched on every call (the KV cache's append, ``merge_states``' merge) writes its fixed
    arguments once and launches through the driver as the attention kernels do."""

    def __init__(self, raw, threads: int):
        self.function, self.threads, self.smem_bytes, self.name = raw, int(threads), 0, raw.name

    def __call__(self, grid, args) -> None:
        self.function(grid, (self.threads,), args)


def small_launcher(raw, grid, threads: int, layout, memo: dict, key) -> "_Launcher":
    """The ``_Launcher`` of ``raw`` (a ``cupy.RawKernel``) over ``grid`` x ``threads`` with this argument
    layout on the current device, remembered in ``memo`` under ``key`` (the device added; at most
    ``_PLAN_LIMIT``, then the memo starts over)."""
    import cupy

    key = (key, cupy.cuda.runtime.getDevice())
    launch = memo.get(key)
    if launch is None:
        launch = _Launcher(RawKernelLaunch(raw, threads), grid, layout)
        if len(memo) >= _PLAN_LIMIT:
            memo.clear()
        memo[key] = launch
    return launch


_THREAD = threading.local()


class _StreamHandle:
    """A raw CUDA stream handle through the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``
    (CuPy 14 deprecates ``ExternalStream``). The stream is the caller's, alive while it launches."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _external_stream(handle: int):
    """The stream with this handle as a CuPy stream (a context manager that makes it current)."""
    import cupy

    return cupy.cuda.Stream.from_external(_StreamHandle(handle))


def _bind_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread, once per thread and device. The driver
    launch needs a current context, and a thread whose CUDA work so far was served from CuPy's caches
    (memory pool, compiled modules) may have none; ``cudaFree(0)`` is the runtime's way to bind it (CuPy
    does the same before each of its own launches)."""
    bound = getattr(_THREAD, "devices", None)
    if bound is None:
        bound = _THREAD.devices = set()
    if device not in bound:
        import cupy

        cupy.cuda.runtime.free(0)
        bound.add(device)


_C_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
              np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float}
_MAP_DTYPE = np.dtype((np.void, TMA_MAP_BYTES))


def _c_value(a):
    """A layout entry as the ctypes object whose bytes the kernel receives: a device address (``PTR``),
    a 128-byte TMA map (``MAP``), or a NumPy scalar of a fixed width."""
    if a is PTR:
        return ctypes.c_uint64(0)
    if a is MAP:
        return (ctypes.c_ubyte * TMA_MAP_BYTES)()
    if isinstance(a, np.generic) and a.dtype in _C_SCALARS:
        return _C_SCALARS[a.dtype](a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__} ({getattr(a, 'dtype', '')}) has no fixed "
                    "C layout here")


def _contiguous_strides(shape, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _output_strides(shape, itemsize: int, varlen: bool) -> tuple:
    """The strides (bytes) of an output the kernels see as ``shape`` (B, H, N, D): C-contiguous, or, for
    packed sequences, flash_attn's (total, H, D) seen as (1, H, total, D)."""
    strides = _contiguous_strides(shape, itemsize)
    if not varlen:
        return strides
    row = shape[3] * itemsize
    return (strides[0], row, shape[1] * row, itemsize)


class _MapSlot:
    """One TMA-mapped argument of a plan: the map's template (everything but the address, checked when
    the plan is made) and the maps of the last addresses seen (at most ``_MAPS_LIMIT``)."""

    __slots__ = ("template", "maps")

    def __init__(self, shape, strides, dtype, box, name: str):
        rows, cols = box if isinstance(box, tuple) else (box, 64)
        self.template = MapTemplate(shape, strides, dtype, rows, box_cols=cols, name=name)
        self.maps = {}

    def __call__(self, ptr: int) -> bytes:
        m = self.maps.get(ptr)
        if m is None:
            m = self.template.encode(ptr)
            if len(self.maps) >= _MAPS_LIMIT:
                self.maps.clear()
            self.maps[ptr] = m
        return m


class _ForwardPlan:
    """A forward call's launch, made from its Problem and the strides of q, k, v (bytes): the kernel, its
    grid and argument layout (``_Launcher``), and, for the wgmma family, the TMA map templates.
    ``run`` then takes only addresses. ``readable``: whether the kernels read arrays of these strides in
    place (a plan that is not is never run: the call copies its inputs first).

    An fp8 variant (``attention_fp8``: q, k, v uint8 e4m3 bit patterns, o in the variant's 16-bit dtype)
    is two launches: V^T first (``transpose``: e4m3 wgmma takes K-major operands only; its keys permuted
    in groups of 16 and zero-padded to a multiple of FP8_VT_KEYS, written into the call's scratch, where
    V's TMA map points), then the attention, whose arguments end with the three descale arrays, p_scale
    and log2(p_scale)."""

    __slots__ = ("tma", "readable", "kern", "o_shape", "lse_shape", "dynamic", "map_slots", "launcher",
                 "alibi", "varlen", "transpose", "vt_size")

    def __init__(self, p: Problem, q_strides, k_strides, v_strides, itemsize: int):
        var = p.variant
        # the kernels' (B, H, N, D) arrays: packed sequences are one batch of every token
        self.varlen = var.varlen
        nq, nk, batch = (p.total_q, p.total_k, 1) if var.varlen else (p.nq, p.nk, p.batch)
        q_shape = (batch, p.heads_q, nq, p.head_dim)
        kv_shape = (batch, p.heads_kv, nk, p.head_dim)
        self.tma = var.fam.kind == "wgmma"
        fp8 = var.fp8 is not None  # (V is read by the transposition's 16-byte loads, not by TMA)
        self.readable = all(_strides_readable(shape, st, itemsize, tma) for shape, st, tma in (
            (q_shape, q_strides, self.tma), (kv_shape, k_strides, self.tma), (kv_shape, v_strides, self.tma
                                                                                and not fp8)))
        self.kern = get_kernel(var, "fwd")  # compiled (and checked against the device) before any allocation
        self.transpose, self.vt_size = None, 0
        # o and lse: (B, Hq, N, D) and (B, Hq, N); packed, flash_attn's (total_q, Hq, D) and (Hq, total_q)
        self.o_shape, self.lse_shape = ((nq, p.heads_q, p.head_dim), q_shape[1:3]) if var.varlen else \
            (q_shape, q_shape[:3])
        grid = ((p.nq + var.block_m - 1) // var.block_m, p.heads_q, p.batch)
        v_el = _element_strides(v_strides, itemsize)
        scalars = (np.int32(nq), np.int32(nk), np.int32(p.group),
                   *_element_strides(q_strides, itemsize), *_element_strides(k_strides, itemsize),
                   *v_el, np.float32(p.scale * _LOG2E))
        # ALiBi: the slopes in raw units, (B, Hq) float32 (alibi_raw), and their batch stride
        self.alibi = var.alibi
        scalars += (PTR, np.int32(p.heads_q)) if var.alibi else ()
        # packed sequences: the cumulative lengths (int32, B + 1) of q and of k, v, the keys each uses (or
        # null), and the longest lengths
        scalars += (PTR, PTR, PTR, np.int32(p.nq), np.int32(p.nk)) if var.varlen else ()
        # a paged cache: the block table, each entry's row of it (int32) and the page size
        scalars += (PTR, PTR, np.int32(p.page)) if var.paged else ()
        maps, tail, self.dynamic, self.map_slots = (), (), False, ()
        if self.tma:
            # The Hopper kernels load q, k, v by TMA from tensor maps over their real strides, passed
            # first, by value, and store o through a fourth (64 x 64 boxes); they also take the head and
            # batch counts, and a persistent variant loops over the tiles on one CTA per SM, with the
            # dynamic scheduler taking them from a counter (a call's own, _tile_counter; the others get
            # a null pointer).
            self.dynamic = var.persistent == 2
            maps = (MAP,) * 4
            tail = (np.int32(p.heads_q), np.int32(p.batch), PTR if self.dynamic else np.uint64(0))
            if fp8:  # V^T, (B, Hkv, D, keys padded), written by the transposition from V's strides
                vt_shape = (batch, p.heads_kv, p.head_dim, -(-nk // FP8_VT_KEYS) * FP8_VT_KEYS)
                self.vt_size = math.prod(vt_shape)
                self.transpose = _Launcher(get_kernel(var, "v_transpose"),
                                           (vt_shape[3] // FP8_VT_KEYS, p.heads_kv, batch),
                                           (PTR, PTR, np.int32(nk), np.int32(vt_shape[3]), *v_el))
            if self.readable:
                dtype = numpy_dtype(var.dtype)
                # o's map (used by FC_WG_O_STAGE 1, 2) over o's own layout (packed: (total, Hq, D) seen as
                # (1, Hq, total, D); a varlen variant stores a sequence's partial warpgroups from registers)
                o_strides = _output_strides(q_shape, dtype.itemsize, var.varlen)
                v_map = (kv_shape, v_strides, dtype, var.block_n, "v")
                if fp8:  # 128-byte rows of e4m3; V's map over V^T, D x block_n boxes
                    u8 = np.dtype(np.uint8)
                    v_map = (vt_shape, _contiguous_strides(vt_shape, 1), u8, (p.head_dim, var.block_n), "v")
                    q_map = (q_shape, q_strides, u8, (var.block_m, 128), "q")
                    k_map = (kv_shape, k_strides, u8, (var.block_n, 128), "k")
                else:
                    q_map = (q_shape, q_strides, dtype, var.block_m, "q")
                    k_map = (kv_shape, k_strides, dtype, var.block_n, "k")
                self.map_slots = tuple(_MapSlot(*slot) for slot in (
                    q_map, k_map, v_map, (q_shape, o_strides, dtype, 64, "o")))
            if var.persistent:
                grid = (_wgmma_ctas(grid[0] * grid[1] * grid[2]), 1, 1)
        # fp8: q's, k's and v's descales (float32 (B, Hq, Nq), (B, Hkv, Nk), (B, Hkv)), p_scale, log2(p_scale)
        tail += (PTR, PTR, PTR, np.float32(p.p_scale), np.float32(math.log2(p.p_scale))) if fp8 else ()
        self.launcher = _Launcher(self.kern, grid, maps + (PTR,) * 5 + scalars + tail)

    def run(self, stream: int, q: int, k: int, v: int, o: int, lse: int, scratch, alibi: int = 0,
            cu: tuple = (), descales: tuple = ()) -> None:
        """Launch on the stream with handle ``stream``, the arrays at these device addresses: q, k, v with
        the plan's strides and 16-byte aligned, o and lse C-contiguous (``alibi``: the (B, Hq) slopes in
        raw units of an ALiBi variant, ``alibi_raw``; ``cu``: a varlen variant's checked cumulative
        lengths of q and of k, v and the keys each entry uses (0: all of its range), int32; ``descales``:
        an fp8 variant's three, ``_descales``).
        ``scratch`` (``_Scratch``'s interface) gives the dynamic scheduler's counter under stream
        capture, and an fp8 variant's V^T."""
        v_mapped = v
        if self.transpose is not None:  # (fp8) V^T, which V's map and pointer name
            v_mapped = scratch.buffer((self.vt_size,), np.uint8)
            self.transpose(stream, (v, v_mapped))
        ptrs = (q, k, v_mapped, o, lse) + ((alibi,) if self.alibi else ())
        ptrs += tuple(cu) if self.varlen else ()
        if self.dynamic:
            ptrs += (_tile_counter(stream, scratch),)
        ptrs += tuple(descales)
        slots = self.map_slots
        maps = (slots[0](q), slots[1](k), slots[2](v_mapped), slots[3](o)) if slots else ()
        self.launcher(stream, ptrs, maps)

    def program(self) -> dict:
        """``run`` written out for the compiled torch node (``flashcupy/_torch_node.cpp``): the keyword
        arguments of its ``program``, addresses as slots of ``FORWARD_SLOTS``. Only for plans that read
        their inputs in place, without ALiBi (the compiled node has no slot for slopes) or packed
        sequences."""
        if self.alibi or self.varlen or self.transpose is not None:
            raise ValueError("an ALiBi, varlen or fp8 plan has no program for the compiled torch node")
        mapped = _slots(FORWARD_SLOTS, "q k v o")
        maps = [(slot, *m.template.raw) for slot, m in zip(mapped, self.map_slots)]
        ptrs = _slots(FORWARD_SLOTS, "q k v o lse counter" if self.dynamic else "q k v o lse")
        return dict(forward=True, launches=[self.launcher.spec(ptrs, range(len(maps)))], maps=maps,
                    dynamic=self.dynamic, dq_floats=0, delta_floats=0, sem_shape=[])


_FORWARD_PLANS: dict = {}


def forward_plan(p: Problem, q_strides, k_strides, v_strides, itemsize: int) -> _ForwardPlan:
    """The plan of a forward call (remembered per problem and strides, at most ``_PLAN_LIMIT``)."""
    key = (p, q_strides, k_strides, v_strides)
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = _ForwardPlan(p, q_strides, k_strides, v_strides, itemsize)
        if len(_FORWARD_PLANS) >= _PLAN_LIMIT:
            _FORWARD_PLANS.clear()
        _FORWARD_PLANS[key] = plan
    return plan


def _forward_plan(p: Problem, q, k, v) -> _ForwardPlan:
    return forward_plan(p, q.strides, k.strides, v.strides, q.itemsize)


def forward(q, k, v, p: Problem, o=None, lse=None, scratch=None, alibi=None, cu=None, fp8=None):
    """Run the variant of ``p`` on the current CuPy stream of the GPU that holds q, k, v. Returns
    (o, lse).

    An input the kernels cannot read in place (``_strides_readable``: a strided last axis, a start or a
    step that is not a multiple of 16 bytes; for the wgmma family also a zero or negative step, as from
    ``broadcast_to`` or ``[::-1]``) is copied once into a contiguous array first; (B, N, H, D) views of
    contiguous buffers are read in place. ``o`` and ``lse`` may be given preallocated (contiguous, right
    shape and dtype): the tests pass NaN-poisoned buffers to check that the kernel writes every element.
    ``scratch``: where temporaries come from (``_Scratch`` of the current stream by default).
    ``alibi``: the slopes of an ALiBi variant, (Hq,) or (B, Hq), on q's GPU (``alibi_raw`` divides them
    by the scale into the kernels' (B, Hq) float32 array).
    Packed sequences (a varlen variant, ``flashcupy.attention_varlen``): q, k, v are flash_attn's packed
    (total, H, D), ``cu`` the two checked cumulative lengths (int32 (B + 1,) C-contiguous CuPy arrays on
    q's GPU: the kernels trust them) and, optionally, a third: the keys each entry uses from the start of
    its range (int32 (B,), flash_attn's seqused_k; None: all of them); o, lse are (total_q, Hq, D) and
    (Hq, total_q). A paged variant's ``cu`` also holds the block table and each entry's row of it (int32
    on q's GPU; k and v are the cache's pages as (pages x page size, Hkv, D), ``cu``'s second array each
    entry's first key in its own sequence and the third its key count).
    fp8 (an fp8 variant, ``flashcupy.attention_fp8``): q, k, v are uint8 e4m3 bit patterns (B, H, N, D),
    o is in the variant's 16-bit dtype, and ``fp8`` = (q's, k's, v's float32 scales, ``Quantized.scale``:
    4-D, broadcastable to the data; q's and k's block size where their scales are per block of tokens,
    else None), flattened into the call's scratch first (``_descales``). V is read by the transposition's
    16-byte loads (not TMA: any 16-byte steps, zero and negative included). Inside a CUDA graph capture
    every temporary is the capture's own, so the graph replays.
    """
    import cupy

    if p.device != cupy.cuda.runtime.getDevice():
        with cupy.cuda.Device(p.device):
            return forward(q, k, v, p, o=o, lse=lse, scratch=scratch, alibi=alibi, cu=cu, fp8=fp8)
    stream = cupy.cuda.get_current_stream()
    scratch = _Scratch(stream) if scratch is None else scratch
    if p.variant.varlen:  # (total, H, D) as the kernels' one batch (1, H, total, D)
        q, k, v = (x.transpose(1, 0, 2)[None] for x in (q, k, v))
        cu = tuple(0 if c is None else c.data.ptr for c in (*cu, None)[:5 if p.variant.paged else 3])
    plan = _forward_plan(p, q, k, v)
    if not plan.readable or (q.data.ptr | k.data.ptr | v.data.ptr) & 15:
        q, k = (_as_readable(x, plan.tma, scratch) for x in (q, k))
        v = _as_readable(v, plan.tma and plan.transpose is None, scratch)
        plan = _forward_plan(p, q, k, v)
    dtype = numpy_dtype(p.variant.dtype)
    if o is None:
        o = cupy.empty(plan.o_shape, dtype=dtype)
    else:
        if not (o.flags.c_contiguous and o.shape == plan.o_shape and o.dtype == dtype):
            raise ValueError(f"o must be C-contiguous {plan.o_shape} {dtype}; got {o.shape} {o.dtype}")
    if lse is None:
        lse = cupy.empty(plan.lse_shape, dtype=cupy.float32)
    else:
        if not (lse.flags.c_contiguous and lse.shape == plan.lse_shape and lse.dtype == cupy.float32):
            raise ValueError(f"lse must be C-contiguous {plan.lse_shape} float32; got {lse.shape} "
                             f"{lse.dtype}")
    raw = _alibi_slopes(p, alibi, scratch)  # (held until the launch: its memory must not be reused first)
    descales = ()
    if fp8 is not None:
        q_scale, k_scale, v_scale, blocks = fp8
        descales = (_descales(q_scale, (p.batch, p.heads_q, p.nq), blocks[0], scratch),
                    _descales(k_scale, (p.batch, p.heads_kv, p.nk), blocks[1], scratch),
                    _descales(v_scale, (p.batch, p.heads_kv), None, scratch))
    plan.run(stream.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, scratch,
             0 if raw is None else raw.data.ptr, cu or (), tuple(x.data.ptr for x in descales))
    return o, lse


_ALIBI_RAW = None


def alibi_raw(slopes, p: Problem, scratch):
    """ALiBi slopes as the kernels take them: a (B, Hq) float32 array (a new one from ``scratch``) of
    slope / scale, divided in float64 and rounded once (the twin's ``_score_variants`` does the same), so
    that the bias a |i' - j| is in the raw units of the scores, the scale staying in the exponent."""
    import cupy

    global _ALIBI_RAW
    if _ALIBI_RAW is None:
        _ALIBI_RAW = cupy.ElementwiseKernel("T a, float64 s", "float32 out", "out = (float)((double)a / s)",
                                            "flashcupy_alibi_raw")
    out = scratch.empty((p.batch, p.heads_q), np.float32)
    _ALIBI_RAW(cupy.broadcast_to(slopes, out.shape), np.float64(p.scale), out)
    return out


def _alibi_slopes(p: Problem, slopes, scratch):
    """The kernels' slopes of an ALiBi variant (``alibi_raw``); None for the others."""
    if not p.variant.alibi:
        return None
    if slopes is None:
        raise ValueError(f"{p.variant.key} is an ALiBi variant: alibi_slopes must be given")
    return alibi_raw(slopes, p, scratch)


class _BackwardPlan:
    """A backward call's launches, made from its Problem, ``deterministic`` and the strides of do, q, k,
    v, o (bytes): the prep kernel's, the two kernels' of ``backward_roles`` (grids and argument layouts)
    and, for the wgmma family, the TMA map templates. ``run`` then takes only addresses."""

    __slots__ = ("tma", "readable", "prep", "atomic", "delta_size", "ld_size", "boxes",
                 "sem_shape", "ordered_heads", "map_slots", "prep_launch", "kv_launch", "q_launch", "alibi",
                 "varlen", "dq_shape", "dkv_shape", "tiled_varlen", "dq_accum_shape")

    def __init__(self, p: Problem, deterministic: bool, strides: tuple, itemsize: int):
        var = p.variant
        # the kernels' (B, H, N, D) arrays: packed sequences are one batch of every token, and the
        # gradients come out in flash_attn's packed (total, H, D)
        self.varlen = var.varlen
        nq, nk, batch = (p.total_q, p.total_k, 1) if var.varlen else (p.nq, p.nk, p.batch)
        q_shape = (batch, p.heads_q, nq, p.head_dim)
        kv_shape = (batch, p.heads_kv, nk, p.head_dim)
        self.dq_shape, self.dkv_shape = ((nq, p.heads_q, p.head_dim), (nk, p.heads_kv, p.head_dim)) \
            if var.varlen else (q_shape, kv_shape)
        do_s, q_s, k_s, v_s, o_s = strides
        self.tma = var.fam.kind == "wgmma"  # o is read by the prep kernel only: no TMA map
        self.readable = all(_strides_readable(shape, st, itemsize, tma) for shape, st, tma in (
            (q_shape, do_s, self.tma), (q_shape, q_s, self.tma), (kv_shape, k_s, self.tma),
            (kv_shape, v_s, self.tma), (q_shape, o_s, False)))
        roles = backward_roles(var, deterministic, p.nq)
        self.prep = get_kernel(var, "prep")
        k_kv, k_q = (get_kernel(var, role) for role in roles)
        self.atomic = roles != DETERMINISTIC_DQ_ROLES  # an fp32 dQ buffer, converted at the end
        rows = batch * p.heads_q * nq
        # wgmma: prep writes L (log2 units) and delta tiled by query tile and padded to whole tiles, which
        # the producer copies into its stage with one bulk copy a tile (FC_BWD_PREP_TILE in bwd_prep.cuh);
        # packed sequences each padded to whole tiles (a head's floor(total_q / block_m) + B tiles,
        # bwd_prep.cuh's fc_prep_tiles), and the fp32 dQ buffer and the ordered path's counters with them
        n_qt = (p.nq + var.block_m - 1) // var.block_m
        tiled = self.tma
        self.tiled_varlen = tiled and var.varlen
        tiles = p.heads_q * (p.total_q // var.block_m + p.batch if self.tiled_varlen else p.batch * n_qt)
        self.ld_size = tiles * 2 * var.block_m if tiled else 0
        self.delta_size = self.ld_size or rows
        prep_rows = tiles * var.block_m if tiled else rows
        self.dq_accum_shape = (1, p.heads_q, prep_rows // p.heads_q, p.head_dim) if self.tiled_varlen \
            else q_shape
        seqs = (PTR, np.int32(p.batch)) if self.tiled_varlen else ()  # (cu_seqlens_q and the sequence count)
        # prep (do, o, delta, dq_accum, strides..., [lse,] dlse[, cu_q, B])
        self.prep_launch = _Launcher(self.prep, ((8 * prep_rows + var.threads - 1) // var.threads,), (
            PTR, PTR, PTR, PTR, np.int64(prep_rows), np.int32(p.heads_q), np.int32(nq),
            *_element_strides(do_s, itemsize), *_element_strides(o_s, itemsize),
            *(PTR,) * (2 if tiled else 1), *seqs))
        scale_log2 = np.float32(p.scale * _LOG2E)
        # the main kernels: (q, k, v, do, lse, delta, dq, dk, dv, sizes, strides, scale, ...)
        main = (PTR,) * 9 + (np.int32(nq), np.int32(nk), np.int32(p.group),
                             *(x for st in (q_s, k_s, v_s, do_s) for x in _element_strides(st, itemsize)),
                             scale_log2)
        # ALiBi: the slopes in raw units, (B, Hq) float32 (alibi_raw), and their batch stride
        self.alibi = var.alibi
        main += (PTR, np.int32(p.heads_q)) if var.alibi else ()
        # packed sequences: the cumulative lengths of q and of k, v, the keys used (null), the longest lengths
        main += (PTR, PTR, PTR, np.int32(p.nq), np.int32(p.nk)) if var.varlen else ()
        kv_grid = ((p.nk + var.block_n - 1) // var.block_n, p.heads_kv, p.batch)
        n4 = rows * p.head_dim // 4
        convert = (k_q, (min((n4 + 255) // 256, 65536),), (PTR, PTR, np.int64(n4), scale_log2) +
                   ((np.int32(p.heads_q), np.int32(nq)) if var.varlen else ()) + seqs)
        self.boxes, self.sem_shape, self.ordered_heads, self.map_slots = None, None, None, ()
        if self.tma:
            # q, k, v, dout loaded, the fp32 dQ buffer reduced into and dk, dv stored by TMA (maps first,
            # by value; the buffer's box is 32 fp32 columns, 128 bytes, dk's and dv's a consumer
            # warpgroup's 64 keys); deterministic: one counter per query tile and the heads per section
            # of its block order (the ordered kernel's last two arguments)
            # the dQ buffer's box rows as the module was compiled (bwd_wgmma_dq_box_rows in _families.py)
            dq_box_rows = k_kv.defines["FC_BWD_DQ_BOX_ROWS"]
            self.boxes = (var.block_m, var.block_n, var.block_n, var.block_m, (dq_box_rows, 32), 64, 64)
            tail = ()
            if deterministic:
                self.sem_shape = (1, tiles) if self.tiled_varlen else (p.batch, p.heads_q, n_qt)
                # non-causal: the (batch, KV head) pairs in sections of this many heads, key tile slowest
                self.ordered_heads = bwd_wgmma_ordered_heads(p.batch * p.heads_kv, kv_grid[0], p.group * n_qt,
                                                             _sm_count(p.device))
                tail = (PTR, np.int32(self.ordered_heads))
            if self.readable:
                dtype, f32 = numpy_dtype(var.dtype), np.dtype(np.float32)
                kv_c = _output_strides(kv_shape, itemsize, var.varlen)
                self.map_slots = tuple(_MapSlot(*slot) for slot in zip(
                    (q_shape, kv_shape, kv_shape, q_shape, self.dq_accum_shape, kv_shape, kv_shape),
                    (q_s, k_s, v_s, do_s, _contiguous_strides(self.dq_accum_shape, 4), kv_c, kv_c),
                    (dtype,) * 4 + (f32, dtype, dtype), self.boxes,
                    ("q", "k", "v", "do", "dq_accum", "dk", "dv")))
            self.kv_launch = _Launcher(k_kv, kv_grid, (MAP,) * 7 + main + tail)
            self.q_launch = _Launcher(*convert)
        elif self.atomic:
            self.kv_launch = _Launcher(k_kv, kv_grid, main + (PTR,))
            self.q_launch = _Launcher(*convert)
        else:
            self.kv_launch = _Launcher(k_kv, kv_grid, main)
            q_grid = ((p.nq + var.block_m - 1) // var.block_m, p.heads_q, p.batch)
            self.q_launch = _Launcher(k_q, q_grid, main)

    def run(self, stream: int, do: int, q: int, k: int, v: int, o: int, lse: int, dlse: int, dq: int, dk: int,
            dv: int, scratch, alibi: int = 0, cu: tuple = ()) -> None:
        """Launch on the stream with handle ``stream``, the arrays at these device addresses: do, q, k,
        v, o with the plan's strides and 16-byte aligned; lse, dlse (0: none) C-contiguous and 4-byte
        aligned; dq, dk, dv C-contiguous. The temporaries (the fp32 dQ buffer, delta, the ordered
        path's counters) come from ``scratch``; ``cu``: a varlen plan's cumulative lengths."""
        # one fp32 temporary: the dQ buffer (atomic paths), then delta (16-byte aligned: D is a multiple of 8)
        dq_floats = math.prod(self.dq_accum_shape) if self.atomic else 0
        delta = scratch.buffer((dq_floats + self.delta_size,), np.float32) + 4 * dq_floats
        dq_accum = delta - 4 * dq_floats if self.atomic else 0
        seqs = cu[:1] if self.tiled_varlen else ()
        self.prep_launch(stream, ((do, o, delta, dq_accum, lse, dlse) if self.ld_size else
                                  (do, o, delta, dq_accum, dlse)) + seqs)
        main = (q, k, v, do, lse, delta, dq, dk, dv) + ((alibi,) if self.alibi else ()) + \
            (tuple(cu) if self.varlen else ())
        if self.tma:
            maps = tuple(slot(x) for slot, x in zip(self.map_slots, (q, k, v, do, dq_accum, dk, dv)))
            if self.sem_shape is not None:
                main += (scratch.buffer(self.sem_shape, np.int32, zero=True),)
            self.kv_launch(stream, main, maps)
            self.q_launch(stream, (dq_accum, dq) + seqs)
        elif self.atomic:
            self.kv_launch(stream, main + (dq_accum,))
            self.q_launch(stream, (dq_accum, dq))
        else:
            self.kv_launch(stream, main)
            self.q_launch(stream, main)

    def program(self) -> dict:
        """``run`` written out for the compiled torch node (``flashcupy/_torch_node.cpp``): the keyword
        arguments of its ``program``, addresses as slots of ``BACKWARD_SLOTS``. Only for plans that
        read their inputs in place, without ALiBi (the compiled node has no slot for slopes) or packed
        sequences."""
        if self.alibi or self.varlen:
            raise ValueError("an ALiBi or varlen plan has no program for the compiled torch node")
        def slots(names):
            return _slots(BACKWARD_SLOTS, names)

        prep = slots("do o delta dq_accum lse dlse" if self.ld_size else "do o delta dq_accum dlse")
        main = "q k v do lse delta dq dk dv"
        maps = []
        if self.tma:
            mapped = slots("q k v do dq_accum dk dv")
            maps = [(slot, *m.template.raw) for slot, m in zip(mapped, self.map_slots)]
            kv = self.kv_launch.spec(slots(main + (" sem" if self.sem_shape is not None else "")),
                                     range(len(maps)))
            q = self.q_launch.spec(slots("dq_accum dq"))
        elif self.atomic:
            kv, q = self.kv_launch.spec(slots(main + " dq_accum")), self.q_launch.spec(slots("dq_accum dq"))
        else:
            kv, q = self.kv_launch.spec(slots(main)), self.q_launch.spec(slots(main))
        return dict(forward=False, launches=[self.prep_launch.spec(prep), kv, q], maps=maps, dynamic=False,
                    dq_floats=math.prod(self.dq_accum_shape) if self.atomic else 0,
                    delta_floats=self.delta_size,
                    sem_shape=list(self.sem_shape or ()))


_BACKWARD_PLANS: dict = {}


def backward_plan(p: Problem, deterministic: bool, strides: tuple, itemsize: int) -> _BackwardPlan:
    """The plan of a backward call (remembered per problem, ``deterministic`` and the strides of do, q,
    k, v, o; at most ``_PLAN_LIMIT``)."""
    key = (p, deterministic, *strides)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _BackwardPlan(p, deterministic, strides, itemsize)
        if len(_BACKWARD_PLANS) >= _PLAN_LIMIT:
            _BACKWARD_PLANS.clear()
        _BACKWARD_PLANS[key] = plan
    return plan


def backward(do, q, k, v, o, lse, p: Problem, *, deterministic: bool, grads=None, dlse=None, scratch=None,
             alibi=None, cu=None):
    """dq, dk, dv of the variant of ``p`` on the current CuPy stream of the GPU that holds the arrays.

    First flash_bwd_prep computes delta_i = rowsum(dO_i * O_i) - dlse_i in fp32 (O(N) memory; dlse, the
    LSE's gradient, where given) and zeroes the atomic path's fp32 dQ buffer (wgmma: it also writes
    L_i = lse_i log2 e, and lays L and delta out by query tile, padded, for the producer's bulk copies).
    Then:

    * ``deterministic=True``, or fp16 accumulators, or a family without the atomic kernel: the dK/dV
      kernel (key-tile outer) and the dQ kernel (query-tile outer), neither with atomics: bitwise
      reproducible, at the price of computing S and dP twice.
    * otherwise (mma, fp32 accumulators): one key-tile-outer kernel computes dK, dV and adds each
      tile's dQ partial to an fp32 buffer with atomic reductions (FlashAttention-2's scheme), then
      a conversion kernel scales and rounds it into dq. The order of the additions varies between
      runs, so dq may differ in the last bits from run to run.

    ``grads`` may hold preallocated (dq, dk, dv) (poisoned by tests). Inputs the kernels cannot read in
    place are copied once, as in ``forward`` (o, read by the prep kernel alone, takes any step). The
    temporaries (the fp32 dQ buffer, delta, the ordered path's counters, copies) come from ``scratch``
    (``_Scratch``: graph-safe under stream capture). ``alibi``: as in ``forward``. Packed sequences (a
    varlen variant): do, q, k, v, o packed (total, H, D), lse and dlse (Hq, total_q), ``cu`` as in
    ``forward``; dq, dk, dv come back packed.
    """
    import cupy

    if p.device != cupy.cuda.runtime.getDevice():
        with cupy.cuda.Device(p.device):
            return backward(do, q, k, v, o, lse, p, deterministic=deterministic, grads=grads, dlse=dlse,
                            scratch=scratch, alibi=alibi, cu=cu)
    stream = cupy.cuda.get_current_stream()
    scratch = _Scratch(stream) if scratch is None else scratch
    if p.variant.varlen:  # (total, H, D) as the kernels' one batch (1, H, total, D)
        do, q, k, v, o = (x.transpose(1, 0, 2)[None] for x in (do, q, k, v, o))
        cu = tuple(0 if c is None else c.data.ptr for c in (*cu, None)[:3])
    plan = backward_plan(p, deterministic, tuple(x.strides for x in (do, q, k, v, o)), q.itemsize)
    if not plan.readable or (do.data.ptr | q.data.ptr | k.data.ptr | v.data.ptr | o.data.ptr) & 15:
        do, q, k, v = (_as_readable(x, plan.tma, scratch) for x in (do, q, k, v))
        o = _as_readable(o, False, scratch)
        plan = backward_plan(p, deterministic, tuple(x.strides for x in (do, q, k, v, o)), q.itemsize)
    lse = _as_rows(lse, scratch)
    dlse = None if dlse is None else _as_rows(dlse, scratch)
    if grads is None:
        grads = (cupy.empty(plan.dq_shape, dtype=q.dtype), cupy.empty(plan.dkv_shape, dtype=q.dtype),
                 cupy.empty(plan.dkv_shape, dtype=q.dtype))
    dq, dk, dv = grads
    raw = _alibi_slopes(p, alibi, scratch)  # (held until the launches)
    plan.run(stream.ptr, do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr,
             0 if dlse is None else dlse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, scratch,
             0 if raw is None else raw.data.ptr, cu or ())
    return dq, dk, dv


def _as_rows(x, scratch: _Scratch):
    """A float32 (B, H, N) array of row values (lse, dlse) as the kernels read it: C-contiguous (they
    index it as one row-major block) and 4-byte aligned; else one copy."""
    return x if x.flags.c_contiguous and x.data.ptr % 4 == 0 else _copy(x, scratch)


# --------------------------------------------------------------------------------------------------
# fp8 (e4m3) forward: fwd_wgmma built with FC_FP8 (flashcupy.fp8.attention_fp8 checks the arguments)

def _descales(scale, shape: tuple, block, scratch):
    """fp8 descales as the kernel reads them: float32, C-contiguous, of ``shape`` ((B, H, N) or (B, H)),
    from a 4-D scale broadcastable to it (trailing axes of 1) or, with ``block``, from one scale per block
    of ``block`` tokens, (B, H, ceil(N / block), 1), repeated over its tokens and cut at N. Written into
    memory from ``scratch``: under stream capture the call's own, so that replays read the scales and
    write nothing CuPy's pool has given to other arrays."""
    import cupy

    out = scratch.empty(shape, np.float32)
    if block is None:
        target = shape + (1,) * (4 - len(shape))
        cupy.copyto(out.reshape(target), cupy.broadcast_to(scale, target))
        return out
    b, h, n = shape
    blocks = int(scale.shape[2])
    full = scratch.empty((b, h, blocks, block), np.float32)
    cupy.copyto(full, cupy.broadcast_to(scale, (b, h, blocks, block)))
    cupy.copyto(out, full.reshape(b, h, blocks * block)[:, :, :n])
    return out
