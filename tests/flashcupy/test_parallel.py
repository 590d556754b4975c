"""flashcupy.parallel: the zigzag layout, and ring attention simulated in one process (on the NumPy twin
here) against the float64 attention of the whole sequence, forward and backward, causal and not; the
running output and the travelling gradients in bf16 against float32."""
from __future__ import annotations

import numpy as np
import pytest

from flashcupy import naive, parallel, reference
from flashcupy._checks import numpy_dtype
from flashcupy.accuracy import assert_accurate, backward_reduction
from tests.helpers import do_qkv


def test_zigzag_layout_round_trips_and_balances(rng):
    x = rng.standard_normal((1, 2, 48, 4))
    shards = [parallel.zigzag_shard(x, 3, r) for r in range(3)]
    assert [parallel.zigzag_chunks(3, r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    np.testing.assert_array_equal(shards[1][:, :, :8], x[:, :, 8:16])
    np.testing.assert_array_equal(shards[1][:, :, 8:], x[:, :, 32:40])
    np.testing.assert_array_equal(parallel.zigzag_unshard(shards), x)
    # causal work per rank (visible pairs of its query rows): equal under the zigzag layout
    w = 3
    work = [sum(i + 1 for c in parallel.zigzag_chunks(w, r) for i in range(c * 8, c * 8 + 8))
            for r in range(w)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 10"):
        parallel.zigzag_shard(x, 5, 0)
    with pytest.raises(ValueError, match="rank must be"):
        parallel.zigzag_chunks(3, 3)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        parallel.zigzag_shard(x, 0, 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dname", ["f32", "bf16"])
def test_simulated_ring_matches_the_whole_attention(rng, dname, world, causal):
    """The ring's chunk pairs, merged in its order, give the whole sequence's attention and gradients
    within the accuracy rule against float64 (the naive same-precision attention sets the bound)."""
    do, q, k, v = do_qkv(rng, (1, 4, 2, 96, 96, 16), dname)
    o, lse, *grads = parallel.simulate_ring(q, k, v, world, causal=causal, do=do)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_accurate(o, o_ref, naive.attention(q, k, v, causal=causal), dname, "fp32", what="o")
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-5 * (1 + np.abs(lse_ref).max()))
    refs = reference.attention_backward(do, q, k, v, causal=causal)
    naives = naive.attention_backward(do, q, k, v, causal=causal)
    for name, g, r, n_ in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert_accurate(g, r, n_, dname, "fp32", kind="bwd", reduction=backward_reduction(q, k), what=name)


def test_bf16_running_state_and_gradients_lose_accuracy_with_ranks(rng):
    """With 16 ranks the bf16 running output and bf16 travelling dk, dv are several times worse against
    float64 than the float32 ones (the merge and the ring's sums of bf16 parts)."""
    do, q, k, v = do_qkv(rng, (1, 2, 1, 256, 256, 16), "bf16")
    ref = (reference.attention(q, k, v), *reference.attention_backward(do, q, k, v))
    err = {}
    for dt in ("float32", "bfloat16"):
        out = parallel.simulate_ring(q, k, v, 16, do=do, state_dtype=dt, grad_dtype=dt)
        err[dt] = [np.abs(a.astype(np.float64) - r).max() for a, r in zip((out[0], *out[2:]), ref)]
    assert err["bfloat16"][0] > 2 * err["float32"][0]          # o
    assert err["bfloat16"][2] > 2 * err["float32"][2]          # dk


def test_simulate_ring_refuses_what_it_does_not_run(rng):
    _, q, k, v = do_qkv(rng, (1, 2, 1, 40, 40, 16), "f32")
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size"):
        parallel.simulate_ring(q, k, v, 3)
    with pytest.raises(TypeError, match="kernel, accum and scale"):
        parallel.simulate_ring(q, k, v, 2, window_size=(3, 0))
    with pytest.raises(ValueError, match="state_dtype"):
        parallel.simulate_ring(q, k, v, 2, state_dtype="f16")
    with pytest.raises(ValueError, match="one length"):
        parallel.simulate_ring(q, k[:, :, :20], v[:, :, :20], 2)


@pytest.mark.parametrize("causal", [False, True])
def test_simulate_ring_adds_in_the_rings_order(rng, causal):
    """The ring as its ranks run it, written out here step by step (each rank's block travels with its
    dk, dv buffer; every addition rounded to bf16 where it happens), gives simulate_ring's bits: the order
    of the bf16 additions is the documented one (a reversed step order changes the bits)."""
    import flashcupy

    world, bf16 = 4, numpy_dtype("bf16")
    do, q, k, v = do_qkv(rng, (1, 2, 2, 64, 64, 16), "bf16")
    o, lse, *grads = parallel.simulate_ring(q, k, v, world, causal=causal, do=do, state_dtype="bfloat16",
                                            grad_dtype="bfloat16")
    c = 64 // (2 * world)

    def chunk(x, i):
        return x[:, :, i * c:(i + 1) * c]

    def add(total, part):
        return (total.astype(np.float32) + part.astype(np.float32)).astype(bf16)

    dq = {i: np.zeros(chunk(q, i).shape, bf16) for i in range(2 * world)}
    travelling = {i: [np.zeros(chunk(k, i).shape, bf16)] * 2 for i in range(2 * world)}  # dk, dv of chunk i
    for step in range(world):
        for rank in range(world):
            block = (rank - step) % world  # the K/V block this rank holds at this step
            for qc in parallel.zigzag_chunks(world, rank):
                for kc in parallel.zigzag_chunks(world, block):
                    if causal and kc > qc:
                        continue
                    g = flashcupy.attention_backward(chunk(do, qc), chunk(q, qc), chunk(k, kc), chunk(v, kc),
                                                     chunk(o, qc), np.ascontiguousarray(chunk(lse, qc)),
                                                     causal=causal and kc == qc)
                    dq[qc] = add(dq[qc], g[0])
                    travelling[kc] = [add(travelling[kc][0], g[1]), add(travelling[kc][1], g[2])]
    want = (np.concatenate([dq[i] for i in range(2 * world)], axis=2),
            np.concatenate([travelling[i][0] for i in range(2 * world)], axis=2),
            np.concatenate([travelling[i][1] for i in range(2 * world)], axis=2))
    for got, ref in zip(grads, want):
        np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_one_rank_is_one_call_over_the_sequence(rng):
    """simulate_ring with one rank: the bits of one flashcupy.attention / attention_backward call over the
    whole sequence (no chunks, no merge; any length)."""
    import flashcupy

    q, k, v, do = (rng.standard_normal((1, 2, 45, 16)).astype(np.float16) for _ in range(4))
    got = parallel.simulate_ring(q, k, v, 1, causal=True, do=do)
    o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    want = (o, lse, *flashcupy.attention_backward(do, q, k, v, o, lse, causal=True))
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_zigzag_unshard_refuses_shards_it_cannot_join():
    with pytest.raises(ValueError, match="at least one rank"):
        parallel.zigzag_unshard([])
    with pytest.raises(ValueError, match="one shape with an even length"):
        parallel.zigzag_unshard([np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2))])
    with pytest.raises(ValueError, match="one shape with an even length"):
        parallel.zigzag_unshard([np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 6, 2))])


def test_simulated_ring_refuses_v_and_do_of_other_shapes():
    q = np.zeros((1, 2, 8, 16), np.float16)
    with pytest.raises(ValueError, match="v must have k's shape"):
        parallel.simulate_ring(q, q, q[:, :, :4], 2)
    with pytest.raises(ValueError, match=r"do \(1, 2, 4, 16\)"):
        parallel.simulate_ring(q, q, q, 2, do=q[:, :, :4])
