"""flashcupy.torch on the training path: eager calls bypass the custom operator (the same two functions,
the same bits), remember their checks and plans per signature, take the general path where the fast one
cannot go, and a small transformer trains through them as it does through SDPA."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the torch bridge needs torch")


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _tensors(rng, shapes, dtype=torch.float16, grad=True):
    return [torch.from_numpy(rng.standard_normal(s)).to("cuda", dtype).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "simt"])
def test_eager_calls_skip_the_operator_and_give_its_bits(rng, kernel):
    """An eager call with gradients runs an autograd node of its own (no custom-op dispatch), a call
    without them the forward alone; both give the custom operator's bits, forward and (deterministic)
    backward, and the LSE-only loss (dO absent: None, made zeros) the operator's gradients too."""
    import flashcupy.torch as fct

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    dtype = torch.float32 if kernel == "simt" else torch.bfloat16
    q, k, v = _tensors(rng, [(2, 4, 150, 64), (2, 2, 190, 64), (2, 2, 190, 64)], dtype)
    do, = _tensors(rng, [(2, 4, 150, 64)], dtype, grad=False)
    g = torch.from_numpy(rng.standard_normal((2, 4, 150))).float().cuda()
    knobs = dict(kernel=kernel, deterministic=True)
    o, lse = fct.attention(q, k, v, causal=True, return_lse=True, **knobs)
    # the Python node or the compiled one (flashcupy/_torch_node.cpp)
    assert o.grad_fn.name() in ("_EagerAttentionBackward",
                                "torch::autograd::CppNode<flashcupy::AttentionNode>")
    eager = torch.autograd.grad((o, lse), (q, k, v), (do, g))
    lse_only = torch.autograd.grad(fct.attention(q, k, v, causal=True, return_lse=True, **knobs)[1],
                                   (q, k, v), g)
    args = (q, k, v, True, None, None, None, "fp32", kernel, None, True)
    o2, lse2 = torch.ops.flashcupy.attention(*args)
    assert "flashcupy" in type(o2.grad_fn).__name__ and "Eager" not in type(o2.grad_fn).__name__
    op = torch.autograd.grad((o2, lse2), (q, k, v), (do, g))
    op_lse_only = torch.autograd.grad(torch.ops.flashcupy.attention(*args)[1], (q, k, v), g)
    with torch.no_grad():
        o3, lse3 = fct.attention(q, k, v, causal=True, return_lse=True, **knobs)
    assert o3.grad_fn is None
    for a, b in [(o, o2), (lse, lse2), (o3, o2), (lse3, lse2), *zip(eager, op), *zip(lse_only, op_lse_only)]:
        assert torch.equal(a, b)
    assert all(float(x.abs().max()) > 0 for x in (*eager, *lse_only[:2]))  # d lse / dv = 0


def test_create_graph_gives_the_same_gradients_and_a_second_backward_raises(rng):
    """Under create_graph=True the eager backward gives the usual bits, and differentiating its
    gradients again raises (they were computed without a graph: a second backward would drop their
    part; dO requires grad here, as it does when it comes from differentiable upstream work)."""
    import flashcupy.torch as fct

    q, k, v, do = _tensors(rng, [(1, 2, 96, 64)] * 4)
    plain = torch.autograd.grad(fct.attention(q, k, v, causal=True, deterministic=True), (q, k, v), do)
    graph = torch.autograd.grad(fct.attention(q, k, v, causal=True, deterministic=True), (q, k, v), do,
                                create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, graph)) and float(plain[0].abs().max()) > 0
    with pytest.raises(RuntimeError, match="once_differentiable"):
        graph[0].float().square().sum().backward()


def test_a_known_signature_is_not_checked_again(rng, monkeypatch):
    """The second call of a signature runs without the checks (they would raise here) and makes no
    CuPy views; another stride pattern is a new signature and is checked."""
    import flashcupy.torch as fct

    monkeypatch.setattr(fct, "_FORWARD_SIGNATURES", {})  # whatever earlier tests remembered
    monkeypatch.setattr(fct, "_BACKWARD_SIGNATURES", {})
    q, k, v = _tensors(rng, [(1, 4, 100, 64)] * 3)
    first = fct.attention(q, k, v, causal=True, deterministic=True)
    first.backward(torch.ones_like(first))
    grads = [x.grad.clone() for x in (q, k, v)]

    def refuse(*args, **kwargs):
        raise AssertionError("checked again")

    for name in ("forward_problem", "backward_problem", "_cp"):
        monkeypatch.setattr(fct, name, refuse)
    for x in (q, k, v):
        x.grad = None
    again = fct.attention(q, k, v, causal=True, deterministic=True)
    again.backward(torch.ones_like(again))
    assert torch.equal(again, first) and all(torch.equal(x.grad, g) for x, g in zip((q, k, v), grads))
    with pytest.raises(AssertionError, match="checked again"):
        fct.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=True)


