"""The launch layer's argument bytes (CPU): what the driver-level launcher hands each kernel parameter."""
from __future__ import annotations

import numpy as np
import pytest

from flashcupy._launch import _c_value, _is_device_array


@pytest.mark.parametrize("value,raw", [
    (np.int32(-2), (-2).to_bytes(4, "little", signed=True)),
    (np.int64(3 << 40), (3 << 40).to_bytes(8, "little")),
    (np.uint64(0), bytes(8)),
    (np.float32(0.125), np.float32(0.125).tobytes()),
], ids=["int32", "int64", "uint64", "float32"])
def test_scalar_arguments_keep_their_width_and_bits(value, raw):
    assert bytes(_c_value(value)) == raw


def test_a_tensor_map_is_passed_as_its_128_bytes():
    blob = bytes(range(128))
    assert bytes(_c_value(np.frombuffer(blob, dtype=np.dtype((np.void, 128)))[0])) == blob


def test_other_arguments_are_refused():
    assert not _is_device_array(np.int32(1)) and not _is_device_array(np.zeros(3))
    for bad in (3, 0.5, np.float64(1.0), np.zeros(3)):
        with pytest.raises(TypeError, match="no fixed C layout"):
            _c_value(bad)
