"""flashcupy.torch: the custom operators (opcheck, torch.compile without graph breaks), the (B, N, H, D)
layout without copies, the LSE and its gradient, streams without deprecation warnings."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flashcupy
from flashcupy import reference
from flashcupy.accuracy import F32_NEAR_FLOAT64, assert_lse_accurate

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the torch bridge needs torch")


def _tensors(rng, shapes, dtype=torch.float16, grad=True):
    return [torch.from_numpy(rng.standard_normal(s)).to("cuda", dtype).requires_grad_(grad) for s in shapes]


def test_opcheck_forward_and_backward_operators(rng):
    import flashcupy.torch  # noqa: F401  (registers the operators)

    q, k, v = _tensors(rng, [(1, 4, 70, 64), (1, 2, 90, 64), (1, 2, 90, 64)])
    fwd_args = (q, k, v, True, None, None, None, "fp32", "mma", None, False)
    torch.library.opcheck(torch.ops.flashcupy.attention.default, fwd_args)
    o, lse = torch.ops.flashcupy.attention(*fwd_args)
    do, = _tensors(rng, [(1, 4, 70, 64)], grad=False)
    g = torch.randn(1, 4, 70, device="cuda")
    for dlse in (None, g):
        bwd_args = (do, *(x.detach() for x in (q, k, v, o, lse)), dlse, True, None, "fp32", "mma", True)
        torch.library.opcheck(torch.ops.flashcupy.attention_backward.default, bwd_args)


def test_torch_compile_fullgraph_matches_eager(rng):
    import flashcupy.torch as fct

    class Block(torch.nn.Module):
        def __init__(self, width=256, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(width, 3 * width, dtype=torch.float16)
            self.out = torch.nn.Linear(width, width, dtype=torch.float16)

        def forward(self, x):
            b, n, w = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).unbind(2)  # (B, N, H, D)
            o = fct.attention(q, k, v, causal=True, layout="bnhd", deterministic=True)
            return self.out(o.reshape(b, n, w))

    torch.manual_seed(0)
    model = Block().cuda()
    x = torch.from_numpy(rng.standard_normal((2, 100, 256))).to("cuda", torch.float16)
    eager = model(x)
    eager.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break raises
    out = compiled(x)
    out.float().square().sum().backward()
    torch.testing.assert_close(out, eager, rtol=2e-3, atol=2e-3)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=2e-2, atol=2e-2)


def test_bnhd_layout_runs_on_views_and_gives_the_bits_of_bhnd(rng):
    import flashcupy.torch as fct

    q, k, v = _tensors(rng, [(2, 130, 8, 64), (2, 170, 2, 64), (2, 170, 2, 64)])  # (B, N, H, D)
    do, = _tensors(rng, [(2, 130, 8, 64)], grad=False)
    o = fct.attention(q, k, v, causal=True, layout="bnhd", deterministic=True)
    assert o.shape == (2, 130, 8, 64) and o.transpose(1, 2).is_contiguous()  # a view, no copy
    o.backward(do)
    grads = [x.grad.clone() for x in (q, k, v)]
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ot = fct.attention(qt, kt, vt, causal=True, deterministic=True)
    ot.backward(do.transpose(1, 2))
    assert torch.equal(ot.transpose(1, 2), o)
    for g, x in zip(grads, (qt, kt, vt)):
        assert torch.equal(g.transpose(1, 2), x.grad)
    with pytest.raises(ValueError, match="layout must be one of"):
        fct.attention(q, k, v, layout="nhd")


def test_returned_lse_and_its_gradient_against_float64(rng):
    import flashcupy.torch as fct

    shapes = [(1, 4, 90, 32), (1, 2, 120, 32), (1, 2, 120, 32), (1, 4, 90, 32)]
    q64, k64, v64, do64 = (rng.standard_normal(s) for s in shapes)
    g64 = rng.standard_normal((1, 4, 90))
    q, k, v = (torch.from_numpy(x).cuda().float().requires_grad_() for x in (q64, k64, v64))
    o, lse = fct.attention(q, k, v, causal=True, kernel="simt", return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 90)
    do, g = (torch.from_numpy(x).cuda().float() for x in (do64, g64))
    ((o * do).sum() + (lse * g).sum()).backward()
    o_ref, lse_ref = reference.attention(q64, k64, v64, causal=True, return_lse=True)
    assert_lse_accurate(lse.detach().cpu().numpy(), lse_ref, "fp32", what="torch bridge lse")
    refs = reference.attention_backward(do64, q64, k64, v64, causal=True, dlse=g64)
    for x, r in zip((q, k, v), refs):
        bound = F32_NEAR_FLOAT64["bwd"] * max(1.0, np.abs(r).max())
        assert np.abs(x.grad.cpu().numpy() - r).max() < bound


def test_bridge_raises_no_deprecation_warning(rng):
    import flashcupy.torch as fct

    q, k, v = _tensors(rng, [(1, 2, 64, 64)] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            fct.attention(q, k, v).sum().backward()
        side.synchronize()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_bridge_argument_errors(rng):
    import flashcupy.torch as fct

    q, k, v = _tensors(rng, [(1, 2, 16, 64)] * 3)
    with pytest.raises(TypeError, match="unknown knobs"):
        fct.attention(q, k, v, block=64)
    with pytest.raises(TypeError, match="q must be a CUDA torch.Tensor"):
        fct.attention(q.cpu(), k, v)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fct.attention(q, k, v, deterministic=1)
    with pytest.raises(ValueError, match="accum must be one of"):
        fct.attention(q, k, v, accum="fp8")
    assert flashcupy.torch is fct


def test_bridge_runs_tensors_on_a_gpu_that_is_not_current(rng):
    import flashcupy.torch as fct

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    host = [torch.from_numpy(rng.standard_normal((1, 4, 90, 64))).half() for _ in range(3)]
    grads = {}
    for dev in ("cuda:0", "cuda:1"):
        q, k, v = (x.to(dev).requires_grad_() for x in host)
        o = fct.attention(q, k, v, causal=True, deterministic=True)
        o.float().square().sum().backward()
        assert o.device == q.device
        grads[dev] = [t.detach().cpu() for t in (o, q.grad, k.grad, v.grad)]
    assert torch.cuda.current_device() == 0
    for a, b in zip(grads["cuda:0"], grads["cuda:1"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cap", [0.0, 3.0], ids=["window", "window-softcap"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_a_window_runs_on_every_torch_path(rng, kernel, cap):
    """``window_size`` and ``softcap`` through flashcupy.torch: the eager node (compiled C++ where it
    builds), the custom operators (opcheck with the window's two ints and the cap) and torch.compile
    (fullgraph) give the bits of flashcupy.attention and attention_backward on the same values, and the
    window is applied (the result is not the causal one)."""
    import cupy

    import flashcupy
    import flashcupy.torch as fct

    w = (100, 0)
    kw = dict(causal=True, window_size=w, kernel=kernel, deterministic=True, softcap=cap)
    q, k, v = _tensors(rng, [(1, 4, 300, 64), (1, 2, 350, 64), (1, 2, 350, 64)])
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    o = fct.attention(q, k, v, **kw)
    o.backward(do)
    eager = (o.detach(), q.grad, k.grad, v.grad)

    qc, kc, vc, doc = (cupy.asarray(x.detach()) for x in (q, k, v, do))
    oc, lse = flashcupy.attention(qc, kc, vc, causal=True, window_size=w, kernel=kernel, return_lse=True,
                                  softcap=cap)
    grads = flashcupy.attention_backward(doc, qc, kc, vc, oc, lse, causal=True, window_size=w, kernel=kernel,
                                         deterministic=True, softcap=cap)
    for a, b in zip(eager, (oc, *grads)):
        assert bool((cupy.asarray(a) == b).all())
    causal = flashcupy.attention(qc, kc, vc, causal=True, kernel=kernel)
    assert not bool((causal == oc).all())

    if cap:  # the cap is applied
        plain = flashcupy.attention(qc, kc, vc, causal=True, window_size=w, kernel=kernel)
        assert not bool((plain == oc).all())
    args = (q.detach(), k.detach(), v.detach(), True, None, None, None, "fp32", kernel, None, True, *w, cap)
    torch.library.opcheck(torch.ops.flashcupy.attention.default, args)
    o2, lse2 = torch.ops.flashcupy.attention(*args)
    assert torch.equal(o2, eager[0])
    bwd_args = (do, *args[:3], o2, lse2, None, True, None, "fp32", kernel, True, *w, cap)
    torch.library.opcheck(torch.ops.flashcupy.attention_backward.default, bwd_args)

    qs, ks, vs = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    compiled = torch.compile(lambda a, b, c: fct.attention(a, b, c, **kw), fullgraph=True)
    o3 = compiled(qs, ks, vs)
    o3.backward(do)
    for a, b in zip(eager, (o3.detach(), qs.grad, ks.grad, vs.grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_alibi_through_torch_matches_cupy_and_compiles(rng, kernel, layout):
    """``alibi_slopes`` through flashcupy.torch, (B, Hq) float32 slopes with GQA, a causal mask and rows
    that see no key: o, lse and the gradients of q, k, v are flashcupy.attention / attention_backward's
    bits with the same slopes (one place for ALiBi: the kernels' score hook), and within the accuracy
    rule of float64; torch.compile (fullgraph) gives the eager bits, the LSE in the loss or not; opcheck
    passes with slopes (Hq,); slopes that require grad, or of a wrong shape, dtype or device, are refused
    by name; float64 (Hq,) slopes from an offset view, with sinks, give the CuPy bits too."""
    import cupy

    import flashcupy.torch as fct
    from flashcupy import naive
    from flashcupy.accuracy import assert_accurate, backward_reduction

    b, hq, nq, nk = 2, 4, 300, 170
    q, k, v = _tensors(rng, [(b, hq, nq, 64), (b, 2, nk, 64), (b, 2, nk, 64)])
    base = 2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)
    sl_h = np.stack([rng.permutation(base) for _ in range(b)]).astype(np.float32)
    sl = torch.from_numpy(sl_h).to("cuda")
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    dl = torch.randn(q.shape[:3], device="cuda", dtype=torch.float32)
    kw = dict(causal=True, kernel=kernel, deterministic=True, alibi_slopes=sl, return_lse=True)

    def run(fn, *xs, with_lse=False):
        leaves = [x.detach().clone().requires_grad_(True) for x in xs]
        args = [t.transpose(1, 2) for t in leaves] if layout == "bnhd" else leaves
        o, lse = fn(*args)
        if layout == "bnhd":
            o = o.transpose(1, 2)
        torch.autograd.backward((o, lse) if with_lse else o, (do, dl) if with_lse else do)
        return [o.detach(), lse.detach(), *(t.grad for t in leaves)]

    def call(a, b_, c):
        return fct.attention(a, b_, c, layout=layout, **kw)

    eager = run(call, q, k, v)
    dev = [cupy.asarray(x.detach()) for x in (do, q, k, v)]
    oc, lc = flashcupy.attention(*dev[1:], causal=True, kernel=kernel, alibi_slopes=cupy.asarray(sl_h),
                                 return_lse=True)
    gc = flashcupy.attention_backward(dev[0], *dev[1:], oc, lc, causal=True, kernel=kernel,
                                      deterministic=True, alibi_slopes=cupy.asarray(sl_h))
    for name, a, c in zip(("o", "lse", "dq", "dk", "dv"), eager, (oc, lc, *gc)):
        assert bool((cupy.asarray(a) == c).all()), name
    host = [x.detach().float().cpu().numpy().astype(np.float64) for x in (do, q, k, v)]
    o_ref = reference.attention(*host[1:], causal=True, alibi_slopes=sl_h)
    refs = reference.attention_backward(*host, causal=True, alibi_slopes=sl_h)
    assert_accurate(cupy.asarray(eager[0]), o_ref, naive.attention(*dev[1:], causal=True, alibi_slopes=sl_h),
                    "f16", "fp32", what=f"{kernel} o")
    nvs = naive.attention_backward(*dev, causal=True, alibi_slopes=sl_h)
    red = backward_reduction(*host[1:3])
    for name, g, r, n in zip(("dq", "dk", "dv"), eager[2:], refs, nvs):
        assert_accurate(cupy.asarray(g), r, n, "f16", "fp32", kind="bwd", reduction=red,
                        what=f"{kernel} {layout} {name}")
    compiled = torch.compile(call, fullgraph=True)
    for with_lse in (False, True):
        want = eager if not with_lse else run(call, q, k, v, with_lse=True)
        got = run(compiled, q, k, v, with_lse=with_lse)
        for name, a, c in zip(("o", "lse", "dq", "dk", "dv"), want, got):
            assert torch.equal(a, c), (name, with_lse, (a.float() - c.float()).abs().max().item())
    if layout == "bhnd":
        args = (q.detach(), k.detach(), v.detach(), True, None, None, None, "fp32", kernel, None, True,
                -1, -1, 0.0, None, sl[0].contiguous())
        torch.library.opcheck(torch.ops.flashcupy.attention.default, args)
        o2, lse2 = torch.ops.flashcupy.attention(*args)
        bwd = (do, *args[:3], o2, lse2, dl, True, None, "fp32", kernel, True, -1, -1, 0.0, None, args[-1])
        torch.library.opcheck(torch.ops.flashcupy.attention_backward.default, bwd)
    with pytest.raises(ValueError, match="alibi_slopes has no gradient"):
        fct.attention(q, k, v, alibi_slopes=sl.clone().requires_grad_(True))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(Hq,\) = \(4,\)"):
        fct.attention(q, k, v, alibi_slopes=sl[:, :3])
    with pytest.raises(TypeError, match="alibi_slopes must be float32 or float64"):
        fct.attention(q, k, v, alibi_slopes=sl.half())
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor on cuda"):
        fct.attention(q, k, v, alibi_slopes=sl.cpu())
    if layout == "bnhd":
        return
    # float64 (Hq,) slopes read from a view with a storage offset, with sinks: the CuPy entry points' bits
    sl64 = torch.from_numpy(np.concatenate([[7.0], base])).to("cuda", torch.float64)[1:]
    z = torch.from_numpy(rng.standard_normal(hq)).to("cuda", torch.float32)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o3, l3 = fct.attention(*leaves, causal=True, kernel=kernel, deterministic=True, alibi_slopes=sl64,
                           sinks=z, return_lse=True)
    o3.backward(do)
    ck = dict(causal=True, kernel=kernel, alibi_slopes=cupy.asarray(sl64), sinks=cupy.asarray(z))
    oc3, lc3 = flashcupy.attention(*dev[1:], return_lse=True, **ck)
    gc3 = flashcupy.attention_backward(dev[0], *dev[1:], oc3, lc3, deterministic=True, **ck)
    for name, a, c in zip(("o", "lse", "dq", "dk", "dv"), (o3, l3, *(t.grad for t in leaves)),
                          (oc3, lc3, *gc3[:3])):
        assert bool((cupy.asarray(a.detach()) == c).all()), ("float64 slopes with sinks", name)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_sinks_through_torch_match_the_reference_and_compile(rng, kernel, layout):
    """``sinks`` through flashcupy.torch, with GQA, a causal mask and rows that see no key: o, lse and the
    gradients of q, k, v and the sinks against float64 by the accuracy rule (the naive baseline on the
    same values); the bits of flashcupy.attention / attention_backward with sinks on the same values;
    torch.compile (fullgraph, inductor) gives the eager bits (torch 2.11's inductor once miscompiled a
    merge written in torch ops: docs/design/torch_bridge.md), also where the LSE is part of the loss;
    opcheck passes with sinks; frozen sinks still shape the gradients; bad sinks are refused by name."""
    import cupy

    import flashcupy
    import flashcupy.torch as fct
    from flashcupy import naive
    from flashcupy.accuracy import assert_accurate, backward_reduction

    hq, nq, nk = 4, 300, 170  # causal, bottom-right: 130 rows see no key; N = 300: inductor pads rows
    q, k, v = _tensors(rng, [(2, hq, nq, 64), (2, 2, nk, 64), (2, 2, nk, 64)])
    z = torch.from_numpy(rng.standard_normal(hq) * 3 + 5).to("cuda", torch.float32).requires_grad_(True)
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    dl = torch.randn(q.shape[:3], device="cuda", dtype=torch.float32)
    kw = dict(causal=True, kernel=kernel, deterministic=True, sinks=z, return_lse=True)

    def run(fn, *xs, with_lse=False):
        leaves = [x.detach().clone().requires_grad_(True) for x in xs]
        args = [t.transpose(1, 2) for t in leaves[:3]] if layout == "bnhd" else leaves[:3]
        o, lse = fn(*args, leaves[3])
        if layout == "bnhd":
            o = o.transpose(1, 2)
        torch.autograd.backward((o, lse) if with_lse else o, (do, dl) if with_lse else do)
        return [o.detach(), lse.detach(), *(t.grad for t in leaves)]

    def call(a, b, c, s):
        return fct.attention(a, b, c, layout=layout, **{**kw, "sinks": s})

    eager = run(call, q, k, v, z)
    host = [x.detach().float().cpu().numpy().astype(np.float64) for x in (do, q, k, v)]
    zh = z.detach().cpu().numpy()
    o_ref, lse_ref = reference.attention(*host[1:], causal=True, sinks=zh, return_lse=True)
    refs = reference.attention_backward(*host, causal=True, sinks=zh)
    dev = [cupy.asarray(x.detach()) for x in (do, q, k, v)]
    n_o = naive.attention(*dev[1:], causal=True, sinks=zh)
    nvs = naive.attention_backward(*dev, causal=True, sinks=zh)
    red = backward_reduction(*host[1:3])
    assert_accurate(cupy.asarray(eager[0]), o_ref, n_o, "f16", "fp32", what=f"{kernel} o")
    assert_lse_accurate(cupy.asarray(eager[1]), lse_ref, "fp32", what=f"{kernel} lse")
    for name, g, r, n in zip(("dq", "dk", "dv", "dsinks"), eager[2:], refs, nvs):
        assert_accurate(cupy.asarray(g), r, n, "f16", "fp32", kind="bwd", reduction=red,
                        what=f"{kernel} {layout} {name}")
    # the CuPy entry points' bits (one place for the merge and d sinks: flashcupy._sinks)
    zc = cupy.asarray(z.detach())
    oc, lc = flashcupy.attention(*dev[1:], causal=True, kernel=kernel, sinks=zc, return_lse=True)
    gc = flashcupy.attention_backward(dev[0], *dev[1:], oc, lc, causal=True, kernel=kernel,
                                      deterministic=True, sinks=zc)
    for a, b in zip(eager, (oc, lc, *gc)):
        assert bool((cupy.asarray(a) == b).all())
    # compiled: the eager bits, with the LSE outside the loss and inside it
    compiled = torch.compile(call, fullgraph=True)
    for with_lse in (False, True):
        want = eager if not with_lse else run(call, q, k, v, z, with_lse=True)
        got = run(compiled, q, k, v, z, with_lse=with_lse)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), want, got):
            assert torch.equal(a, b), (name, with_lse, (a.float() - b.float()).abs().max().item())
    if layout == "bhnd":
        args = (q.detach(), k.detach(), v.detach(), True, None, None, None, "fp32", kernel, None, True,
                -1, -1, 0.0, z.detach())
        torch.library.opcheck(torch.ops.flashcupy.attention.default, args)
        o2, lse2 = torch.ops.flashcupy.attention(*args)
        bwd = (do, *args[:3], o2, lse2, dl, True, None, "fp32", kernel, True, -1, -1, 0.0, z.detach())
        torch.library.opcheck(torch.ops.flashcupy.attention_backward.default, bwd)
    # frozen sinks (no gradient asked): the same q, k, v gradients
    frozen = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    fct.attention(*frozen, causal=True, kernel=kernel, deterministic=True, sinks=z.detach()).backward(do)
    for a, b in zip(eager[2:5], (t.grad for t in frozen)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor of shape \(Hq,\) = \(4,\)"):
        fct.attention(q, k, v, sinks=z[:3])
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor on cuda"):
        fct.attention(q, k, v, sinks=z.detach().cpu())
