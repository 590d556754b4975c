"""What no input and no runtime situation may do on the GPU: refuse a layout the docstring accepts,
read or write out of bounds, kill the CUDA context, corrupt memory on a graph's replay, hang beside
another kernel, or return NaN for an accepted range (issue 33). Each test names the item it guards."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import flashcupy
from flashcupy import fp8, naive, reference
from flashcupy._checks import SCALE_RANGE
from flashcupy.accuracy import assert_accurate, backward_reduction
from tests.helpers import (
    do_qkv,
    record_scratch,
    replay_beside_sentinels,
    run_backward_poisoned,
    run_poisoned,
    to_device,
)

pytestmark = pytest.mark.gpu

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LAYOUTS = ("contiguous", "bnhd", "offset", "misaligned", "broadcast_b", "broadcast_h", "broadcast_n",
           "reversed", "strided_last")


def _hopper() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) == 90


def _alive() -> None:
    """The context still works: a synchronize and a small kernel (a dead context raises here)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    assert int(cupy.arange(4).sum()) == 6


def logical(x: np.ndarray, layout: str) -> np.ndarray:
    """The values a tensor in ``layout`` holds: broadcast layouts repeat index 0 of their axis."""
    axis = {"broadcast_b": 0, "broadcast_h": 1, "broadcast_n": 2}.get(layout)
    if axis is None:
        return x
    return np.ascontiguousarray(np.broadcast_to(np.take(x, [0], axis=axis), x.shape))


