"""The public entry points' array annotation: a NumPy or a CuPy array (``Array``). Annotations are not
evaluated at run time (``from __future__ import annotations``), so CuPy is never imported for them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import cupy
    import numpy

    Array = Union[numpy.ndarray, cupy.ndarray]
