"""The CUDA C sources of the kernels, as one translation unit per compiler.

Owns reading ``kernels/*.cu`` and ``*.cuh`` (shipped as package data), their content hash (the
key of every compiled build) and the kernel names. The ``.cu`` file includes its headers by
name; a compiler is pointed at :data:`KERNEL_DIR` with ``-I``. The text a compiler sees starts
with ``#line 1 "<path>"`` so that diagnostics name the real file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["KERNELS", "KERNEL_DIR", "TILES", "source_hash", "translation_unit"]

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
MAIN = "attention.cu"
#: tile sizes the launcher uses (T x T tiles, 4 T threads per block)
TILES: tuple[int, ...] = (32, 16)
#: every extern "C" kernel of attention.cu
KERNELS: tuple[str, ...] = (
    *(f"attention_{kind}_t{t}" for kind in ("forward", "dq", "dkdv") for t in TILES),
    "attention_row_dot_output", "attention_trace_forward", "attention_trace_backward",
)


def translation_unit(directory: Path = KERNEL_DIR) -> str:
    """attention.cu with a ``#line`` directive naming its path."""
    path = directory / MAIN
    return f'#line 1 "{path}"\n' + path.read_text()


def source_hash(directory: Path = KERNEL_DIR, *extra: Path) -> str:
    """sha256 of every kernel source file (names and bytes), and of ``extra`` files.

    Examples
    --------
    >>> len(source_hash())
    64
    """
    h = hashlib.sha256()
    for path in [*sorted(Path(directory).glob("*.cu*")), *extra]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