def stored(x: np.ndarray, layout: str):
    """A CuPy array with x's values (x as ``logical`` returns it) stored in ``layout``: contiguous; a
    (B, N, H, D) buffer viewed as (B, H, N, D); a slice at a row offset of a longer buffer; C-contiguous
    but one element past a 16-byte boundary; broadcast (stride 0) over B, H or N; N reversed (negative
    stride); the last axis strided (every other element of a wider buffer)."""
    import cupy

    b, h, n, d = x.shape
    if layout == "contiguous":
        return cupy.asarray(x)
    if layout == "bnhd":
        return cupy.ascontiguousarray(cupy.asarray(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "offset":
        buf = cupy.zeros((b, h, n + 5, d), dtype=x.dtype)
        buf[:, :, 3:3 + n] = cupy.asarray(x)
        return buf[:, :, 3:3 + n]
    if layout == "misaligned":
        flat = cupy.zeros(x.size + 16, dtype=x.dtype)
        view = flat[1:1 + x.size].reshape(x.shape)
        view[...] = cupy.asarray(x)
        assert view.flags.c_contiguous and view.data.ptr % 16
        return view
    if layout.startswith("broadcast"):
        axis = {"broadcast_b": 0, "broadcast_h": 1, "broadcast_n": 2}[layout]
        one = cupy.asarray(np.take(x, [0], axis=axis))
        out = cupy.broadcast_to(one, x.shape)
        assert out.strides[axis] == 0 or x.shape[axis] == 1
        return out
    if layout == "reversed":
        out = cupy.ascontiguousarray(cupy.asarray(x)[:, :, ::-1])[:, :, ::-1]
        assert out.strides[2] < 0 or n == 1
        return out
    if layout == "strided_last":
        return cupy.repeat(cupy.asarray(x), 2, axis=3)[..., ::2]
    raise ValueError(layout)


FAMILY_DTYPES = {"wgmma": ("f16", "bf16"), "mma": ("f16", "bf16"), "simt": ("f32", "f16")}


@st.composite
def problems(draw, kernel: str):
    dname = draw(st.sampled_from(FAMILY_DTYPES[kernel]))
    hkv = draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), hkv * draw(st.integers(1, 3)), hkv, draw(st.integers(1, 300)),
             draw(st.integers(1, 300)), draw(st.sampled_from((64, 128))))
    names = ("q", "k", "v", "do", "o")
    layouts = {n: draw(st.sampled_from(LAYOUTS)) for n in names}
    return dname, shape, draw(st.booleans()), layouts


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _fuzz_case(kernel, case):
    import cupy

    dname, (b, hq, hkv, nq, nk, d), causal, layouts = case
    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    rng = np.random.default_rng(zlib.crc32(f"{kernel} {case}".encode()))
    do, q, k, v = (logical(x, layouts[name]) for x, name in
                   zip(do_qkv(rng, (b, hq, hkv, nq, nk, d), dname), ("do", "q", "k", "v")))
    kw = dict(causal=causal, kernel=kernel)
    dense = to_device(do, q, k, v)
    views = tuple(stored(x, layouts[name]) for x, name in zip((do, q, k, v), ("do", "q", "k", "v")))
    what = f"{kernel} {dname} {(b, hq, hkv, nq, nk, d)} causal={causal} {layouts}"
    # forward: the bits of the contiguous arrays, and the accuracy rule against float64
    o_want, lse = run_poisoned(*dense[1:], **kw)
    o_got, lse_got = run_poisoned(*views[1:], **kw)
    _alive()
    assert bool((o_got == o_want).all()) and bool((lse_got == lse).all()), what
    assert_accurate(cupy.asnumpy(o_got), reference.attention(q, k, v, causal=causal),
                    naive.attention(q, k, v, causal=causal), dname, "fp32", what=what)
    # backward (deterministic: bitwise comparable), o in its own layout
    o_view = stored(cupy.asnumpy(o_want), layouts["o"] if not layouts["o"].startswith("broadcast")
                    else "contiguous")
    want = run_backward_poisoned(*dense, o_want, lse, deterministic=True, **kw)
    got = run_backward_poisoned(*views, o_view, lse, deterministic=True, **kw)
    _alive()
    refs = reference.attention_backward(do, q, k, v, causal=causal)
    naives = naive.attention_backward(do, q, k, v, causal=causal)
    for name, g, w, r, n in zip(("dq", "dk", "dv"), got, want, refs, naives):
        assert bool((g == w).all()), f"{name}: {what}"
        assert_accurate(cupy.asnumpy(g), r, n, dname, "fp32", kind="bwd", what=f"{name}: {what}",
                        reduction=backward_reduction(q, k))
    # the default (atomic dQ) path on the same views: accurate, context alive
    fast = run_backward_poisoned(*views, o_view, lse, **kw)
    _alive()
    assert_accurate(cupy.asnumpy(fast[0]), refs[0], naives[0], dname, "fp32", kind="bwd", what=f"dq: {what}",
                    reduction=backward_reduction(q, k))


@FUZZ
@given(case=problems("wgmma"))
def test_layout_fuzz_wgmma(case):
    """Item 1 and 2: broadcast, reversed, misaligned, offset and strided layouts of every input, forward
    and backward, on the Hopper family (which copies what TMA cannot read)."""
    _fuzz_case("wgmma", case)


@FUZZ
@given(case=problems("mma"))
def test_layout_fuzz_mma(case):
    _fuzz_case("mma", case)


@FUZZ
@given(case=problems("simt"))
def test_layout_fuzz_simt(case):
    _fuzz_case("simt", case)


FP8_LAYOUTS = ("contiguous", "bnhd", "offset", "misaligned", "broadcast_h", "broadcast_n", "reversed",
               "strided_last")


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(nq=st.integers(1, 300), nk=st.integers(1, 300), causal=st.booleans(),
       layouts=st.tuples(*(st.sampled_from(FP8_LAYOUTS),) * 3))
