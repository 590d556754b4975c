"""The call path on the GPU: remembered problems and launch plans, TMA maps per address, the first
calls of a variant from many threads, arrays on another GPU, and the LSE's gradient in the kernels."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import flashcupy
from flashcupy import _compile, naive, reference
from flashcupy._checks import check_forward
from flashcupy.accuracy import assert_accurate, backward_reduction, max_abs_err
from tests.helpers import FORWARD_DEFAULTS, do_qkv, qkv

pytestmark = pytest.mark.gpu


def _run_threads(work, n: int) -> None:
    """work(0), ..., work(n - 1) on n threads at once; returns when all have finished."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _hopper() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) == 90


@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_new_addresses_under_one_plan_give_their_own_results(rng, kernel):
    """One problem, several input buffers (the plan and its TMA maps are remembered per address): each
    call computes its own inputs' attention, also after the old buffers are freed and new ones take
    their addresses."""
    import cupy

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    shape = (1, 4, 2, 200, 300, 64)
    outs = []
    for _ in range(2):
        for _ in range(3):
            q, k, v = qkv(rng, shape, "f16")
            cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
            o = flashcupy.attention(cq, ck, cv, kernel=kernel, causal=True)
            ref = reference.attention(q, k, v, causal=True)
            assert_accurate(cupy.asnumpy(o), ref, naive.attention(q, k, v, causal=True), "f16", "fp32",
                            what=f"{kernel} buffer {cq.data.ptr:#x}")
            outs.append(cupy.asnumpy(o))
            del cq, ck, cv, o  # the pool hands these addresses to the next inputs
    assert all(not np.array_equal(outs[0], x) for x in outs[1:])


def test_first_calls_from_eight_threads_compile_once(rng, monkeypatch):
    """Eight threads call a variant nobody has built yet at the same moment: one module build, eight
    correct (and identical) results."""
    import cupy

    q, k, v = qkv(rng, (1, 2, 1, 77, 91, 24), "f32")
    kw = dict(kernel="simt", block_m=16, block_n=32, causal=True)
    p = check_forward(q, k, v, **{**FORWARD_DEFAULTS, **kw})
    for key in [key for key in _compile._MODULES if key[0] == p.variant]:
        del _compile._MODULES[key]
    builds = []
    real = cupy.RawModule

    def counting(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting)
    cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
    start = threading.Barrier(8)
    results, errors = [None] * 8, []

    def work(i):
        try:
            start.wait()
            with cupy.cuda.Stream(non_blocking=True) as s:
                o = flashcupy.attention(cq, ck, cv, **kw)
                s.synchronize()
            results[i] = cupy.asnumpy(o)
        except Exception as e:  # reported below with the thread's number
            errors.append((i, repr(e)))

    _run_threads(work, 8)
    assert not errors, errors
    assert len(builds) == 1, f"{len(builds)} module builds for one variant"
    ref = reference.attention(q, k, v, causal=True)
    for r in results:
        np.testing.assert_array_equal(r, results[0])
    assert max_abs_err(results[0], ref) < 2e-6


def _two_gpus():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")


def test_arrays_on_another_gpu_run_on_that_gpu(rng):
    import cupy

    _two_gpus()
    do, q, k, v = do_qkv(rng, (2, 4, 2, 130, 170, 64), "f16")
    with cupy.cuda.Device(0):
        ref = [cupy.asarray(x) for x in (do, q, k, v)]
        o0, lse0 = flashcupy.attention(*ref[1:], causal=True, return_lse=True)
        g0 = flashcupy.attention_backward(*ref, o0, lse0, causal=True, deterministic=True)
    with cupy.cuda.Device(1):
        on1 = [cupy.asarray(x) for x in (do, q, k, v)]
    assert cupy.cuda.runtime.getDevice() == 0
    o1, lse1 = flashcupy.attention(*on1[1:], causal=True, return_lse=True)
    g1 = flashcupy.attention_backward(*on1, o1, lse1, causal=True, deterministic=True)
    assert cupy.cuda.runtime.getDevice() == 0
    for a, b in zip((o0, lse0, *g0), (o1, lse1, *g1)):
        assert b.device.id == 1
        np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
    with pytest.raises(ValueError, match="one GPU.*q on device 1.*k on device 0"):
        flashcupy.attention(on1[1], ref[2], ref[3])
    with pytest.raises(ValueError, match="one GPU.*do on device 0"):
        flashcupy.attention_backward(ref[0], *on1[1:], o1, lse1)


