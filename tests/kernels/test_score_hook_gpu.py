"""The score hook (kernels_cu/flash_common.cuh, FcScoreHook) reaches every kernel where the algorithm needs
it: built with its test arm (FC_SCORE_HOOK 1: t = s / 2), every family's forward and deterministic backward
give, bit for bit on bf16 and float32 elements, the attention of half the scale, which reaches the kernels
by another road (the exponent's constant). (With fp16 elements halving and rounding do not commute below
2^-14, so fp16 would need a tolerance; the atomic backwards, D > 64 and fp16 accumulators are not run
here yet.)
A kernel that skipped the hook in its forward or in the backward's P would be off by the factor in the
exponent; one that skipped the derivative would return dQ and dK twice too large."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy.inspect import kernel_build
from tests.helpers import do_qkv, to_device

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def _run(kernel, views, scale, causal):
    do, q, k, v = views
    o, lse = flashcupy.attention(q, k, v, causal=causal, scale=scale, kernel=kernel, return_lse=True)
    grads = flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, kernel=kernel,
                                         deterministic=True)
    return (o, lse, *grads)


@pytest.mark.parametrize("kernel,dname", [("wgmma", "bf16"), ("mma", "bf16"), ("simt", "f32")])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_score_hook_reaches_every_kernel_forward_and_backward(rng, kernel, dname, causal):
    import cupy

    if kernel == "wgmma" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    views = to_device(*do_qkv(rng, (2, 4, 2, 150, 211, 64), dname))
    scale = 0.3
    with kernel_build(defines={"FC_SCORE_HOOK": 1}):
        hooked = _run(kernel, views, scale, causal)
    half = _run(kernel, views, scale / 2, causal)
    plain = _run(kernel, views, scale, causal)
    for name, a, b, c in zip(("o", "lse", "dq", "dk", "dv"), hooked, half, plain):
        a, b, c = (cupy.asnumpy(x).astype(np.float32) for x in (a, b, c))
        assert np.isfinite(a).all() and np.array_equal(a, b), name
        assert not np.array_equal(a, c), f"{name}: the hook changed nothing"


@pytest.mark.parametrize("approx", [1, 0], ids=["tanh.approx", "tanhf"])
def test_the_softcap_tanh_within_its_stated_error(approx):
    """fc_tanh (flash_common.cuh), compiled as the kernels compile it, against float64 tanh over a dense
    sweep of float32 arguments (every float32 in [-1/8, 1/8] spaced by 2^-20 and a uniform sweep to +-20):
    its largest absolute error is within accuracy.TANH_ABS, the bound the LSE rule adds per capped score
    (printed: the measured figure behind the constant)."""
    import cupy

    from flashcupy.accuracy import TANH_ABS

    src = ('#include "flash_common.cuh"\n'
           'extern "C" __global__ void tanh_probe(const float *x, float *y, int n) {\n'
           '    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = fc_tanh(x[i]); }\n')
    from flashcupy.inspect import Variant, nvrtc_options

    defines = {**Variant("fwd_simt", "f16", "fp32", 64, 64, 64).defines(), "FC_TANH_APPROX": approx}
    mod = cupy.RawModule(code=src, options=nvrtc_options(defines))
    x = np.concatenate([np.arange(-2.0 ** 17, 2.0 ** 17) * 2.0 ** -20,
                        np.linspace(-20, 20, 1 << 22)]).astype(np.float32)
    y = cupy.empty_like(cupy.asarray(x))
    mod.get_function("tanh_probe")(((x.size + 255) // 256,), (256,), (cupy.asarray(x), y, np.int32(x.size)))
    err = np.abs(cupy.asnumpy(y).astype(np.float64) - np.tanh(x.astype(np.float64)))
    worst = float(err.max())
    print(f"fc_tanh FC_TANH_APPROX={approx}: max abs error {worst:.3e} = 2^{np.log2(worst):.2f} at x = "
          f"{x[err.argmax()]!r}")
    assert worst <= TANH_ABS["approx" if approx else "accurate"]
