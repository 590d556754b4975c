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
    monkeypatch.setattr(_launch, "_external_stream",
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


# ---- the plans' programs for the compiled torch node: the wiring of their ``run`` ----------------------


class _Recorder:
    """A launcher that records what ``run`` hands it and what ``program`` asks of it."""

    def __init__(self):
        self.calls = []

    def __call__(self, stream, ptrs, maps=()):
        self.calls.append((tuple(ptrs), tuple(maps)))

    def spec(self, slots, maps=()):
        return (self, tuple(slots), tuple(maps))


class _Map:
    """A TMA map slot whose maps name their address."""

    template = type("T", (), {"raw": ()})()

    def __call__(self, ptr):
        return ("map", ptr)


class _Scratch:
    def __init__(self):
        self.made = []

    def is_capturing(self):
        return True  # the forward's counter then comes from here too

    def buffer(self, shape, dtype, zero=False):
        self.made.append((tuple(shape), zero))
        return 0x900000 * len(self.made)


def _interpret(program, values):
    """Each launch of a program as the compiled node makes it: (launcher, addresses, maps)."""
    out = []
    for launcher, slots, maps in program["launches"]:
        out.append((launcher, tuple(values[s] for s in slots),
                    tuple(("map", values[program["maps"][m][0]]) for m in maps)))
    return out


def _backward_plan(tma, atomic, sem, tiled):
    plan = object.__new__(_launch._BackwardPlan)
    plan.alibi = plan.varlen = plan.tiled_varlen = False  # (the compiled node: no ALiBi, no packed sequences)
    plan.tma, plan.atomic = tma, atomic
    plan.dq_accum_shape, plan.delta_size, plan.ld_size = (2, 3, 5, 8), 48, (48 if tiled else 0)
    plan.sem_shape = (2, 3, 4) if sem else None
    plan.map_slots = tuple(_Map() for _ in range(7)) if tma else ()
    plan.prep_launch, plan.kv_launch, plan.q_launch = _Recorder(), _Recorder(), _Recorder()
    return plan


@pytest.mark.parametrize("tma,atomic,sem,tiled", [
    (True, True, True, True), (True, True, False, True), (False, True, False, False),
    (False, False, False, False)], ids=["wgmma-ordered", "wgmma", "mma-atomic", "deterministic"])
@pytest.mark.parametrize("dlse", [0, 0x70000])
def test_a_backward_program_wires_what_run_wires(tma, atomic, sem, tiled, dlse):
    """The compiled node's backward (its value table filled as _torch_node.cpp's run_backward fills it)
    hands every kernel the addresses and maps the Python run hands it, on every path of the plan."""
    plan = _backward_plan(tma, atomic, sem, tiled)
    names = _launch.BACKWARD_SLOTS
    given = dict(do=0x10000, q=0x20000, k=0x30000, v=0x40000, o=0x50000, lse=0x60000, dlse=dlse,
                 dq=0x80000, dk=0x90000, dv=0xA0000)
    scratch = _Scratch()
    plan.run(0, *(given[n] for n in names[:10]), scratch)
    program = plan.program()
    base = 0x900000  # the fp32 buffer (first from scratch), then the counters
    dq_floats = program["dq_floats"]
    assert dq_floats == (2 * 3 * 5 * 8 if atomic else 0) and program["delta_floats"] == 48
    assert scratch.made[0] == ((dq_floats + 48,), False)
    assert program["sem_shape"] == ([2, 3, 4] if sem else [])
    values = [given.get(n, 0) for n in names]
    values[names.index("delta")] = base + 4 * dq_floats
    values[names.index("dq_accum")] = base if dq_floats else 0
    values[names.index("sem")] = 2 * base if sem else 0
    launchers = (plan.prep_launch, plan.kv_launch, plan.q_launch)
    launched = [(launcher, *launcher.calls[0]) for launcher in launchers]
    assert _interpret(program, values) == launched


@pytest.mark.parametrize("dynamic,tma", [(True, True), (False, True), (False, False)])
def test_a_forward_program_wires_what_run_wires(dynamic, tma):
    plan = object.__new__(_launch._ForwardPlan)
    plan.dynamic, plan.launcher, plan.alibi, plan.varlen = dynamic, _Recorder(), False, False
    plan.map_slots = tuple(_Map() for _ in range(4)) if tma else ()
    scratch = _Scratch()
    plan.run(0, 0x1000, 0x2000, 0x3000, 0x4000, 0x5000, scratch)
    program = plan.program()
    assert program["dynamic"] == dynamic
    values = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x900000 if dynamic else 0]
    assert _interpret(program, values) == [(plan.launcher, *plan.launcher.calls[0])]


def test_the_compiled_nodes_slots_are_the_plans():
    """_torch_node.cpp's FWD_* and BWD_* enums name the slots in the order of FORWARD_SLOTS and
    BACKWARD_SLOTS."""
    import re
    from pathlib import Path

    source = (Path(_launch.__file__).parent / "_torch_node.cpp").read_text()
    for prefix, names in (("FWD", _launch.FORWARD_SLOTS), ("BWD", _launch.BACKWARD_SLOTS)):
        body = re.search(rf"enum \w+ {{([^}}]*{prefix}_SLOTS)", source).group(1)
        found = [x.lower() for x in re.findall(rf"{prefix}_(\w+)", body)]
        assert found == [*names, "slots"], (prefix, found)
