"""The compiled autograd node of ``flashcupy.torch``: ``_torch_node.cpp``, built on first use with
``torch.utils.cpp_extension`` (a C++ compiler and the CUDA runtime headers are needed; the build takes
about half a minute once and is cached by torch in ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, under a name that changes with the source).

Why it exists: the autograd engine runs a Python ``autograd.Function``'s backward through the GIL on its
device thread and unpacks its context in Python; a node that launches nothing costs that way about three
quarters of torch SDPA's whole training step at small shapes (``docs/design/torch_bridge.md``). The
compiled node runs the launch plans of ``_launch`` (written out by their ``program`` methods) from C++ on
torch's current stream, forward and backward, and calls back into Python only for what a plan does not
read in place.

``FLASHCUPY_TORCH_NODE`` chooses: ``auto`` (default: the compiled node where it builds, else the Python
node), ``python`` (never build), ``cpp`` (build or raise: for tests). ``status()`` says which runs and
why.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("_torch_node.cpp")
_LOCK = threading.Lock()
_STATE: dict = {}  # "module" (or None) and "reason", once decided


def _choice() -> str:
    choice = os.environ.get("FLASHCUPY_TORCH_NODE", "auto")
    if choice not in ("auto", "python", "cpp"):
        raise ValueError(f"FLASHCUPY_TORCH_NODE must be auto, python or cpp; got {choice!r}")
    return choice


def _cuda_include() -> str | None:
    """A directory holding ``cuda_runtime_api.h`` (included by torch's c10/cuda headers): the toolkit's
    (``CUDA_HOME``, ``CUDA_PATH``, /usr/local/cuda) or the pip wheels' (``nvidia/cu13``, ``nvidia/cu12``,
    ``nvidia/cuda_runtime``)."""
    from torch.utils import cpp_extension

    roots = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [os.path.join(r, "include") for r in roots if r]
    for entry in sys.path:
        for sub in ("cu13", "cu12", "cuda_runtime"):
            dirs.append(os.path.join(entry, "nvidia", sub, "include"))
    return next((d for d in dirs if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))), None)


def _build():
    import torch
    from torch.utils import cpp_extension

    include = _cuda_include()
    if include is None:
        raise RuntimeError("no CUDA runtime headers found (cuda_runtime_api.h): set CUDA_HOME")
    source = _SOURCE.read_bytes()
    name = "flashcupy_node_" + hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:12]
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_include_paths=[include],
                              extra_cflags=["-O2"], extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda"],
                              verbose=False)


def module():
    """The built extension, or None where the Python node runs instead (``status()`` says why)."""
    if "module" in _STATE:
        return _STATE["module"]
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        choice = _choice()
        mod, reason = None, "FLASHCUPY_TORCH_NODE=python"
        if choice != "python":
            try:
                mod, reason = _build(), "built"
            except Exception as e:  # a compiler, headers or torch's build tools missing: the Python node
                if choice == "cpp":
                    raise RuntimeError(f"FLASHCUPY_TORCH_NODE=cpp, but the compiled node did not build: "
                                       f"{e}") from e
                # the end of a build log holds the compiler's error
                reason = f"the compiled node did not build ({type(e).__name__}: ...{str(e).strip()[-400:]})"
                warnings.warn(f"flashcupy.torch runs its Python autograd node, slower at small shapes: "
                              f"{reason}. FLASHCUPY_TORCH_NODE=python silences this", RuntimeWarning,
                              stacklevel=3)
        if mod is not None:
            from . import torch as bridge

            mod.set_fallback(bridge._node_fallback)
        _STATE["reason"] = reason
        _STATE["module"] = mod
        return mod


def status() -> str:
    """Which autograd node eager calls of ``flashcupy.torch.attention`` run, and why ("not decided yet"
    before the first call that needs one)."""
    if "module" not in _STATE:
        return "not decided yet"
    node = "compiled (C++) node" if _STATE["module"] is not None else "Python node"
    return f"{node}: {_STATE['reason']}"