def test_layout_fuzz_fp8(nq, nk, causal, layouts):
    """Item 2 (the V^T pre-pass) and 1 for the fp8 forward: the data of q, k and v in any layout gives
    the bits of the contiguous data."""
    import cupy

    if not _hopper():
        pytest.skip("the fp8 kernel needs compute capability 9.0")
    rng = np.random.default_rng(nq * 1000 + nk)
    xs = [logical(rng.standard_normal((1, h, n, 128)).astype(np.float32), lay)
          for h, n, lay in ((4, nq, layouts[0]), (2, nk, layouts[1]), (2, nk, layouts[2]))]
    qz = [fp8.quantize(cupy.asarray(x), "e4m3", g) for x, g in zip(xs, ("token", "token", "head"))]
    want = flashcupy.attention_fp8(*qz, causal=causal)
    moved = []
    for z, lay in zip(qz, layouts):
        host = cupy.asnumpy(z.data)
        data = stored(host, lay if lay != "strided_last" else "strided_last")
        moved.append(fp8.Quantized(data, z.scale, z.fmt, z.granularity, z.block))
    got = flashcupy.attention_fp8(*moved, causal=causal)
    _alive()
    assert bool((got == want).all()), f"fp8 {nq}x{nk} causal={causal} {layouts}"
    assert not bool(cupy.isnan(got.astype(cupy.float32)).any())


# --------------------------------------------------------------------------------------------------
# item 3: graph capture


@pytest.mark.parametrize("kernel,deterministic", [("wgmma", False), ("wgmma", True), ("mma", False),
                                                  ("mma", True), ("simt", True)])
def test_captured_backward_replays_into_its_own_memory(rng, monkeypatch, kernel, deterministic):
    """A backward (and the forward before it) captured into a CUDA graph, with a broadcast k and a
    misaligned q (so that the call makes layout copies too): arrays allocated after the capture, three
    of each size the calls asked their scratch for (the pool would hand them a freed temporary's
    block first), are untouched by three replays, and the replayed gradients are the eager ones
    (bitwise where deterministic)."""
    import cupy

    requests = record_scratch(monkeypatch)
    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    dname = "f32" if kernel == "simt" else "f16"
    do, q, k, v = do_qkv(rng, (2, 4, 2, 300, 257, 64), dname)
    k = logical(k, "broadcast_h")
    views = (stored(do, "contiguous"), stored(q, "misaligned"), stored(k, "broadcast_h"), stored(v, "bnhd"))
    stream = cupy.cuda.Stream(non_blocking=True)
    kw = dict(causal=True, kernel=kernel)
    with stream:
        o, lse = flashcupy.attention(*views[1:], return_lse=True, **kw)  # warm-up: compile, plans
        eager = flashcupy.attention_backward(*views, o, lse, deterministic=deterministic, **kw)
        stream.synchronize()
        requests.clear()
        stream.begin_capture()
        o_c, lse_c = flashcupy.attention(*views[1:], return_lse=True, **kw)
        grads = flashcupy.attention_backward(*views, o_c, lse_c, deterministic=deterministic, **kw)
        graph = stream.end_capture()
    assert len(requests) >= 3, requests  # the copies of q and (wgmma) k, delta, ...
    replay_beside_sentinels(graph, stream, requests)
    assert bool((o_c == o).all())
    for name, g, e in zip(("dq", "dk", "dv"), grads, eager):
        if deterministic or name != "dq":
            assert bool((g == e).all()), name
        else:
            assert float(cupy.abs(g.astype(cupy.float32) - e.astype(cupy.float32)).max()) < 1e-2, name
    _alive()


