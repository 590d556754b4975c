"""torch SDPA as a peer, for ``bench`` (timed beside flashcupy) and ``profile_ncu`` (profiled beside it).

Each backend runs on the CuPy arrays themselves through DLPack (zero copy), forced by
``torch.nn.attention.sdpa_kernel``; its backward is ``torch.autograd.grad`` of the same call, on a graph
built once beforehand so that only the gradient kernels run in the backward call.
"""
from __future__ import annotations

# short name -> torch.nn.attention.SDPBackend member
BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "mem-efficient": "EFFICIENT_ATTENTION"}


def load_torch():
    """The torch module with SDPA on CUDA; raises (ImportError, RuntimeError) where there is none."""
    import torch
    import torch.nn.attention  # noqa: F401  (sdpa_kernel, SDPBackend)

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    return torch


class Sdpa:
    """One SDPA backend with a fixed causal flag, on torch tensors (``to_torch`` of CuPy arrays)."""

    def __init__(self, torch, backend: str, causal: bool):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch, self.causal = torch, causal
        self.backend, self._sdpa_kernel = getattr(SDPBackend, BACKENDS[backend]), sdpa_kernel

    def forward(self, q, k, v):
        with self._sdpa_kernel(self.backend):
            return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def graph(self, q, k, v, do):
        """The forward run with q, k, v requiring grad: (q, k, v, do, out), the argument of ``backward``."""
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        return q, k, v, do, self.forward(q, k, v)

    def backward(self, g):
        """dq, dk, dv of a ``graph``; the graph is kept for the next call."""
        return self.torch.autograd.grad(g[4], (g[0], g[1], g[2]), g[3], retain_graph=True)


def to_torch(torch, arrays) -> tuple:
    """CuPy arrays -> torch tensors on the same memory (DLPack)."""
    return tuple(torch.from_dlpack(x) for x in arrays)
