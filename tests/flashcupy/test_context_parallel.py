"""flashcupy.parallel.ring_attention and ulysses_attention across processes: torch.distributed with gloo
on the CPU, where each rank's calls run the NumPy twin. Ring: every rank's o, lse, dq, dk, dv must be
the bits of the matching shard of ``simulate_ring`` on the whole sequence (the same calls, merges and
roundings), o within the accuracy rule of the float64 reference. Ulysses: the bits of one call over the
whole sequence. A call whose ranks disagree must raise on every rank.
(Skipped without torch, as in the CI's test extra; the GPU version runs under torchrun on the
multi-GPU kinds.)"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from flashcupy import parallel, reference  # noqa: E402
from flashcupy._checks import numpy_dtype  # noqa: E402

SHAPE = dict(b=1, hq=4, hkv=2, d=32, c=24)  # c: a chunk's length (not a multiple of 16)


def _inputs(world: int, dtype: str, seed: int, heads=(4, 2)):
    rng = np.random.default_rng(seed)
    n = 2 * world * SHAPE["c"]
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((SHAPE["b"], heads[0], n, SHAPE["d"])).astype(dt)
    k = rng.standard_normal((SHAPE["b"], heads[1], n, SHAPE["d"])).astype(dt)
    v = rng.standard_normal((SHAPE["b"], heads[1], n, SHAPE["d"])).astype(dt)
    do = rng.standard_normal(q.shape).astype(dt)
    return q, k, v, do


def _dlse(q):
    """A seeded gradient of the LSE (float32 (B, Hq, N)), the same on every rank."""
    return np.random.default_rng(5).standard_normal(q.shape[:3]).astype(np.float32)


def _tensor(a):
    if a.dtype == numpy_dtype("bf16"):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _array(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bf16"))
    return t.numpy()


def _worker(rank: int, world: int, store: str, out: str, case: dict):
    gpu = case.get("gpu", False)
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        if case.get("mismatch"):
            odd = torch.randn((1, 4, 2 * SHAPE["c"] + 1, SHAPE["d"]))
            with pytest.raises(ValueError, match="its length must be even"):  # (local: no transfer)
                parallel.ring_attention(odd, odd, odd)
            with pytest.raises(ValueError, match="must be multiples of 2"):
                parallel.ulysses_attention(odd[:, :3], odd[:, :3], odd[:, :3])
            # a bad knob value is the local checks' (no transfer starts), and the group stays usable
            good = torch.randn((1, 4, 2 * SHAPE["c"], SHAPE["d"]))
            with pytest.raises(ValueError, match="kernel must be one of"):
                parallel.ring_attention(good, good[:, :2], good[:, :2], kernel="bogus")
            with pytest.raises(ValueError, match="kernel must be one of"):
                parallel.ulysses_attention(good, good[:, :2], good[:, :2], kernel="bogus")
            assert parallel.ring_attention(good, good[:, :2], good[:, :2], causal=True).shape == good.shape
            # ranks that disagree on whether gradients are asked are named before any transfer
            asks = good.clone().requires_grad_(rank == 0)
            with pytest.raises(ValueError, match="rank 1 of the group called with"):
                parallel.ring_attention(asks, good[:, :2], good[:, :2])
            shape = (1, 4, 2 * SHAPE["c"] + (2 if rank == 1 else 0), SHAPE["d"])
            x = torch.randn(shape)
            try:
                parallel.ring_attention(x, x[:, :2], x[:, :2])
            except ValueError as e:
                np.save(f"{out}/err{rank}.npy", np.array(str(e)))
            return
        q, k, v, do = _inputs(world, case["dtype"], case["seed"], case.get("heads", (4, 2)))
        if case.get("ulysses"):
            n = q.shape[2] // world
            shard = [_tensor(x[:, :, rank * n:(rank + 1) * n]) for x in (q, k, v, do)]
            dl = torch.from_numpy(_dlse(q)[:, :, rank * n:(rank + 1) * n].copy())
            if gpu:
                shard, dl = [t.cuda() for t in shard], dl.cuda()
            leaves = [t.requires_grad_(True) for t in shard[:3]]
            o, lse = parallel.ulysses_attention(*leaves, causal=case["causal"], return_lse=True,
                                                deterministic=gpu)
            torch.autograd.backward((o, lse), (shard[3], dl))
            got = [_array(t) for t in (o, lse, *(x.grad for x in leaves))]
            np.savez(f"{out}/rank{rank}.npz", *[x.view(np.uint8) for x in got])
            return
        shard = [_tensor(parallel.zigzag_shard(x, world, rank)) for x in (q, k, v, do)]
        if gpu:
            shard = [t.cuda() for t in shard]
        leaves = [t.requires_grad_(True) for t in shard[:3]]
        o, lse = parallel.ring_attention(*leaves, causal=case["causal"], return_lse=True,
                                         state_dtype=case["state"], grad_dtype=case["grad"],
                                         deterministic=gpu)
        o.backward(shard[3])
        got = [_array(t) for t in (o, lse, *(x.grad for x in leaves))]
        np.savez(f"{out}/rank{rank}.npz", *[x.view(np.uint8) for x in got])
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, world: int, case: dict):
    store = tmp_path / "store"
    torch.multiprocessing.spawn(_worker, args=(world, str(store), str(tmp_path), case), nprocs=world,
                                join=True)


@pytest.mark.parametrize("world,causal,dtype,state", [
    (1, True, "f16", "float32"), (2, False, "f16", "float32"), (2, True, "f16", "float32"),
    (3, True, "f16", "float32"), (3, True, "bf16", "bfloat16")])
def test_ring_over_gloo_gives_the_simulated_rings_bits(tmp_path, world, causal, dtype, state):
    case = dict(dtype=dtype, causal=causal, state=state, grad=state, seed=100 + world)
    _spawn(tmp_path, world, case)
    q, k, v, do = _inputs(world, dtype, case["seed"])
    want = parallel.simulate_ring(q, k, v, world, causal=causal, do=do, state_dtype=state, grad_dtype=state)
    o_ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    for rank in range(world):
        files = np.load(tmp_path / f"rank{rank}.npz")
        got = [files[f"arr_{i}"] for i in range(5)]
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            shard = parallel.zigzag_shard(w, world, rank)
            assert np.array_equal(g, np.ascontiguousarray(shard).view(np.uint8)), (name, rank)
    # the whole sequence's o, assembled from the ranks, against float64 (the ring's merges included)
    o = parallel.zigzag_unshard([np.load(tmp_path / f"rank{r}.npz")["arr_0"].view(q.dtype)
                                 for r in range(world)])
    err = np.abs(o.astype(np.float64) - o_ref).max() / np.abs(o_ref).max()
    assert err < (1e-2 if dtype == "bf16" else 2e-3), err


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_ring_over_nccl_gives_the_simulated_rings_bits_on_the_kernels(tmp_path, causal):
    """The same on two GPUs (NCCL; the kernels, deterministic backward): every rank's shard is the bits
    of ``simulate_ring`` on CuPy arrays (GPU 0, the same kernels)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h100-x2)")
    import cupy

    world = 2
    case = dict(dtype="f16", causal=causal, state="float32", grad="float32", seed=7, gpu=True)
    _spawn(tmp_path, world, case)
    q, k, v, do = (cupy.asarray(x) for x in _inputs(world, "f16", 7))
    want = parallel.simulate_ring(q, k, v, world, causal=causal, do=do, deterministic=True)
    for rank in range(world):
        files = np.load(tmp_path / f"rank{rank}.npz")
        for i, (name, w) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), want)):
            shard = cupy.asnumpy(cupy.ascontiguousarray(parallel.zigzag_shard(w, world, rank)))
            assert np.array_equal(files[f"arr_{i}"], shard.view(np.uint8)), (name, rank)


