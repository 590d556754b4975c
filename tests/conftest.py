"""Shared pytest setup: the gpu and cupy markers' auto-skips and a per-test seeded generator."""
from __future__ import annotations

import zlib

import numpy as np
import pytest


def _cupy_reason() -> str | None:
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except Exception as e:
        return (f"needs CuPy and its NVRTC (pip install 'flashcupy[cuda13]' or '[cuda12]'; no GPU needed): "
                f"{type(e).__name__}: {e}")
    return None


CUPY_SKIP_REASON = _cupy_reason()


def _gpu_reason() -> str | None:
    if CUPY_SKIP_REASON is not None:
        return CUPY_SKIP_REASON.replace("no GPU needed", "and a CUDA device")
    import cupy

    try:
        if cupy.cuda.is_available():
            return None
    except Exception as e:  # pragma: no cover
        return f"no CUDA device: {e}"
    return "no CUDA device: cupy.cuda.is_available() is False"


GPU_SKIP_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    for marker, reason in (("gpu", GPU_SKIP_REASON), ("cupy", CUPY_SKIP_REASON)):
        if reason is None:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def seed(request) -> int:
    """A seed derived from the test id: fresh inputs per test, reproducible, and recorded."""
    s = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("seed", s))
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


try:  # property-based tests: the same examples on every run (CI stays reproducible); search wider with
    # ``python -m pytest tests/flashcupy/test_twin_properties.py --hypothesis-profile=explore``
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("default", derandomize=True, database=None)
    _hyp_settings.register_profile("explore", derandomize=False, max_examples=500)
    _hyp_settings.load_profile("default")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
