"""JSON records of floats and tensor views, as every manifest writes them.

A foundation module: it imports nothing from refattn, so the call, the dropout stream and the
bundle writer all describe scalars and layouts the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refattn._boundary import public, shown
from refattn.errors import RefAttnError

__all__ = ["float_record", "tensor_record"]


@public
def float_record(x: float) -> dict[str, str]:
    """A float scalar as decimal and C99 hex text (exact and human-readable).

    Examples
    --------
    >>> float_record(0.5)
    {'decimal': '0.5', 'hex': '0x1.0000000000000p-1'}
    """
    x = float(x)
    return {"decimal": repr(x), "hex": x.hex()}


@public
def tensor_record(x: np.ndarray, *, device: str = "cpu") -> dict[str, Any]:
    """Shape, strides (in elements), dtype, device and contiguity of one tensor view.

    Examples
    --------
    >>> tensor_record(np.zeros((2, 3)))["stride"]
    [3, 1]
    """
    if not isinstance(x, np.ndarray):
        raise RefAttnError(f"x: expected an ndarray, got {shown(x)}")
    itemsize = x.itemsize or 1
    return {
        "shape": [int(n) for n in x.shape],
        "stride": [int(s) // itemsize for s in x.strides],
        "dtype": str(x.dtype),
        "device": device,
        "contiguous": bool(x.flags.c_contiguous),
    }
