"""``flashcupy.inspect``: what the kernels are, for the people who study them.

The public window on the build layer: which kernel variant a call runs, its source (``variant_source``;
``source_text`` reads a file of ``kernels_cu/``), NVRTC options, PTX and ptxas report (none of these need
a GPU; compiling needs CuPy's NVRTC), the family table, the covering sets of variants the compile
tests check, builds with changed ``-D`` values or a changed copy of ``kernels_cu/``, and ``tensorcore``:
the tensor cores' accumulation as measured on Hopper, which the NumPy twin applies (its ``matmul``,
``accumulate``, ``MEASURED`` alignment widths and roundings, ``K_STEP``). ``analysis`` uses only this
module and the public API (the tests also test the private modules' own behaviour); the private modules
behind it (``_families``: what each family can run; ``_policy``: the measured choices; ``_variant``;
``_compile``; ``_checks``; ``_launch``) may change shape without notice.

    >>> from flashcupy import inspect
    >>> var = inspect.forward_variant(q, k, v, causal=True)   # what flashcupy.attention would run
    >>> var.key                                  # e.g. 'fwd_wgmma.f16.acc32.bm128.bn128.d128.causal'
    >>> inspect.compile_report(var)["registers"], inspect.launch_roles(var)
    >>> with inspect.kernel_build({"FC_KV_STAGES": 3}):        # every call inside compiles with it
    ...     flashcupy.attention(q, k, v)

A variant is a ``Variant``: family (``fwd_wgmma``, ``fwd_mma``, ``fwd_simt``, ``bwd_*``), dtype name
(``f16``, ``bf16``, ``f32``), accumulator, tile, head dim, causal, ablation and, for the Hopper forward,
the tile schedule; its ``key`` names it in errors, tests and reports, and ``defines()`` gives the ``-D``
values it compiles with.
"""
from __future__ import annotations

from . import _tensorcore as tensorcore  # the tensor cores' accumulation, as measured (the twin's model)
from ._checks import backward_problem, forward_problem, numpy_dtype
from ._compile import (
    CompileError,
    compile_report,
    covering_variants,
    nvrtc_options,
    ptx,
    source_text,
    variant_source,
)
from ._compile import _kernels_dir as kernels_dir
from ._families import DTYPES, FAMILIES, WGMMA_BWD_HEAD_DIMS, WGMMA_HEAD_DIMS
from ._policy import default_blocks, launch_roles
from ._variant import Build, Variant, current_build, kernel_build

__all__ = [
    "DTYPES", "FAMILIES", "WGMMA_BWD_HEAD_DIMS", "WGMMA_HEAD_DIMS", "Build", "CompileError", "Variant",
    "backward_variant", "compile_report", "covering_variants", "current_build", "default_blocks",
    "forward_variant", "kernel_build", "kernels_dir", "launch_roles", "numpy_dtype", "nvrtc_options", "ptx",
    "sink_first_forward", "sink_first_forward_fp8", "source_text", "tensorcore", "variant_source",
]


def forward_variant(q, k, v, *, causal=False, scale=None, block_m=None, block_n=None, accum="fp32",
                    kernel="auto", ablate=None, window_size=(-1, -1), softcap=0.0) -> Variant:
    """The variant ``flashcupy.attention(q, k, v, ...)`` runs with these arguments (checked as that call
    checks them; the family's defaults filled in), in the current ``kernel_build``."""
    return forward_problem(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, accum=accum,
                           kernel=kernel, ablate=ablate, window_size=window_size, softcap=softcap).variant


def backward_variant(do, q, k, v, o, lse, *, causal=False, scale=None, block_m=None, block_n=None,
                     accum="fp32", kernel="auto", deterministic=False, window_size=(-1, -1),
                     softcap=0.0) -> Variant:
    """The variant ``flashcupy.attention_backward(do, q, k, v, o, lse, ...)`` runs (its kernels:
    ``launch_roles(variant, deterministic, nq)``)."""
    return backward_problem(do, q, k, v, o, lse, causal=causal, scale=scale, block_m=block_m,
                            block_n=block_n, accum=accum, kernel=kernel, deterministic=deterministic,
                            window_size=window_size, softcap=softcap).variant


def sink_first_forward(q, k, v, sinks, *, causal=False, scale=None, block_n=None, accum="fp32",
                       kernel="auto", return_lse=False):
    """``flashcupy.attention(q, k, v, sinks=sinks, ...)`` on NumPy inputs (the twin) with the sinks as the
    online softmax's first term (m = z, l = 1) instead of merged after the key loop, the order the
    package's kernels take (``flashcupy._sinks``): the order whose 16-bit P underflow under a dominant
    sink (``python -m analysis sinks``)."""
    from . import _sinks, _twin

    p = forward_problem(q, k, v, causal=causal, scale=scale, block_m=None, block_n=block_n, accum=accum,
                        kernel=kernel, ablate=None, window_size=(-1, -1), softcap=0.0)
    if p.backend != "numpy":
        raise TypeError("sink_first_forward runs the NumPy twin: pass NumPy arrays")
    o, lse = _twin.forward(q, k, v, p, sinks=_sinks.check(sinks, p.heads_q, q), sink_first=True)
    return (o, lse) if return_lse else o


def sink_first_forward_fp8(q, k, v, sinks, *, causal=False, scale=None, p_scale=256.0, accumulation="single",
                           out_dtype="float16"):
    """``flashcupy.attention_fp8(q, k, v, sinks=sinks, ...)`` on NumPy ``Quantized`` inputs (the twin)
    with the sinks as the online softmax's first term, as ``sink_first_forward``: the e4m3 P of a row
    whose sink dominates underflow (Lau 2026's P-collapse). Returns (o in ``out_dtype``, lse)."""
    from .fp8 import _attention_fp8

    return _attention_fp8(q, k, v, causal=causal, scale=scale, block_n=128, p_scale=p_scale,
                          accumulation=accumulation, out_dtype=out_dtype, return_lse=True, block_m=None,
                          ablate=None, window_size=(-1, -1), sinks=sinks, softcap=0.0, sink_first=True)