def test_packed_and_kvcache_calls_refuse_capture_and_leave_it_clean(rng):
    """attention_varlen (forward and backward) and attention_with_kvcache (and a plan's run) read their
    lengths on the host and take per-call uploads and temporaries from CuPy's pool, which a replay would
    find reused: under stream capture each raises RuntimeError before any copy (host lengths included,
    which would otherwise capture without an error), the capture still ends cleanly, and the same calls
    run after."""
    import cupy

    d = 64
    q, k, v, do = (cupy.asarray(rng.standard_normal((40, 2, d)).astype(np.float16)) for _ in range(4))
    cu = np.array([0, 15, 40], np.int32)  # (host lengths: no device-to-host copy to fail on)
    qc = cupy.asarray(rng.standard_normal((2, 1, 4, d)).astype(np.float16))
    kc, vc = (cupy.asarray(rng.standard_normal((2, 32, 2, d)).astype(np.float16)) for _ in range(2))
    lens = np.array([5, 32], np.int32)
    o, lse = flashcupy.attention_varlen(q, k, v, cu, cu, return_lse=True)
    calls = {"attention_varlen": lambda: flashcupy.attention_varlen(q, k, v, cu, cu),
             "attention_varlen_backward": lambda: flashcupy.attention_varlen_backward(do, q, k, v, o, lse,
                                                                                      cu, cu),
             "attention_with_kvcache": lambda: flashcupy.attention_with_kvcache(qc, kc, vc,
                                                                                cache_seqlens=lens)}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # (a plan runs on the stream it was made on: every call below runs on this one)
        plan = flashcupy.plan_kvcache(qc, kc, vc, cache_seqlens=lens)  # (a plan's run: the same refusal)
    calls["attention_with_kvcache (a plan's run)"] = lambda: plan.run(qc, kc, vc)
    for name, call in calls.items():
        with stream:
            call()  # (compiled, remembered)
            stream.begin_capture()
            try:
                fn = name.split(" ")[0]
                with pytest.raises(RuntimeError, match=f"{fn} cannot be captured into a CUDA graph"):
                    call()
            finally:
                graph = stream.end_capture()
        del graph
        with stream:
            call()
        stream.synchronize()
    _alive()


# --------------------------------------------------------------------------------------------------
# item 4: the deterministic backward needs no co-residency

