"""flashcupy.torch's compiled autograd node (flashcupy/_torch_node.cpp): it runs the launch plans from C++
and gives the Python node's bits, forward and backward, on every family, with autograd's gradients of any
strides, the LSE's gradient, and the Python fallback where a program does not run."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the torch bridge needs torch")


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


_BUILT: dict = {}


def _compiled():
    """The built extension (skip with the reason where it does not build)."""
    from flashcupy import _torch_node

    if "module" not in _BUILT:
        _BUILT["module"] = _torch_node.module()
    if _BUILT["module"] is None:
        pytest.skip(_torch_node.status())
    return _BUILT["module"]


def _use(monkeypatch, node: str) -> None:
    """Run the compiled node ("cpp") or the Python node ("python") from now on in this test."""
    import flashcupy.torch as fct
    from flashcupy import _torch_node

    mod = _compiled()
    monkeypatch.setitem(_torch_node._STATE, "module", mod if node == "cpp" else None)
    monkeypatch.setattr(fct, "_FORWARD_SIGNATURES", {})  # entries hold the node's programs


def _run(q, k, v, grads, loss, **knobs):
    """Outputs and gradients of one call: loss "do" (o against dO), "sum" (autograd's stride-0 dO), "lse"
    (o and the LSE against their gradients), "lse_only"."""
    import flashcupy.torch as fct

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = fct.attention(*leaves, return_lse=True, **knobs)
    node = lse.grad_fn  # o's is a transposition in layout="bnhd"; the LSE's is the node
    name = node.name()
    do, dlse = grads
    if loss == "do":
        o.backward(do)
    elif loss == "sum":
        o.sum().backward()
    elif loss == "lse":
        torch.autograd.backward((o, lse), (do, dlse))
    else:
        lse.backward(dlse)
    return name, (o.detach(), lse.detach(), *(x.grad for x in leaves))


CASES = [("wgmma", torch.bfloat16), ("mma", torch.float16), ("simt", torch.float32)]


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("loss", ["do", "sum", "lse", "lse_only"])
def test_compiled_node_gives_the_python_nodes_bits(rng, monkeypatch, kernel, dtype, deterministic, layout,
                                                   loss):
    """The same call through both nodes: o, the LSE, dK and dV bit for bit; dQ bit for bit where the
    backward is deterministic, else within the atomic order's rounding (the Python node against itself
    differs as much). GQA, odd lengths, Nq != Nk, a causal mask; in a poisoned allocator (NaN blocks
    reused), so an element the kernels do not write shows."""
    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    b, hq, hk, nq, nk, d = 2, 4, 2, 133, 201, 64
    shapes = [(b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d)]
    if layout == "bnhd":
        shapes = [(s[0], s[2], s[1], s[3]) for s in shapes]
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).to("cuda", dtype) for s in shapes)
    do = torch.from_numpy(rng.standard_normal(shapes[0])).to("cuda", dtype)
    dlse = torch.from_numpy(rng.standard_normal((b, hq, nq))).float().cuda()
    knobs = dict(causal=True, kernel=kernel, deterministic=deterministic, layout=layout)
    out = {}
    for node in ("python", "cpp"):
        _use(monkeypatch, node)
        # NaN blocks in the allocator's small pool, freed at once: the next allocations reuse them
        poison = [torch.full((1 << 17,), float("nan"), device="cuda") for _ in range(16)]
        del poison
        out[node] = _run(q, k, v, (do, dlse), loss, **knobs)
        if node == "cpp":  # the compiled programs ran, not the fallback: forward 1 launch, backward 3
            import flashcupy.torch as fct

            entry, = fct._FORWARD_SIGNATURES.values()
            assert entry.program.launch_count == 1
            assert entry.backward[deterministic].launch_count == 3
    assert out["python"][0] == "_EagerAttentionBackward"
    assert out["cpp"][0] == "torch::autograd::CppNode<flashcupy::AttentionNode>"
    py, cc = out["python"][1], out["cpp"][1]
    for name, a, c in zip(("o", "lse", "dq", "dk", "dv"), py, cc):
        assert bool(torch.isfinite(c).all()), name
        if name == "dq" and not deterministic and kernel != "simt":
            torch.testing.assert_close(c, a, rtol=0, atol=2 * torch.finfo(dtype).eps * float(a.abs().max()))
        else:
            assert torch.equal(a, c), name
    assert float(cc[3].abs().max()) > 0 and float(cc[2].abs().max()) > 0


def test_compiled_node_is_the_default_and_says_so(rng):
    """Eager calls with gradients run the compiled node where it builds; ``status`` says which node
    runs; a call without gradients runs the compiled forward and gives the same bits."""
    import flashcupy.torch as fct
    from flashcupy import _torch_node

    _compiled()
    assert _torch_node.status().startswith("compiled")
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 96, 64))).to("cuda", torch.float16)
               for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = fct.attention(q, k, v, causal=True)
    assert o.grad_fn.name() == "torch::autograd::CppNode<flashcupy::AttentionNode>"
    with torch.no_grad():
        assert torch.equal(fct.attention(q, k, v, causal=True), o)


def test_compiled_node_runs_off_the_current_device_and_stream(rng):
    """A call on a side stream orders with the work around it (the node launches on torch's current
    stream); tensors on another GPU than the current one run on theirs."""
    import flashcupy.torch as fct

    _compiled()
    q, k, v, do = (torch.from_numpy(rng.standard_normal((2, 4, 256, 64))).to("cuda", torch.float16)
                   for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_o = fct.attention(*leaves, causal=True, deterministic=True)
    ref = torch.autograd.grad(ref_o, leaves, do)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big.T / 64  # keeps the stream busy: unordered launches would race it
        o = fct.attention(*leaves, causal=True, deterministic=True)
        grads = torch.autograd.grad(o, leaves, do)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(o, ref_o) and all(torch.equal(a, b) for a, b in zip(grads, ref))
    if torch.cuda.device_count() < 2:
        return
    other = [x.to("cuda:1").requires_grad_() for x in (q, k, v)]
    o1 = fct.attention(*other, causal=True, deterministic=True)
    g1 = torch.autograd.grad(o1, other, do.to("cuda:1"))
    assert o1.device.index == 1 and torch.equal(o1.cpu(), ref_o.cpu())
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(g1, ref))


def test_compiled_node_backward_runs_first_on_a_fresh_autograd_thread():
    """In a fresh process the autograd engine's device thread has made no CUDA call when the node's
    backward launches (a contiguous dO needs no copy first): the node makes the context current itself;
    without that, cuLaunchKernel fails there with CUDA_ERROR_INVALID_CONTEXT."""
    import os
    import subprocess
    import sys

    _compiled()
    code = (
        "import torch, flashcupy.torch as ft\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "q, k, v, do = (torch.randn(1, 2, 128, 64, device='cuda', dtype=torch.float16, generator=g)"
        " for _ in range(4))\n"
        "q, k, v = (x.requires_grad_() for x in (q, k, v))\n"
        "o = ft.attention(q, k, v, causal=True, deterministic=True)\n"
        "o.backward(do)\n"
        "torch.cuda.synchronize()\n"
        "for x in (q, k, v):\n"
        "    assert bool(torch.isfinite(x.grad).all()) and float(x.grad.abs().max()) > 0\n"
        "print(o.grad_fn.name(), 'ok')\n")
    env = dict(os.environ, FLASHCUPY_TORCH_NODE="cpp")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CppNode<flashcupy::AttentionNode> ok" in run.stdout


def test_compiled_autograd_traces_the_backward_of_either_node(rng):
    """torch's compiled autograd over a backward of the compiled node (forward run eagerly, backward
    under compiled autograd: its tracing modes send the node's backward to the custom operator) and
    of a forward made under compiled autograd (the Python node): the eager gradients, bit for bit."""
    from torch._dynamo import compiled_autograd

    import flashcupy.torch as fct

    _compiled()
    q, k, v, do = (torch.from_numpy(rng.standard_normal((1, 2, 160, 64))).to("cuda", torch.float16)
                   for _ in range(4))

    def grads(where):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        compiler = torch.compile(backend="eager")
        if where == "eager":
            o = fct.attention(*leaves, causal=True, deterministic=True)
            o.backward(do)
        elif where == "backward":
            o = fct.attention(*leaves, causal=True, deterministic=True)
            assert "AttentionNode" in o.grad_fn.name()
            with compiled_autograd._enable(compiler):
                o.backward(do)
        else:
            with compiled_autograd._enable(compiler):
                o = fct.attention(*leaves, causal=True, deterministic=True)
                assert o.grad_fn.name() == "_EagerAttentionBackward"
                o.backward(do)
        return [x.grad for x in leaves]

    ref = grads("eager")
    for where in ("backward", "both"):
        assert all(torch.equal(a, b) for a, b in zip(grads(where), ref)), where


def test_a_forward_under_kernel_build_backs_through_the_packages_kernels(rng, monkeypatch):
    """The compiled node's backward runs the package's own kernels, as the Python node's (autograd's
    thread is outside the block), whatever ``kernel_build`` block the forward ran in."""
    import flashcupy.torch as fct
    from flashcupy import _launch
    from flashcupy.inspect import kernel_build

    _compiled()
    monkeypatch.setattr(fct, "_FORWARD_SIGNATURES", {})
    monkeypatch.setattr(_launch, "_BACKWARD_PLANS", {})
    q, k, v, do = (torch.from_numpy(rng.standard_normal((1, 2, 96, 64))).to("cuda", torch.float16)
                   for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with kernel_build(defines={"FC_TEST_PROBE": 1}):
        o = fct.attention(*leaves, causal=True, deterministic=True)
    o.backward(do)
    assert _launch._BACKWARD_PLANS and all(key[0].variant.build is None for key in _launch._BACKWARD_PLANS)
    ref = torch.autograd.grad(fct.attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                                            causal=True, deterministic=True), (q, k, v), do)
    assert all(torch.equal(x.grad, r) for x, r in zip(leaves, ref))


def test_a_backward_after_the_memo_started_over_takes_the_fallback(rng, monkeypatch):
    """A graph whose backward program is gone (the signature memo started over and nothing else holds
    the program) runs the Python fallback: the same gradients, no dangling program."""
    import gc

    import flashcupy.torch as fct

    _compiled()
    monkeypatch.setattr(fct, "_FORWARD_SIGNATURES", {})
    q, k, v, do = (torch.from_numpy(rng.standard_normal((1, 2, 96, 64))).to("cuda", torch.float16)
                   for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = fct.attention(*leaves, causal=True, deterministic=True)
    fct._FORWARD_SIGNATURES.clear()
    gc.collect()
    called = []
    real = fct._node_fallback
    fct._torch_node.module().set_fallback(lambda *a: called.append(1) or real(*a))
    try:
        o.backward(do)
    finally:
        fct._torch_node.module().set_fallback(real)
    assert called == [1]
    ref = torch.autograd.grad(fct.attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                                            causal=True, deterministic=True), (q, k, v), do)
    assert all(torch.equal(x.grad, r) for x, r in zip(leaves, ref))