@pytest.mark.parametrize("world,causal,dtype,heads", [(2, True, "f16", (4, 2)), (4, False, "bf16", (8, 4)),
                                                     (4, True, "f16", (8, 4))])
def test_ulysses_over_gloo_gives_one_calls_bits(tmp_path, world, causal, dtype, heads):
    """Every rank's o, lse and gradients (the loss uses o and the LSE) are the bits of the matching
    shard of one flashcupy.attention / attention_backward call over the whole sequence."""
    import flashcupy

    case = dict(ulysses=True, dtype=dtype, causal=causal, seed=200 + world, heads=heads)
    _spawn(tmp_path, world, case)
    q, k, v, do = _inputs(world, dtype, case["seed"], heads)
    o, lse = flashcupy.attention(q, k, v, causal=causal, return_lse=True)
    want = (o, lse, *flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal, dlse=_dlse(q)))
    n = q.shape[2] // world
    for rank in range(world):
        files = np.load(tmp_path / f"rank{rank}.npz")
        for i, (name, w) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), want)):
            shard = np.ascontiguousarray(w[:, :, rank * n:(rank + 1) * n])
            assert np.array_equal(files[f"arr_{i}"], shard.view(np.uint8)), (name, rank)


@pytest.mark.gpu
def test_ulysses_over_nccl_gives_one_calls_bits_on_the_kernels(tmp_path):
    """Ulysses on two GPUs (NCCL; the kernels, deterministic backward): every rank's shard is the bits of
    one call over the whole sequence on GPU 0."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h100-x2)")
    import cupy

    import flashcupy

    world = 2
    case = dict(ulysses=True, dtype="f16", causal=True, seed=9, heads=(4, 2), gpu=True)
    _spawn(tmp_path, world, case)
    q, k, v, do = (cupy.asarray(x) for x in _inputs(world, "f16", 9, (4, 2)))
    o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    want = (o, lse, *flashcupy.attention_backward(do, q, k, v, o, lse, causal=True,
                                                  dlse=cupy.asarray(_dlse(q)), deterministic=True))
    n = q.shape[2] // world
    for rank in range(world):
        files = np.load(tmp_path / f"rank{rank}.npz")
        for i, (name, w) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), want)):
            shard = cupy.asnumpy(cupy.ascontiguousarray(w[:, :, rank * n:(rank + 1) * n]))
            assert np.array_equal(files[f"arr_{i}"], shard.view(np.uint8)), (name, rank)


def test_ranks_that_disagree_are_named_on_every_rank(tmp_path):
    _spawn(tmp_path, 2, dict(mismatch=True))
    for rank in range(2):
        text = str(np.load(tmp_path / f"err{rank}.npy"))
        assert "rank 1 of the group called with" in text, text


def test_bad_arguments_are_refused_before_any_transfer():
    x = torch.zeros((1, 2, 6, 8))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        parallel.ring_attention(np.zeros((1, 2, 6, 8)), x, x)
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        parallel.ring_attention(x, x, x)
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        parallel.ring_attention(x, x, x, state_dtype="float64")
    with pytest.raises(TypeError, match="takes the knobs"):
        parallel.ring_attention(x, x, x, block_m=64)
    with pytest.raises(TypeError, match="causal must be a bool"):
        parallel.ulysses_attention(x, x, x, causal=1)
    with pytest.raises(RuntimeError, match="ulysses_attention needs an initialized"):
        parallel.ulysses_attention(x, x, x)


def test_zigzag_shards_torch_tensors_as_numpy_arrays():
    """zigzag_shard / zigzag_unshard take ring_attention's torch tensors: the same shards as on NumPy, and
    the round trip is the identity."""
    x = torch.arange(2 * 3 * 12 * 2, dtype=torch.float32).reshape(2, 3, 12, 2)
    shards = [parallel.zigzag_shard(x, 3, r) for r in range(3)]
    for r, s in enumerate(shards):
        assert isinstance(s, torch.Tensor)
        assert np.array_equal(s.numpy(), parallel.zigzag_shard(x.numpy(), 3, r))
    assert torch.equal(parallel.zigzag_unshard(shards), x)
