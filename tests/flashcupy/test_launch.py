"""The launch layer's argument bytes (CPU): what the launchers hand each kernel parameter, and the TMA
map templates' checks."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from flashcupy import _launch
from flashcupy._launch import MAP, PTR, _c_value


@pytest.mark.parametrize("value,raw", [
    (np.int32(-2), (-2).to_bytes(4, "little", signed=True)),
    (np.int64(3 << 40), (3 << 40).to_bytes(8, "little")),
    (np.uint64(0), bytes(8)),
    (np.float32(0.125), np.float32(0.125).tobytes()),
], ids=["int32", "int64", "uint64", "float32"])
def test_scalar_arguments_keep_their_width_and_bits(value, raw):
    assert bytes(_c_value(value)) == raw


def test_addresses_and_tensor_maps_get_slots_of_8_and_128_bytes():
    assert len(bytes(_c_value(PTR))) == 8 and len(bytes(_c_value(MAP))) == 128


def test_other_arguments_are_refused():
    for bad in (3, 0.5, np.float64(1.0), np.zeros(3), "ptr!"):
        with pytest.raises(TypeError, match="no fixed C layout"):
            _c_value(bad)


@pytest.mark.cupy
def test_the_cupy_fallback_passes_the_layouts_bytes(monkeypatch):
    """Without the driver launch (no cuda.bindings), a launcher hands CuPy's launch the same bytes in
    layout order: addresses as uint64, maps as 128-byte voids, scalars as given."""
    seen = []

    class Kernel:
        name = "k"

        def __call__(self, grid, args):
            seen.append((grid, args))

    monkeypatch.setattr(_launch, "DRIVER_LAUNCH", False)
    layout = (MAP, PTR, np.int32(7), PTR, np.float32(0.5), MAP)
    launcher = _launch._Launcher(Kernel(), (3, 2), layout)
    maps = (bytes(range(128)), bytes(range(128, 256)))
    streams = []
    monkeypatch.setattr("cupy.cuda.ExternalStream",
                        lambda ptr: streams.append(ptr) or contextlib.nullcontext())
    launcher(7, (0x1000, 0x2000), maps)
    assert streams == [7]
    (grid, args), = seen
    assert grid == (3, 2, 1)
    assert [type(a) for a in args] == [np.void, np.uint64, np.int32, np.uint64, np.float32, np.void]
    assert args[0].tobytes() == maps[0] and args[5].tobytes() == maps[1]
    assert (int(args[1]), int(args[3]), int(args[2]), float(args[4])) == (0x1000, 0x2000, 7, 0.5)


@pytest.mark.parametrize("shape,strides,box,match", [
    ((1, 2, 64, 64), (16384, 8192, 128, 4), 64, "last axis must be contiguous"),
    ((1, 2, 64, 60), (15360, 7680, 120, 2), 64, "multiple of 16 bytes"),
    ((2, 2, 64, 64), (0, 8192, 128, 2), 64, "B stride"),
    ((2, 2, 64, 64), (16384, 8192, -128, 2), 64, "N stride"),
    ((2, 2, 64, 64), (16384, 8192, 136, 2), 64, "N stride"),
    ((2, 2, 64, 64), (16384, 8192, 128, 2), 300, "box_rows"),
    ((2, 0, 64, 64), (16384, 8192, 128, 2), 64, "every extent"),
], ids=["strided-last", "odd-row", "zero-B", "negative-N", "unaligned-N", "box", "empty"])
def test_map_templates_name_what_tma_cannot_describe(shape, strides, box, match):
    """Every refusal comes from the template's checks, before the driver is asked."""
    from flashcupy._tma import MapTemplate

    with pytest.raises(ValueError, match=match) as err:
        MapTemplate(shape, strides, np.float16, box, name="kk")
    assert str(err.value).startswith("kk:")


@pytest.mark.cupy
def test_fp8_plans_are_each_devices_own(monkeypatch):
    """An fp8 plan holds its device's kernels, launchers and persistent grid: the same call on another
    device gets a plan of its own, and the same call on the same device reuses one."""
    import types

    made = []

    class Plan:
        def __init__(self, *args):
            made.append(args)

    device = [0]
    monkeypatch.setattr(_launch, "_Fp8Plan", Plan)
    monkeypatch.setattr(_launch, "_FP8_PLANS", {})
    monkeypatch.setattr("cupy.cuda.runtime.getDevice", lambda: device[0])
    x = types.SimpleNamespace(shape=(1, 2, 64, 128), strides=(16384, 8192, 128, 1))
    first = _launch.fp8_plan("variant", x, x, x, 0.125, 256.0)
    assert _launch.fp8_plan("variant", x, x, x, 0.125, 256.0) is first
    device[0] = 1
    assert _launch.fp8_plan("variant", x, x, x, 0.125, 256.0) is not first
    assert len(made) == 2