@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_general_paths_give_the_fast_paths_bits(rng, kernel):
    """Inputs that start off the 16-byte grid (forward and backward), a non-contiguous lse or dlse
    handed to the backward operator and autograd's stride-0 dO (``o.sum()``) take the general or the
    copying path: the bits of contiguous inputs, which are also the CuPy entry point's bits."""
    import flashcupy.torch as fct

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    shape = (2, 4, 130, 64)
    q, k, v = _tensors(rng, [shape] * 3, grad=False)
    n = q.numel()
    buf = torch.empty(3 * n + 8, dtype=q.dtype, device="cuda")
    views = []
    for i, x in enumerate((q, k, v)):  # starts 2 bytes past a 16-byte boundary
        view = buf[1 + i * n: 1 + (i + 1) * n].view(shape)
        view.copy_(x)
        assert view.data_ptr() % 16 == 2
        views.append(view)
    knobs = dict(causal=True, kernel=kernel, deterministic=True)
    assert torch.equal(fct.attention(*views, **knobs), fct.attention(q, k, v, **knobs))

    args = ("fp32", kernel, True)
    o, lse = torch.ops.flashcupy.attention(q, k, v, True, None, None, None, "fp32", kernel, None, True)
    do, = _tensors(rng, [shape], grad=False)
    dlse = torch.from_numpy(rng.standard_normal(lse.shape)).float().cuda()

    def strided(x):  # every other float of a buffer: not contiguous
        out = torch.empty(x.shape + (2,), device="cuda")[..., 0]
        out.copy_(x)
        assert not out.is_contiguous()
        return out

    for g in (None, dlse):
        base = torch.ops.flashcupy.attention_backward(do, q, k, v, o, lse, g, True, None, *args)
        moved = torch.ops.flashcupy.attention_backward(do, q, k, v, o, strided(lse),
                                                       None if g is None else strided(g), True, None, *args)
        assert all(torch.equal(a, b) for a, b in zip(base, moved))
        # the CuPy entry point (its own checks and copies) on the same memory
        cupy = pytest.importorskip("cupy")
        import flashcupy

        views = [cupy.from_dlpack(x.detach()) for x in (do, q, k, v, o, lse)]
        ref = flashcupy.attention_backward(*views, causal=True, kernel=kernel, deterministic=True,
                                           dlse=None if g is None else cupy.from_dlpack(g))
        torch.cuda.synchronize()
        for a, b in zip(base, ref):
            assert bool((cupy.from_dlpack(a.detach()) == b).all())
    off_grid = buf[1: 1 + n].view(shape)  # dO off the 16-byte grid: the backward's general path
    off_grid.copy_(do)
    moved = torch.ops.flashcupy.attention_backward(off_grid, q, k, v, o, lse, dlse, True, None, *args)
    assert all(torch.equal(a, b) for a, b in zip(base, moved))

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fct.attention(*leaves, **knobs).sum().backward()  # dO: ones expanded, strides 0
    ones = torch.ones(shape, dtype=q.dtype, device="cuda")
    expected = torch.ops.flashcupy.attention_backward(ones, q, k, v, o, lse, None, True, None, *args)
    assert all(torch.equal(x.grad, e) for x, e in zip(leaves, expected))


class _Block(torch.nn.Module):
    """Pre-norm transformer block: causal multi-head attention and an MLP, with ``attend(q, k, v)`` on
    (B, N, H, D) views."""

    def __init__(self, width, heads, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, w // self.heads).unbind(2)
        x = x + self.proj(self.attend(q, k, v).reshape(b, n, w))
        return x + self.mlp(self.norm2(x))


def _train(attend, steps=60, seed=0):
    """Losses of a 2-layer causal language model on a fixed task (each sequence draws its tokens from
    its own 4 of the 64: the next token is predictable, to ln 4, only from the tokens before it, through
    attention), AdamW on fp32 master weights, bf16 activations under autocast, the same initial weights
    and batches for every ``attend``."""
    torch.manual_seed(seed)
    vocab, width, heads, n, batch = 64, 256, 4, 256, 16
    emb = torch.nn.Embedding(vocab, width)
    pos = torch.nn.Parameter((torch.randn(n, width) * 0.02).cuda())
    blocks = torch.nn.ModuleList([_Block(width, heads, attend) for _ in range(2)])
    head = torch.nn.Linear(width, vocab)
    model = torch.nn.ModuleList([emb, blocks, head]).cuda()
    opt = torch.optim.AdamW(list(model.parameters()) + [pos], lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        subsets = torch.rand(batch, vocab, generator=gen).argsort(dim=1)[:, :4]
        tokens = subsets.gather(1, torch.randint(0, 4, (batch, n), generator=gen)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = emb(tokens[:, :-1]) + pos[: n - 1]
            for block in blocks:
                x = block(x)
            logits = head(x).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return np.array(losses)


def test_a_two_layer_transformer_trains_like_with_sdpa():
    """The loss curve of flashcupy.torch stays as close to SDPA's as SDPA's own math backend does
    (the noise between two correct attention implementations in bf16), the model learns (each
    sequence's tokens), and the check can fail: a non-causal attention (which sees the answer) leaves the
    band."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcupy.torch as fct

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)

    def ours(q, k, v):
        return fct.attention(q, k, v, causal=True, layout="bnhd")

    def leaky(q, k, v):
        return fct.attention(q, k, v, causal=False, layout="bnhd")

    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fast):  # not the math backend, the noise's other end
        ref = _train(sdpa)
    with sdpa_kernel(SDPBackend.MATH):
        math = _train(sdpa)
    mine = _train(ours)
    noise = np.abs(math - ref).max()
    # every token is as frequent as any other: below ln(vocab) only by attending to the context
    assert ref[-5:].mean() < np.log(64) - 0.5, f"the model does not learn: {ref[0]:.3f} -> {ref[-1]:.3f}"
    band = 3 * noise + 1e-3 * ref[0]
    gap = np.abs(mine - ref).max()
    assert gap <= band, f"flashcupy's curve leaves SDPA's by {gap:.4f} (math backend's noise {noise:.4f})"
    assert np.abs(_train(leaky) - ref).max() > 5 * band
