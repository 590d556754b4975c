"""flashcupy.attention_backward on CuPy arrays: both kernel families against float64, the twin and
themselves; the torch autograd bridge. Gradients are written into NaN-poisoned buffers."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import (
    F32_NEAR_FLOAT64,
    assert_accurate,
    assert_matches_twin,
    backward_reduction,
    dq_order_tolerance,
)
from tests.helpers import (
    block_params,
    combo_id,
    do_qkv,
    parametrize_causal,
    run_backward_poisoned,
    shape_ids,
    to_device,
)

pytestmark = pytest.mark.gpu

COMBOS = [  # (kernel, dtype, accum)
    ("wgmma", "f16", "fp32"), ("wgmma", "bf16", "fp32"),
    ("mma", "f16", "fp32"), ("mma", "f16", "fp16"), ("mma", "bf16", "fp32"),
    ("simt", "f32", "fp32"), ("simt", "f32", "fp16"), ("simt", "f16", "fp32"), ("simt", "bf16", "fp16"),
]
SHAPES = [(1, 1), (113, 203), (203, 113), (1023, 1024)]


def _check(host, grads, dname, accum, causal, what):
    do, q, k, v = host
    refs = reference.attention_backward(do, q, k, v, causal=causal)
    naives = naive.attention_backward(*to_device(*host), causal=causal)
    red = backward_reduction(q, k)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_accurate(g, r, n, dname, accum, kind="bwd", what=f"{what} {name}", reduction=red)


def _fwd(q, k, v, causal, kernel, accum):
    return flashcupy.attention(q, k, v, causal=causal, kernel=kernel, accum=accum, return_lse=True)


@parametrize_causal
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("nq,nk", SHAPES, ids=shape_ids(SHAPES))
def test_backward_matches_reference(rng, nq, nk, combo, d, causal):
    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 6, 2, nq, nk, d), dname)
    do, q, k, v = to_device(*host)
    o, lse = _fwd(q, k, v, causal, kernel, accum)
    # mma and wgmma with fp32 accumulators have two dQ paths (atomic by default, deterministic on
    # request): both
    for det in (False, True) if kernel in ("mma", "wgmma") and accum == "fp32" else (False,):
        grads = run_backward_poisoned(do, q, k, v, o, lse, causal=causal, kernel=kernel, accum=accum,
                                      deterministic=det)
        _check(host, grads, dname, accum, causal, f"{kernel} {dname} acc={accum} d={d} {nq}x{nk} det={det}")


@pytest.mark.parametrize("d", [8, 32, 40, 96, 256])
@pytest.mark.parametrize("combo", [("mma", "f16", "fp32"), ("mma", "bf16", "fp32"), ("simt", "f32", "fp32")],
                         ids=combo_id)
def test_backward_head_dims(rng, combo, d):
    kernel, dname, accum = combo
    host = do_qkv(rng, (2, 4, 2, 203, 317, d), dname)
    do, q, k, v = to_device(*host)
    o, lse = _fwd(q, k, v, True, kernel, accum)
    grads = run_backward_poisoned(do, q, k, v, o, lse, causal=True, kernel=kernel, accum=accum)
    _check(host, grads, dname, accum, True, f"{kernel} {dname} d={d}")


@pytest.mark.parametrize("kernel,dname,bm,bn", block_params("bwd", (("wgmma", "f16"), ("mma", "f16"),
                                                                    ("simt", "f32"))))
def test_backward_block_sizes(rng, kernel, dname, bm, bn):
    host = do_qkv(rng, (1, 4, 2, 300, 517, 64), dname)
    do, q, k, v = to_device(*host)
    for causal in (False, True):
        o, lse = _fwd(q, k, v, causal, kernel, "fp32")
        try:
            grads = run_backward_poisoned(do, q, k, v, o, lse, causal=causal, kernel=kernel, block_m=bm,
                                          block_n=bn)
        except ValueError as e:  # a tile the family documents as unsupported at this head dim
            pytest.skip(str(e))
        _check(host, grads, dname, "fp32", causal, f"{kernel} bm={bm} bn={bn} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dname", ["f16", "bf16"])
@pytest.mark.parametrize("nq,nk", [(300, 517), (1029, 577), (81, 79)], ids=lambda x: str(x))
def test_wgmma_backward_80_query_tiles(rng, nq, nk, dname, causal):
    """bwd_wgmma with block_m=80 at D=128 (FlashAttention-3's tile without a causal mask: dQ formed
    transposed, dQ^T = K^T dS^T, from dS stored by query rows): both dQ paths against float64 within the
    backward accuracy rule, every element written, the deterministic path bitwise repeatable, with
    ragged tiles (80 does not divide the lengths), GQA and a causal mask."""
    import cupy

    host = do_qkv(rng, (2, 4, 2, nq, nk, 128), dname)
    do, q, k, v = to_device(*host)
    o, lse = _fwd(q, k, v, causal, "wgmma", "fp32")
    for det in (False, True):
        grads = run_backward_poisoned(do, q, k, v, o, lse, causal=causal, kernel="wgmma", block_m=80,
                                      block_n=128, deterministic=det)
        _check(host, grads, dname, "fp32", causal, f"wgmma bm=80 {dname} {nq}x{nk} causal={causal} det={det}")
    again = run_backward_poisoned(do, q, k, v, o, lse, causal=causal, kernel="wgmma", block_m=80,
                                  block_n=128, deterministic=True)
    for a, b in zip(again, grads):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


ATOMIC_CASES = [("mma", d) for d in (64, 128, 256)] + [("wgmma", d) for d in (64, 128)]


@pytest.mark.parametrize("dname", ["f16", "bf16"])
@pytest.mark.parametrize("kernel,d", ATOMIC_CASES, ids=[f"{k}-d{d}" for k, d in ATOMIC_CASES])
def test_atomic_dq_path_matches_deterministic_path(rng, monkeypatch, kernel, dname, d):
    """The default (atomic dQ) backward gives dk, dv bit for bit equal to the deterministic path's (same
    on-chip order) and dq equal up to the order of fp32 additions. mma launches its atomic kernels by
    default and two atomic-free kernels when asked to be deterministic; wgmma launches the same body
    both ways (its twin, compiled with the ordering on, adds dQ by key tile when deterministic)."""
    import cupy

    from flashcupy import _launch

    launched = []
    real = _launch.get_kernel
    monkeypatch.setattr(_launch, "get_kernel",
                        lambda var, role=None: launched.append(role) or real(var, role))
    _launch._BACKWARD_PLANS.clear()  # kernels are looked up when a plan is made
    do, q, k, v = to_device(*do_qkv(rng, (2, 4, 2, 333, 517, d), dname))
    o, lse = _fwd(q, k, v, True, kernel, "fp32")
    launched.clear()
    fast = run_backward_poisoned(do, q, k, v, o, lse, causal=True, kernel=kernel)
    assert launched == ["prep", "dkdvdq", "dq_convert"]
    launched.clear()
    det = run_backward_poisoned(do, q, k, v, o, lse, causal=True, kernel=kernel, deterministic=True)
    twin = ["prep", "dkdv", "dq"] if kernel == "mma" else ["prep", "dkdvdq_ordered", "dq_convert"]
    assert launched == twin
    bits = cupy.uint16
    for name, a, b in zip(("dk", "dv"), fast[1:], det[1:]):
        assert bool((a.view(bits) == b.view(bits)).all()), f"{name} differs between the dQ paths"
    a, b = fast[0].astype(cupy.float32), det[0].astype(cupy.float32)
    diff = float(cupy.abs(a - b).max())
    assert diff <= dq_order_tolerance(dname, float(cupy.abs(b).max())), f"dq paths differ by {diff:.3e}"
    assert float(cupy.abs(b).max()) > 0


def test_wgmma_backward_routes_what_it_does_not_run(rng):
    """Head dims other than 64 and 128 and fp16 accumulators: kernel='wgmma' raises a ValueError naming
    the family that runs them; kernel='auto' runs them there."""
    for d, accum in ((96, "fp32"), (256, "fp32"), (64, "fp16")):
        do, q, k, v = to_device(*do_qkv(rng, (1, 2, 2, 65, 70, d), "f16"))
        o, lse = _fwd(q, k, v, False, "mma", accum)
        with pytest.raises(ValueError, match="kernel='mma'"):
            flashcupy.attention_backward(do, q, k, v, o, lse, kernel="wgmma", accum=accum)
        grads = run_backward_poisoned(do, q, k, v, o, lse, accum=accum)
        _check(tuple(x.get() for x in (do, q, k, v)), grads, "f16", accum, False, f"auto d={d} acc={accum}")


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_backward_bitwise_deterministic(rng, combo):
    import cupy

    kernel, dname, accum = combo
    do, q, k, v = to_device(*do_qkv(rng, (2, 4, 2, 577, 1029, 64), dname))
    o, lse = _fwd(q, k, v, True, kernel, accum)
    runs = [flashcupy.attention_backward(do, q, k, v, o, lse, causal=True, kernel=kernel, accum=accum,
                                         deterministic=True) for _ in range(5)]
    bits = cupy.uint16 if q.itemsize == 2 else cupy.uint32
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert bool((a.view(bits) == b.view(bits)).all())


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk", [(1029, 577), (130, 1029), (17000, 17000)], ids=lambda x: str(x))
def test_wgmma_noncausal_deterministic_orders(rng, monkeypatch, nq, nk, d):
    """The non-causal deterministic wgmma backward adds into each query tile in ascending key-tile order,
    its blocks taking the heads in sections of bwd_wgmma_ordered_heads (so that a CTA waits only on CTAs
    of lower index): bitwise repeatable, and in agreement with the atomic path, whose key tiles start
    rotated where bwd_wgmma_rotated says so (up to 2048 query rows) and at query tile 0 otherwise (dk, dv
    then bit for bit: both paths run the query tiles from 0)."""
    import cupy

    from flashcupy import _launch
    from flashcupy._policy import bwd_wgmma_ordered_heads, bwd_wgmma_rotated

    bh = (1, 1, 1) if nq > 4096 else (2, 4, 2)
    do, q, k, v = to_device(*do_qkv(rng, (*bh, nq, nk, d), "f16"))
    o, lse = _fwd(q, k, v, False, "wgmma", "fp32")
    _launch._BACKWARD_PLANS.clear()
    runs = [run_backward_poisoned(do, q, k, v, o, lse, kernel="wgmma", deterministic=True) for _ in range(3)]
    (plan,) = [p for p in _launch._BACKWARD_PLANS.values() if p.sem_shape is not None]
    n_qt = plan.sem_shape[2]
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    n_kt = -(-nk // plan.boxes[1])  # key tiles of block_n keys
    assert plan.ordered_heads == bwd_wgmma_ordered_heads(bh[0] * bh[2], n_kt, bh[1] // bh[2] * n_qt, sms)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    # the atomic path's order: its rotated twin where bwd_wgmma_rotated says so, ascending otherwise
    launched = []
    real = _launch.get_kernel
    monkeypatch.setattr(_launch, "get_kernel",
                        lambda var, role=None: launched.append(role) or real(var, role))
    fast = run_backward_poisoned(do, q, k, v, o, lse, kernel="wgmma")  # a new plan: its kernels looked up
    rotated = bwd_wgmma_rotated(d, False, nq)
    assert launched[1] == ("dkdvdq_rotated" if rotated else "dkdvdq")
    for name, a, b in zip(("dq", "dk", "dv"), fast, runs[0]):
        if name != "dq" and not rotated:
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name}: the dQ paths differ"
        a, b = a.astype(cupy.float32), b.astype(cupy.float32)
        diff = float(cupy.abs(a - b).max())
        assert diff <= dq_order_tolerance("f16", float(cupy.abs(b).max())), f"{name}: {diff:.3e} apart"
    if nq <= 4096:
        host = tuple(x.get() for x in (do, q, k, v))
        _check(host, runs[0], "f16", "fp32", False, f"wgmma det {nq}x{nk} d={d}")
        _check(host, fast, "f16", "fp32", False, f"wgmma {nq}x{nk} d={d}")


@pytest.mark.parametrize("causal,nq,nk", [(True, 333, 517), (True, 517, 333), (False, 1024, 1024)],
                         ids=["causal-333x517", "causal-517x333", "1024x1024"])
def test_wgmma_backward_query_tiles_of_128_give_the_bits_of_64(rng, causal, nq, nk):
    """At D=64 the wgmma backward runs 128-query tiles by default (two m64 dQ products a tile, dS^T in two
    panels). The tensor cores then add the same k16 chunks in the same order as with 64-query tiles (a
    chunk of masked queries adds exact zeros), so the deterministic path gives the 64-row tile's dq, dk,
    dv bit for bit and the atomic path its dk, dv (without a causal mask at nq = nk = 1024, where the
    rotated starts of the deterministic path fall on the same query rows for both tiles)."""
    import cupy

    do, q, k, v = to_device(*do_qkv(rng, (2, 4, 2, nq, nk, 64), "f16"))
    o, lse = _fwd(q, k, v, causal, "wgmma", "fp32")
    for det in (False, True):
        wide, narrow = (run_backward_poisoned(do, q, k, v, o, lse, causal=causal, kernel="wgmma", block_m=bm,
                                              block_n=128, deterministic=det) for bm in (128, 64))
        for name, a, b in zip(("dq", "dk", "dv"), wide, narrow):
            if det or name != "dq":
                assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} det={det}"
        assert float(cupy.abs(wide[2].astype(cupy.float32)).max()) > 0
    _check(tuple(x.get() for x in (do, q, k, v)), wide, "f16", "fp32", causal, f"wgmma bm=128 {nq}x{nk}")


@pytest.mark.parametrize("causal,nq,nk,d", [(False, 1029, 577, 64), (True, 333, 203, 128),
                                           (True, 1029, 1029, 64)], ids=lambda x: str(x))
def test_wgmma_backward_skewed_consumers_give_the_bits_of_consumers_in_step(rng, causal, nq, nk, d):
    """bwd_wgmma's FC_BWD_SKEW: the two consumer warpgroups no longer held in step (1) run each
    warpgroup's products in the order of the warpgroups in step (0): dq, dk, dv bit for bit on the
    deterministic path, dk, dv on the atomic one and dq there within the order of fp32 additions, with
    ragged tiles, GQA and a causal mask (the default tiles: two consumers)."""
    import cupy

    from flashcupy._variant import kernel_build

    do, q, k, v = to_device(*do_qkv(rng, (2, 4, 2, nq, nk, d), "f16"))
    o, lse = _fwd(q, k, v, causal, "wgmma", "fp32")
    runs = {}
    for flag in (0, 1):
        with kernel_build({"FC_BWD_SKEW": flag}):
            runs[flag] = [flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal, kernel="wgmma",
                                                       deterministic=det) for det in (False, True)]
    for flag, det in ((1, 0), (1, 1)):
        for name, a, b in zip(("dq", "dk", "dv"), runs[flag][det], runs[0][det]):
            if det or name != "dq":
                assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} {flag} det={det}"
        a, b = runs[flag][det][0].astype(cupy.float32), runs[0][det][0].astype(cupy.float32)
        diff = float(cupy.abs(a - b).max())
        assert diff <= dq_order_tolerance("f16", float(cupy.abs(b).max())), f"dq {flag} det={det}: {diff:.3e}"
        assert float(cupy.abs(runs[flag][det][2].astype(cupy.float32)).max()) > 0


@pytest.mark.parametrize("causal,nq,nk", [(False, 1029, 577), (True, 1029, 1029), (True, 333, 203)],
                         ids=lambda x: str(x))
def test_wgmma_backward_dq_by_query_rows_matches_dq_by_columns(rng, causal, nq, nk):
    """bwd_wgmma's FC_BWD_DQ_ROWS at D=64 (block_m=128, two consumers): each consumer forms the dQ share
    of its 64 query rows instead of its 32 columns, and the writer adds it in 64-row boxes (the host's map
    follows the define). dk, dv bit for bit on both paths and dq on the deterministic one (each element is
    the same dot over the keys in the same k16 steps), dq on the atomic path within the order of fp32
    additions, with ragged tiles (rows past nq skipped), GQA and a causal mask. A box the writer missed
    would leave rows of the zeroed fp32 buffer at 0: the comparison with the column split catches it (the
    poisoned outputs only show that dq itself was written)."""
    import cupy

    from flashcupy import _launch
    from flashcupy._variant import kernel_build

    do, q, k, v = to_device(*do_qkv(rng, (2, 4, 2, nq, nk, 64), "f16"))
    o, lse = _fwd(q, k, v, causal, "wgmma", "fp32")
    runs = {}
    for flag in (0, 1):
        with kernel_build({"FC_BWD_DQ_ROWS": flag}):
            _launch._BACKWARD_PLANS.clear()
            runs[flag] = [run_backward_poisoned(do, q, k, v, o, lse, causal=causal, kernel="wgmma",
                                                deterministic=det) for det in (False, True)]
            assert {pl.boxes[4] for pl in _launch._BACKWARD_PLANS.values()} == {(64 if flag else 128, 32)}
    for det in (0, 1):
        for name, a, b in zip(("dq", "dk", "dv"), runs[1][det], runs[0][det]):
            if det or name != "dq":
                assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} det={det}"
        a, b = runs[1][det][0].astype(cupy.float32), runs[0][det][0].astype(cupy.float32)
        diff = float(cupy.abs(a - b).max())
        assert diff <= dq_order_tolerance("f16", float(cupy.abs(b).max())), f"dq det={det}: {diff:.3e}"
        assert float(cupy.abs(b).max()) > 0


@pytest.mark.parametrize("combo", [("wgmma", "f16", "fp32"), ("wgmma", "bf16", "fp32"),
                                   ("mma", "f16", "fp32"), ("mma", "f16", "fp16"), ("simt", "f32", "fp32"),
                                   ("simt", "bf16", "fp16")], ids=combo_id)
def test_backward_agrees_with_numpy_twin(rng, combo):
    import cupy

    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 4, 2, 250, 390, 64), dname)
    dev = to_device(*host)
    o, lse = _fwd(*dev[1:], True, kernel, accum)
    g_gpu = flashcupy.attention_backward(*dev, o, lse, causal=True, kernel=kernel, accum=accum)
    g_twin = flashcupy.attention_backward(*host, cupy.asnumpy(o), cupy.asnumpy(lse), causal=True,
                                          kernel=kernel, accum=accum)
    for name, a, b in zip(("dq", "dk", "dv"), g_gpu, g_twin):
        assert_matches_twin(a, b, dname, accum, kind="bwd", what=name)


@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_backward_on_strided_views_equals_contiguous(rng, kernel):
    """(B, N, H, D) arrays viewed as (B, H, N, D) (q, k, v, do and o strided, GQA, odd lengths) give the
    contiguous inputs' gradients bit for bit (deterministic path) and pass the accuracy rule."""
    import cupy

    host = do_qkv(rng, (2, 6, 2, 203, 317, 64), "f16")

    def bnhd(x):  # the same values, stored (B, N, H, D)
        return cupy.ascontiguousarray(cupy.asarray(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    dense = to_device(*host)
    views = tuple(bnhd(x) for x in host)
    assert not views[1].flags.c_contiguous
    o, lse = _fwd(*dense[1:], True, kernel, "fp32")
    o_view = bnhd(o.get())
    a = run_backward_poisoned(*dense, o, lse, causal=True, kernel=kernel, deterministic=True)
    b = run_backward_poisoned(*views, o_view, lse, causal=True, kernel=kernel, deterministic=True)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert bool((x.view(cupy.uint16) == y.view(cupy.uint16)).all()), f"{kernel} {name}"
    _check(host, b, "f16", "fp32", True, f"{kernel} strided")


def test_backward_empty_rows_and_unseen_keys(rng):
    """Causal with Nq < Nk: keys past the last query's reach get dk = dv = 0; Nq > Nk: rows that see no
    key get dq = 0."""
    for kernel in ("wgmma", "mma", "simt"):
        do, q, k, v = to_device(*do_qkv(rng, (1, 2, 2, 300, 70, 64), "f16"))
        o, lse = _fwd(q, k, v, True, kernel, "fp32")
        dq, dk, dv = run_backward_poisoned(do, q, k, v, o, lse, causal=True, kernel=kernel)
        assert bool((dq[:, :, :230] == 0).all())


# ---------------------------------------------------------------------------------------------------
# torch bridge


def _torch():
    return pytest.importorskip("torch", reason="the torch bridge needs torch")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_bridge_matches_sdpa_math_in_float64(rng, causal):
    torch = _torch()
    import flashcupy.torch as fct

    b, h, n, d = 2, 4, 97, 64
    base = [torch.from_numpy(rng.standard_normal((b, h, n, d))).cuda() for _ in range(4)]
    q, k, v = (x.float().requires_grad_() for x in base[:3])
    do = base[3].float()
    o = fct.attention(q, k, v, causal=causal, kernel="simt")
    o.backward(do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        o64 = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    o64.backward(do.double())
    assert (o.double() - o64).abs().max().item() < F32_NEAR_FLOAT64["fwd"]
    for g, g64 in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        bound = F32_NEAR_FLOAT64["bwd"] * max(1.0, g64.abs().max().item())
        assert (g.double() - g64).abs().max().item() < bound


def test_torch_bridge_fp16_equals_flashcupy_and_runs_on_a_side_stream(rng):
    torch = _torch()
    import cupy

    import flashcupy.torch as fct

    b, h, n, d = 2, 4, 300, 64
    host = [rng.standard_normal((b, h, n, d)).astype(np.float16) for _ in range(4)]
    q, k, v = (torch.from_numpy(x).cuda().requires_grad_() for x in host[:3])
    do = torch.from_numpy(host[3]).cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        o = fct.attention(q, k, v, causal=True, deterministic=True)
        o.backward(do)
    side.synchronize()
    cq, ck, cv, cdo = (cupy.asarray(x) for x in host)
    o_ref, lse = flashcupy.attention(cq, ck, cv, causal=True, return_lse=True)
    grads = flashcupy.attention_backward(cdo, cq, ck, cv, o_ref, lse, causal=True, deterministic=True)
    assert bool((cupy.from_dlpack(o.detach()) == o_ref).all())
    for g, r in zip((q.grad, k.grad, v.grad), grads):
        assert bool((cupy.from_dlpack(g) == r).all())
