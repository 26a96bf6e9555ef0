"""The kernels' argument tables, by name: pointer slots, int64 and double parameters.

Mirrors the enums of ``kernels/common.cuh`` (RefattnPtr, RefattnInt, RefattnReal) in the same
order; ``tests/gpu/test_kernel_sources.py`` parses the header and compares. Every kernel takes
three device arrays: the addresses (uint64), the int64 parameters and the double parameters.
"""

from __future__ import annotations

__all__ = ["INT_PARAMS", "POINTERS", "REAL_PARAMS", "slot"]

POINTERS: tuple[str, ...] = (
    "Q", "K", "V", "HEAD_MAP",
    "BIAS", "Z", "VIS",
    "Q_POS", "K_POS", "KEY_VALID", "Q_SEG", "K_SEG",
    "PREFIX", "LEFT", "RIGHT",
    "REL_LEAF", "REL_PROGRAM",
    "SANITIZED", "QUERY_VALID", "SINK",
    "OUT", "LSE", "ROW_MAX",
    "G_O", "D",
    "DQ", "DK", "DV", "GBIAS", "ROW_DOT",
    "TILES",
    "T_SOFTCAP_INPUT", "T_SCORES", "T_BIASED", "T_MASKED",
    "T_PROBS", "T_Z", "T_CONSUMED",
    "T_GRAD_CONSUMED", "T_GRAD_PROBS", "T_GRAD_SCORES",
    "VIS_TILES",
)

INT_PARAMS: tuple[str, ...] = (
    "B", "HQ", "HKV", "Q", "K", "DK", "DV",
    "VIS_MODE",
    "REL_B", "REL_H",
    "REL_PROGRAM_LEN",
    "HAS_BIAS", "HAS_SOFTCAP", "HAS_SINK", "HAS_SANITIZED",
    "DROP_MODE",
    "PHILOX_KEY0", "PHILOX_KEY1", "PHILOX_OFFSET", "PHILOX_THRESHOLD",
    "GBIAS_MODE",
    "BIAS_S0", "BIAS_S1", "BIAS_S2", "BIAS_S3",
    "Z_S0", "Z_S1", "Z_S2", "Z_S3",
    "VIS_S0", "VIS_S1", "VIS_S2", "VIS_S3",
)

REAL_PARAMS: tuple[str, ...] = ("POST", "SOFTCAP", "KEEP", "FQ", "FK")


def slot(table: tuple[str, ...], name: str) -> int:
    """Index of ``name`` in one of the tables.

    Examples
    --------
    >>> slot(POINTERS, "Q"), slot(INT_PARAMS, "DV"), slot(REAL_PARAMS, "FK")
    (0, 6, 4)
    """
    return table.index(name)