_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    extern __shared__ unsigned char hold[];  // one block per SM: the SM is closed to other large CTAs
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    if (threadIdx.x == 0 && t == 0) hold[0] = 1;
}
"""


def test_deterministic_backward_finishes_beside_a_kernel_that_holds_sms(rng):
    """A kernel on another stream holds 8 SMs for 3 s; the deterministic wgmma backward without a causal
    mask, whose key tiles (SMs - 4 of them) would all fit on an idle GPU, runs beside it on the free SMs
    and finishes in a small fraction of that time (the rotated order it replaced waited for the other
    kernel's end: 2.5 s in the issue's report). Its gradients are the ones it gives on an idle GPU."""
    import cupy

    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    n = (sms - 4) * 128
    do, q, k, v = to_device(*do_qkv(rng, (1, 1, 1, n, n, 128), "f16"))
    o, lse = flashcupy.attention(q, k, v, return_lse=True, kernel="wgmma")
    idle = flashcupy.attention_backward(do, q, k, v, o, lse, kernel="wgmma", deterministic=True)
    cupy.cuda.Device().synchronize()
    spin = cupy.RawKernel(_SPIN, "spin")
    smem = 200 * 1024
    spin.max_dynamic_shared_size_bytes = smem
    other, mine = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with other:
        spin((8,), (32,), (np.uint64(3_000_000_000),), shared_mem=smem)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with mine:
        start.record()
        grads = flashcupy.attention_backward(do, q, k, v, o, lse, kernel="wgmma", deterministic=True)
        end.record()
    end.synchronize()
    assert not other.done, "the other kernel ended first: the test did not overlap them"
    ms = cupy.cuda.get_elapsed_time(start, end)
    other.synchronize()
    assert ms < 500, f"the deterministic backward took {ms:.0f} ms beside a kernel holding 8 SMs"
    for name, g, w in zip(("dq", "dk", "dv"), grads, idle):
        assert bool((g == w).all()), name


# --------------------------------------------------------------------------------------------------
# item 5: the ends of the accepted ranges


@pytest.mark.parametrize("kernel,dname", [("wgmma", "f16"), ("wgmma", "bf16"), ("mma", "f16"),
                                          ("simt", "f32"), ("simt", "f16")])
@pytest.mark.parametrize("scale", SCALE_RANGE, ids=["scale-min", "scale-max"])
def test_scale_range_edges_are_finite_and_accurate(rng, kernel, dname, scale):
    import cupy

    """At scale = 2^-64 and 2^12 (1e-39 used to give NaN, 1e38 an error of 4) the forward is finite and
    within the accuracy rule, and agrees with the twin on finiteness; the gradients are finite at both
    edges and within the rule at the lower one. (At 2^12 the backward recomputes P from a float32 LSE of
    order 1e5, whose rounding, 2^-24 |lse|, is P's relative error: the rule's bound, set by a naive
    attention that exponentiates S - max directly, is not met there; see test_checks.)"""
    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    do, q, k, v = do_qkv(rng, (1, 4, 2, 203, 157, 64), dname)
    dev = to_device(do, q, k, v)
    o, lse = run_poisoned(*dev[1:], kernel=kernel, scale=scale, causal=True)
    twin_o = flashcupy.attention(q, k, v, scale=scale, causal=True)
    assert np.isfinite(twin_o.astype(np.float32)).all()
    assert_accurate(o.get(), reference.attention(q, k, v, scale=scale, causal=True),
                    naive.attention(q, k, v, scale=scale, causal=True), dname, "fp32", what=f"{kernel}")
    grads = run_backward_poisoned(*dev, o, lse, kernel=kernel, scale=scale, causal=True)
    refs = reference.attention_backward(do, q, k, v, scale=scale, causal=True)
    naives = naive.attention_backward(do, q, k, v, scale=scale, causal=True)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert bool(cupy.isfinite(g.astype(cupy.float32)).all()), f"{kernel} {name}"
        if scale < 1:
            assert_accurate(g.get(), r, n, dname, "fp32", kind="bwd", what=f"{kernel} {name}",
                            reduction=backward_reduction(q, k))
    _alive()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kscale", ["head", "token"])
def test_fp8_tiny_magnitudes_give_the_uniform_softmax(rng, causal, kscale):
    """fp8 inputs of magnitude 1e-30 (descales near 2e-33, whose product flushed to zero and made a
    masked key's -inf * 0 = NaN): finite, the twin's output within e4m3's rounding, and the float64
    reference's (a uniform softmax over the visible keys)."""
    import cupy

    if not _hopper():
        pytest.skip("the fp8 kernel needs compute capability 9.0")
    shape_q, shape_k = (1, 4, 77, 128), (1, 2, 203, 128)
    xq, xk = ((rng.standard_normal(s) * 1e-30).astype(np.float32) for s in (shape_q, shape_k))
    xv = rng.standard_normal(shape_k).astype(np.float32)
    groups = ((xq, "token"), (xk, kscale), (xv, "head"))
    host = [fp8.quantize(x, "e4m3", g) for x, g in groups]
    dev = [fp8.quantize(cupy.asarray(x), "e4m3", g) for x, g in groups]
    o, lse = flashcupy.attention_fp8(*dev, causal=causal, return_lse=True)
    o_twin, lse_twin = flashcupy.attention_fp8(*host, causal=causal, return_lse=True)
    o, lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    ref_o, ref_lse = reference.attention(*(fp8.dequantize(t) for t in host), causal=causal, return_lse=True)
    assert np.abs(o - o_twin.astype(np.float64)).max() < 2e-2
    assert np.abs(o - ref_o).max() < 5e-2  # P rounded to e4m3 times p_scale, V to e4m3
    assert np.abs(lse - ref_lse).max() < 1e-5


# --------------------------------------------------------------------------------------------------
# the torch bridge: expand, storage offsets, stride-0 gradients, ablate, CUDA graphs


def _torch():
    return pytest.importorskip("torch", reason="the torch bridge needs torch")


def _sdpa_grads(torch, q, k, v, loss_fn, causal):
    """float64 math SDPA's output and gradients for the loss ``loss_fn(o)`` (GQA expanded)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o64 = torch.nn.functional.scaled_dot_product_attention(
            q64, k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1), is_causal=causal)
    loss_fn(o64).backward()
    return o64, (q64.grad, k64.grad, v64.grad)


@pytest.mark.parametrize("loss", ["mean", "weighted_sum_over_n", "sum"])
def test_torch_bridge_stride0_gradients_expand_and_offsets(rng, loss):
    """Training through flashcupy.torch on the default (Hopper: wgmma) family with losses whose
    gradient autograd hands over with stride 0 (o.mean(), (o.sum(dim=2) * w).sum()), k and v expanded
    over heads (GQA through expand) and q at a misaligned storage offset: gradients against float64."""
    torch = _torch()
    import flashcupy.torch as fct

    b, h, n, d = 2, 4, 130, 64
    w = torch.from_numpy(rng.standard_normal((b, h, d))).cuda().half()
    losses = {"mean": lambda o: o.mean() * 8192,  # (scaled so that the gradients are O(0.1))
              "weighted_sum_over_n": lambda o: (o.sum(dim=2) * w.to(o.dtype)).sum(), "sum": lambda o: o.sum()}
    buf = torch.from_numpy(rng.standard_normal(b * h * n * d + 8)).cuda().half()
    q = buf[1:1 + b * h * n * d].view(b, h, n, d).detach().requires_grad_()  # 2 bytes past 16
    assert q.data_ptr() % 16
    k1 = torch.from_numpy(rng.standard_normal((b, 1, n, d))).cuda().half().requires_grad_()
    v1 = torch.from_numpy(rng.standard_normal((b, 1, n, d))).cuda().half().requires_grad_()
    k, v = k1.expand(b, h, n, d), v1.expand(b, h, n, d)  # stride 0 over heads
    o = fct.attention(q, k, v, causal=True)
    losses[loss](o).backward()
    o64, (gq, gk, gv) = _sdpa_grads(torch, q, k, v, losses[loss], True)
    assert (o.double() - o64).abs().max().item() < 2e-3
    for name, g, g64 in (("dq", q.grad, gq), ("dk", k1.grad, gk.sum(1, keepdim=True)),
                         ("dv", v1.grad, gv.sum(1, keepdim=True))):
        err, top = (g.double() - g64).abs().max().item(), g64.abs().max().item()
        assert top > 0 and err < 1e-2 * top, f"{name}: {err:.3e} against a largest gradient of {top:.3e}"


def test_torch_bridge_refuses_gradients_through_a_break(rng):
    """ablate has no backward: refused up front with gradients on, and in the backward of a graph that
    was built with it; without gradients it runs."""
    torch = _torch()
    import flashcupy.torch as fct

    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match="ablate='rescaling' has no backward"):
        fct.attention(q, q, q, ablate="rescaling")
    with torch.no_grad():
        fct.attention(q, q, q, ablate="rescaling")


def test_torch_cuda_graph_of_a_training_step_replays_correctly(rng):
    """Forward and backward captured with torch.cuda.graph: after CuPy-side eager calls of the same
    shapes (which would take the temporaries' memory back from CuPy's pool), each replay on new inputs
    gives the eager gradients bit for bit (deterministic path)."""
    torch = _torch()
    import cupy

    import flashcupy.torch as fct

    shape = (2, 4, 200, 64)
    static = [torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    static_do = torch.randn(shape, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compile, plans, launchers
            for t in static:
                t.grad = None
            fct.attention(*static, causal=True, deterministic=True).backward(static_do)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fct.attention(*static, causal=True, deterministic=True)
        out.backward(static_do)
    for step in range(3):
        fresh = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4)]
        with torch.no_grad():
            for t, f in zip(static + [static_do], fresh):
                t.copy_(f)
        # eager CuPy work of the same sizes between replays
        cq = [cupy.asarray(np.asarray(rng.standard_normal(shape), np.float16)) for _ in range(4)]
        co, clse = flashcupy.attention(*cq[1:], causal=True, return_lse=True)
        flashcupy.attention_backward(*cq, co, clse, causal=True)
        graph.replay()
        torch.cuda.synchronize()
        ref = [f.clone().requires_grad_() for f in fresh[:3]]
        fct.attention(*ref, causal=True, deterministic=True).backward(fresh[3])
        assert torch.equal(out, fct.attention(*fresh[:3], causal=True, deterministic=True)), step
        for name, t, r in zip(("dq", "dk", "dv"), static, ref):
            assert torch.equal(t.grad, r.grad), f"{name} at replay {step}"


def test_torch_compile_reduce_overhead_replays_correctly(rng):
    """torch.compile(mode="reduce-overhead") of the attention (CUDA graphs through cudagraph trees for
    the forward and, through AOTAutograd, the backward graph; none skipped): the outputs and gradients
    on fresh inputs, step after step, are the eager ones bit for bit (deterministic path)."""
    torch = _torch()
    from torch._dynamo.utils import counters

    import flashcupy.torch as fct

    def attn(q, k, v):
        return fct.attention(q, k, v, causal=True, deterministic=True)

    counters.clear()
    compiled = torch.compile(attn, mode="reduce-overhead", fullgraph=True)
    shape = (2, 4, 160, 64)
    for i in range(5):
        leaves = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3)]
        do = torch.randn(shape, device="cuda", dtype=torch.float16)
        got = [x.clone().requires_grad_() for x in leaves]
        o = compiled(*got)
        o.backward(do)
        o = o.clone()  # (the graph's output buffer is reused by the next replay)
        want = [x.clone().requires_grad_() for x in leaves]
        o_eager = attn(*want)
        o_eager.backward(do)
        assert torch.equal(o, o_eager), f"o at step {i}"
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(g.grad, w.grad), f"{name} at step {i}"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])



def test_tile_counters_are_kept_for_64_streams_at_most():
    """Item 6: a thread that launches on many streams keeps the tile counters of at most 64 of them (a
    dropped one returns to the pool in its stream's order); a stream's counter reads zero."""
    import cupy

    from flashcupy import _launch

    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(70)]
    for s in streams:
        with s:
            _launch._tile_counter(s.ptr, _launch._Scratch(s))
            counter = _launch._THREAD.tile_counters.get((cupy.cuda.runtime.getDevice(), s.ptr))
            assert counter is not None and counter.tolist() == [0, 0]
    assert 0 < len(_launch._THREAD.tile_counters) <= _launch._COUNTERS_LIMIT


# --------------------------------------------------------------------------------------------------
# the backward's contract: an lse from a forward with another score function is refused


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "simt"])
def test_a_gpu_backward_refuses_the_lse_of_another_mask(rng, kernel):
    """On CuPy arrays (weakly referenced as NumPy's are) the backward names a forward's other mask before
    any launch; with the forward's own mask its gradients are within the accuracy rule of the float64
    reference."""
    import cupy

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    do, q, k, v = do_qkv(rng, (1, 4, 2, 200, 200, 64), "f16")
    dev = to_device(do, q, k, v)
    o, lse = flashcupy.attention(*dev[1:], causal=True, kernel=kernel, return_lse=True)
    with pytest.raises(ValueError, match="mask='causal' there, 'none' here"):
        flashcupy.attention_backward(*dev, o, lse, kernel=kernel)
    grads = flashcupy.attention_backward(*dev, o, lse, causal=True, kernel=kernel)
    refs = reference.attention_backward(do, q, k, v, causal=True)
    naives = naive.attention_backward(do, q, k, v, causal=True)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_accurate(cupy.asnumpy(g), r, n, "f16", "fp32", kind="bwd", what=f"{kernel} {name}",
                        reduction=backward_reduction(q, k))
    _alive()
