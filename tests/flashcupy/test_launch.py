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


def _fp8_problem(device=0, p_scale=256.0, persistent_schedule=None, kscale="tile"):
    from flashcupy._checks import Problem
    from flashcupy._variant import Variant

    kw = {} if persistent_schedule is None else {"schedule": persistent_schedule}
    var = Variant("fwd_wgmma", "bf16", "fp32", 192, 128, 128, True, None, fp8="single", fp8_kscale=kscale,
                  **kw)
    return Problem("cuda", 2, 8, 2, 300, 1000, 128, 0.125, var, device, p_scale=p_scale)


def test_fp8_plans_are_each_devices_and_p_scales_own(monkeypatch):
    """An fp8 forward's plan is the 16-bit forward's (``forward_plan``), remembered per Problem: the same
    call on another device, or with another p_scale (a fixed argument of its launch), gets a plan of its
    own; the same call reuses one."""
    made = []

    class Plan:
        def __init__(self, *args):
            made.append(args)

    monkeypatch.setattr(_launch, "_ForwardPlan", Plan)
    monkeypatch.setattr(_launch, "_FORWARD_PLANS", {})
    st = ((1, 2, 3, 4),) * 3
    first = _launch.forward_plan(_fp8_problem(), *st, 1)
    assert _launch.forward_plan(_fp8_problem(), *st, 1) is first
    assert _launch.forward_plan(_fp8_problem(device=1), *st, 1) is not first
    assert _launch.forward_plan(_fp8_problem(p_scale=448.0), *st, 1) is not first
    assert len(made) == 3


class _LayoutRecorder:
    """``_Launcher`` recording the kernel, grid and layout a plan builds, and each launch."""

    def __init__(self, kern, grid, layout):
        self.kern, self.grid, self.layout, self.calls = kern, grid, tuple(layout), []

    def __call__(self, stream, ptrs, maps=()):
        self.calls.append((tuple(ptrs), tuple(maps)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["one-tile-per-cta", "dynamic"])
def test_an_fp8_forward_plan_builds_the_fp8_kernels_layout(monkeypatch, dynamic):
    """``_ForwardPlan`` of an fp8 variant: the V^T launch (grid over padded key groups, V's element
    strides), the attention's argument layout in fwd_wgmma.cu's FC_FP8 order (the 16-bit forward's, then
    the three descales, p_scale and log2 p_scale), e4m3 maps with 128-byte rows and V's map over V^T; a
    run launches V^T into the scratch buffer that V's map and pointer then name, and hands the descales
    last, after the dynamic scheduler's counter."""
    import types

    from flashcupy._checks import numpy_dtype

    monkeypatch.setattr(_launch, "get_kernel", lambda var, role: role)
    monkeypatch.setattr(_launch, "_Launcher", _LayoutRecorder)
    monkeypatch.setattr(_launch, "_wgmma_ctas", lambda tiles: 132)
    monkeypatch.setattr(_launch, "_tile_counter", lambda stream, scratch: 0xC0)
    monkeypatch.setattr(_launch, "_MapSlot", lambda *args: types.SimpleNamespace(args=args))
    p = _fp8_problem(persistent_schedule="dynamic" if dynamic else None)
    assert p.variant.persistent == (2 if dynamic else 0)
    q_st, kv_st = (300 * 128 * 8, 300 * 128, 128, 1), (1000 * 128 * 2, 1000 * 128, 128, 1)
    v_st = (1000 * 2 * 128, 128, 2 * 128, 1)  # (V, (B, Hkv, Nk, D), a view of a (B, Nk, Hkv, D) buffer)
    plan = _launch._ForwardPlan(p, q_st, kv_st, v_st, 1)
    assert plan.readable and plan.tma
    assert plan.o_shape == (2, 8, 300, 128) and plan.lse_shape == (2, 8, 300)
    t = plan.transpose
    assert t.kern == "v_transpose" and t.grid == (1024 // 64, 2, 2) and plan.vt_size == 2 * 2 * 128 * 1024
    assert t.layout[:2] == ("ptr", "ptr") and [int(x) for x in t.layout[2:]] == [1000, 1024, 256000, 128, 256]
    lay = plan.launcher.layout
    assert plan.launcher.kern == "fwd"
    assert plan.launcher.grid == ((132, 1, 1) if dynamic else (2, 8, 2))
    assert lay[:9] == ("map",) * 4 + ("ptr",) * 5
    fixed = [x.item() for x in lay[9:21]]
    assert fixed == [300, 1000, 4, 300 * 128 * 8, 300 * 128, 128, 1000 * 128 * 2, 1000 * 128, 128,
                     256000, 128, 256]
    assert lay[21] == np.float32(0.125 * np.log2(np.e))
    assert [x.item() for x in lay[22:24]] == [8, 2]
    assert lay[24] == ("ptr" if dynamic else np.uint64(0))
    assert lay[25:28] == ("ptr",) * 3 and lay[28] == np.float32(256.0) and lay[29] == np.float32(8.0)
    assert len(lay) == 30
    u8, bf16 = np.dtype(np.uint8), numpy_dtype("bf16")
    vt_shape = (2, 2, 128, 1024)
    assert [m.args for m in plan.map_slots] == [
        ((2, 8, 300, 128), q_st, u8, (192, 128), "q"), ((2, 2, 1000, 128), kv_st, u8, (128, 128), "k"),
        (vt_shape, (2 * 128 * 1024, 128 * 1024, 1024, 1), u8, (128, 128), "v"),
        ((2, 8, 300, 128), (8 * 300 * 256, 300 * 256, 256, 2), bf16, 64, "o")]

    class Scratch:
        def buffer(self, shape, dtype, zero=False):
            assert shape == (plan.vt_size,) and np.dtype(dtype) == u8
            return 0x7000

    plan.map_slots = tuple((lambda name: (lambda ptr: (name, ptr)))(n) for n in "qkvo")
    plan.run(0, 0x1000, 0x2000, 0x3000, 0x4000, 0x5000, Scratch(), descales=(0xA, 0xB, 0xC))
    assert t.calls == [((0x3000, 0x7000), ())]
    (ptrs, maps), = plan.launcher.calls
    assert ptrs == (0x1000, 0x2000, 0x7000, 0x4000, 0x5000) + ((0xC0,) if dynamic else ()) + (0xA, 0xB, 0xC)
    assert maps == (("q", 0x1000), ("k", 0x2000), ("v", 0x7000), ("o", 0x4000))


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
    plan.transpose = None
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