LSE_GRAD_CASES = [(kn, det) for kn in ("wgmma", "mma") for det in (False, True)] + [("simt", True)]


@pytest.mark.parametrize("kernel,deterministic", LSE_GRAD_CASES)
def test_kernels_fold_the_lse_gradient_into_delta(rng, kernel, deterministic):
    """The gradients of sum(do * o) + sum(g * lse) against float64 within the accuracy rule (whose
    naive error is the plain backward's: the naive backward has no LSE term)."""
    import cupy

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")

    do, q, k, v = do_qkv(rng, (2, 4, 2, 203, 113, 64), "f16")
    g = rng.standard_normal((2, 4, 203)).astype(np.float32)
    cdo, cq, ck, cv, cg = (cupy.asarray(x) for x in (do, q, k, v, g))
    o, lse = flashcupy.attention(cq, ck, cv, causal=True, return_lse=True, kernel=kernel)
    grads = flashcupy.attention_backward(cdo, cq, ck, cv, o, lse, causal=True, kernel=kernel,
                                         deterministic=deterministic, dlse=cg)
    refs = reference.attention_backward(do, q, k, v, causal=True, dlse=g)
    plain = reference.attention_backward(do, q, k, v, causal=True)
    naives = naive.attention_backward(do, q, k, v, causal=True)
    for name, x, r, r0, n in zip(("dq", "dk", "dv"), grads, refs, plain, naives):
        assert_accurate(cupy.asnumpy(x), r, n, "f16", "fp32", kind="bwd", what=f"{kernel} {name}",
                        reduction=backward_reduction(q, k), naive_ref=r0)
    assert max_abs_err(cupy.asnumpy(grads[0]), plain[0]) > 10 * max_abs_err(cupy.asnumpy(grads[0]), refs[0])


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "simt"])
def test_driver_launcher_gives_the_bits_of_cupys_launch_from_many_threads(rng, kernel, monkeypatch):
    """Calls after the first go through the driver-level launcher (one argument array per plan, under a
    lock): the bits of CuPy's launch, for several address triples, from 6 threads at once."""
    import cupy

    from flashcupy import _launch

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    sets = [[cupy.asarray(x) for x in qkv(rng, (2, 4, 2, 150, 190, 64), "f16")] for _ in range(3)]
    monkeypatch.setattr(_launch, "DRIVER_LAUNCH", False)  # plans made now launch through CuPy
    _launch._FORWARD_PLANS.clear()
    first = [flashcupy.attention(*s, kernel=kernel, causal=True) for s in sets]
    monkeypatch.undo()
    _launch._FORWARD_PLANS.clear()
    out, errors = [[None] * 3 for _ in range(6)], []
    start = threading.Barrier(6)

    def work(t):
        try:
            start.wait()
            with cupy.cuda.Stream(non_blocking=True) as s:
                for i in range(3):
                    for _ in range(4):
                        out[t][i] = flashcupy.attention(*sets[(i + t) % 3], kernel=kernel, causal=True)
                s.synchronize()
        except Exception as e:  # reported below
            errors.append(repr(e))

    _run_threads(work, 6)
    assert not errors, errors
    p = check_forward(*sets[0], **{**FORWARD_DEFAULTS, "kernel": kernel, "causal": True})
    assert _launch._forward_plan(p, *sets[0]).launcher._driver is not None, "cuda.bindings is installed"
    for t in range(6):
        for i in range(3):
            assert bool((out[t][i] == first[(i + t) % 3]).all()), f"thread {t}, input set {(i + t) % 3}"


def test_a_bare_new_thread_launches_through_the_driver(rng):
    """A thread whose first CUDA work is a remembered call (plan, launcher and pooled memory all cached)
    still launches: the launcher binds the device's context itself; the bits equal the main thread's."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in qkv(rng, (1, 2, 1, 96, 130, 64), "f16"))
    ref = [flashcupy.attention(q, k, v, kernel="mma") for _ in range(2)][-1]  # the launcher exists
    cupy.cuda.Device().synchronize()
    out, errors = [], []

    def work(_):
        try:
            o = flashcupy.attention(q, k, v, kernel="mma")
            cupy.cuda.Device().synchronize()
            out.append(o)
        except Exception as e:  # reported below
            errors.append(repr(e))

    _run_threads(work, 1)
    assert not errors, errors
    assert bool((out[0] == ref).all())
