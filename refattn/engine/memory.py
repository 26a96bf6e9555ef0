"""Memory a dense call will allocate, estimated before it allocates anything.

Owns :func:`dense_bytes` (the bytes of the (B, Hq, Q, K) float64 arrays and the head-gathered
operands that the dense forward or backward of the NumPy reference and the dense numba path
hold at their peak), :func:`available_bytes` (re-exported from :mod:`refattn._memory`) and
:func:`check_memory`, which refuses a call whose
estimate exceeds the available memory or a caller's ``max_bytes`` at once, with the bytes it
would need, instead of letting the operating system kill the process minutes later. The way
out it names is the streaming backend, which holds no (Q, K)-sized tensor.
"""

from __future__ import annotations

from typing import Any, Literal

from refattn._memory import available_bytes
from refattn.errors import RefAttnError

__all__ = ["STREAMING_HINT", "available_bytes", "check_memory", "dense_bytes"]

STREAMING_HINT = ("stream it instead: refattn.forward(call, backend=\"numba\", "
                  "materialize=False) (or refattn.value_and_grad(call, grad_output, "
                  "backend=\"numba\")) holds no (Q, K)-sized tensor")


def dense_bytes(call: Any, stage: Literal["forward", "backward"]) -> int:
    """Peak bytes of a dense forward or backward of ``call`` (an upper estimate).

    Counts the (B, Hq, Q, K) float64 arrays alive at once (forward: scores, biased and masked
    scores when they differ, probabilities, the multiplier and consumed weights with dropout,
    the softcap input, one temporary; backward: grad_consumed, grad_probs with dropout,
    grad_scores, the softcap's scaled gradient, one temporary), plus the head-gathered k and v
    and the (B, Hq, Q, D) outputs.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.call import AttentionCall
    >>> x = np.zeros((1, 1, 1000, 8))
    >>> dense_bytes(AttentionCall(x, x, x), "forward") // 10**6   # 3 arrays of 8 MB, and q/k/v
    24
    """
    B, Hq, Q, K = call.score_shape
    n = B * Hq * Q * K
    Dq, Dk, Dv = call.q.shape[3], call.k.shape[3], call.v.shape[3]
    has_drop = call.dropout is not None
    if stage == "forward":
        arrays = 2 + (call.bias is not None) + (call.visible is not None) + 2 * has_drop + (
            call.softcap is not None) + 1
        rows = B * Hq * (K * (Dk + Dv) + Q * (Dq + Dv))
    else:
        arrays = 2 + has_drop + (call.softcap is not None) + 1
        rows = B * Hq * (2 * K * (Dk + Dv) + 2 * Q * (Dq + Dv))
    if call.score.name == "additive":  # its (B, Hq, Q, K, Da) pair blocks are bounded
        arrays += 1
    return 8 * (arrays * n + rows)


def check_memory(call: Any, stage: Literal["forward", "backward"], *, backend: str,
                 max_bytes: int | None = None) -> int:
    """Refuse a dense ``stage`` of ``call`` that needs more than ``max_bytes`` (default: the
    available memory); return the estimate.

    Raises
    ------
    RefAttnError
        With the bytes needed, the limit, and the streaming alternative.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.call import AttentionCall
    >>> x = np.zeros((1, 1, 1000, 8))
    >>> try:
    ...     check_memory(AttentionCall(x, x, x), "forward", backend="numpy", max_bytes=10**6)
    ... except RefAttnError as exc:
    ...     print(str(exc)[:73])
    memory: the dense numpy forward of this call needs about 24256000 bytes (
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(
            max_bytes, int) or max_bytes < 0):
        raise RefAttnError(f"max_bytes: expected a non-negative int, got {max_bytes!r}")
    need = dense_bytes(call, stage)
    limit = available_bytes() if max_bytes is None else max_bytes
    if limit is not None and need > limit:
        what = f"max_bytes={max_bytes}" if max_bytes is not None else (
            f"the {limit} bytes of memory available")
        B, Hq, Q, K = call.score_shape
        raise RefAttnError(
            f"memory: the dense {backend} {stage} of this call needs about {need} bytes "
            f"({need / 2**30:.2f} GiB; (B, Hq, Q, K) = ({B}, {Hq}, {Q}, {K}) float64 "
            f"arrays), more than {what}; {STREAMING_HINT}")
    return need
