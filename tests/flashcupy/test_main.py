"""``python -m flashcupy`` (the README's first command) shows the intact run and both breaks."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np

from tests.conftest import GPU_SKIP_REASON


def test_demo_prints_intact_and_both_breaks():
    res = subprocess.run([sys.executable, "-m", "flashcupy", "--n", "256"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert ("NumPy twin" in out) == (GPU_SKIP_REASON is not None), out
    assert "errors over the finite rows only" in out, out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(.+?)\s+([-+.\de]+|nan)\s+([-+.\de]+|nan)\s+(\d+)/(\d+)$", line)
        if m:
            rows[m.group(1).strip()] = (float(m.group(2)), int(m.group(4)), int(m.group(5)))
    assert set(rows) == {"naive fp16 attention", "intact flash", "break: no max subtraction",
                         "break: no rescaling"}, out
    intact = rows["intact flash"]
    nomax, noresc = rows["break: no max subtraction"], rows["break: no rescaling"]
    assert intact[0] < 1e-2 and intact[1] == 0
    assert nomax[1] > 0                       # overflowed rows
    assert noresc[0] > 1e-1 and noresc[1] == 0  # finite and wrong


def test_the_package_namespace_shows_the_public_api_only():
    """``dir(flashcupy)``: the entry points and public modules, not the private checks."""
    import types

    import flashcupy

    public = {n for n in dir(flashcupy) if not n.startswith("_")}
    modules = {n for n in public if isinstance(getattr(flashcupy, n), types.ModuleType)}
    assert public - modules == {"KVCachePlan", "attention", "attention_backward", "attention_fp8",
                                "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
                                "dequantize", "merge_states", "plan_kvcache", "quantize"}
    assert modules <= {"fp8", "reference", "transforms", "naive", "accuracy", "torch", "inspect", "parallel"}
    assert set(flashcupy.__all__) <= public


def test_the_public_entry_points_are_annotated():
    """Every parameter (but ``**knobs``) and the return of each public function of ``flashcupy``,
    ``flashcupy.fp8`` and ``flashcupy.transforms``, and of ``KVCachePlan.run``, carries a type hint."""
    import inspect

    import flashcupy
    from flashcupy import fp8, transforms

    funcs = [getattr(m, n) for m in (flashcupy, fp8, transforms) for n in m.__all__]
    funcs = [f for f in funcs if inspect.isfunction(f)] + [flashcupy.KVCachePlan.run]
    assert len(funcs) >= 14
    bare = []
    for f in funcs:
        sig = inspect.signature(f)
        bare += [f"{f.__qualname__}({p.name})" for p in sig.parameters.values()
                 if p.annotation is p.empty and p.name != "self" and p.kind is not p.VAR_KEYWORD]
        bare += [f"{f.__qualname__} -> ?"] if sig.return_annotation is sig.empty else []
    assert not bare, bare
    # every hint names something: resolved with Array standing for NumPy's and CuPy's arrays
    import typing

    names = {"Array": np.ndarray, "Quantized": fp8.Quantized, "KVCachePlan": flashcupy.KVCachePlan,
             "Literal": typing.Literal}
    for f in funcs:
        hints = typing.get_type_hints(f, localns=names)
        assert "return" in hints, f.__qualname__
