"""Pictures of golden cases (``refattn plot``): visibility, probabilities, and a candidate's error.

Owns the PNG figures, drawn with matplotlib's object API on the Agg canvas (no pyplot, no
global backend switch; matplotlib is imported only here, inside the functions, and is the
optional extra ``plot``):

- ``<case>_visible.png``: the visibility relation, one panel per (batch, head): key j visible
  from query i, key 0 lent to a row the case's policy left empty (such a row is unused), and
  the query rows whose ``query_valid`` is False shaded;
- ``<case>_probs.png``: the probability matrix P (pre-dropout) per (batch, head), cells the
  relation masks (key j not visible from query i, after the case's policy) drawn grey
  (:data:`MASKED_COLOR`) so that a masked cell never reads as a small probability;
- ``<case>_error_<tensor>.png``: ``|candidate - golden|`` of one compared tensor on a log scale,
  one panel per leading index (viridis; exact elements white, non-finite mismatches magenta),
  the worst element (``refattn compare``'s) boxed in red and named in the title with its
  tolerance.

Every figure is a grid of panels of :data:`PANEL` inches with :data:`MARGIN` inches around them
at :data:`DPI` dots per inch, so a figure's pixel size follows from its grid alone
(:func:`figure_pixels`). At most :data:`MAX_PANELS` rows and columns are drawn; the title says
when a grid was cut. Defers reading to :mod:`refattn.bundle.storage.read` and the verdict to
:func:`refattn.bundle.comparison.harness.compare`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from refattn._checks import format_index
from refattn.bundle.comparison.harness import TensorReport, compare, plain
from refattn.bundle.golden.spec import CaseSpec, case_spec
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.read import load
from refattn.errors import RefAttnError

__all__ = ["DPI", "MARGIN", "MAX_PANELS", "PANEL", "figure_pixels", "load_specs", "plot_case",
           "plot_error"]

#: side of one panel, inches
PANEL = 2.2
#: (width, height) inches around the grid: titles, labels and the colour bar
MARGIN = (1.4, 1.3)
#: dots per inch of every PNG
DPI = 100
#: rows and columns of panels drawn at most
MAX_PANELS = 8


def figure_pixels(rows: int, cols: int) -> tuple[int, int]:
    """(width, height) in pixels of a figure holding a ``rows`` x ``cols`` grid of panels.

    Examples
    --------
    >>> figure_pixels(1, 1), figure_pixels(2, 4)
    ((360, 350), (1020, 570))
    """
    rows, cols = min(rows, MAX_PANELS), min(cols, MAX_PANELS)
    return (round(DPI * (PANEL * cols + MARGIN[0])), round(DPI * (PANEL * rows + MARGIN[1])))


def _matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib import colors
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError(f"refattn plot needs matplotlib ({install_hint('plot')})") from None
    return Figure, FigureCanvasAgg, colors


#: the colour of masked cells in the probabilities figure (no colour of viridis is grey)
MASKED_COLOR = "#bdbdbd"


def _viridis() -> Any:
    from matplotlib import colormaps

    return colormaps["viridis"]


def _grid(rows: int, cols: int, title: str) -> tuple[Any, np.ndarray]:
    """An Agg figure of the documented size and its (rows, cols) panels."""
    Figure, FigureCanvasAgg, _ = _matplotlib()
    r, c = min(rows, MAX_PANELS), min(cols, MAX_PANELS)
    w, h = figure_pixels(rows, cols)
    fig = Figure(figsize=(w / DPI, h / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = np.asarray(fig.subplots(r, c, squeeze=False))
    cut = "" if (r, c) == (rows, cols) else f" (first {r} x {c} of {rows} x {cols} panels)"
    fig.suptitle(title + cut, fontsize=8, wrap=True)  # wrapped to the figure's width
    fig.subplots_adjust(left=0.6 / (w / DPI), right=1 - 0.8 / (w / DPI),
                        bottom=0.4 / (h / DPI), top=1 - 0.9 / (h / DPI),
                        wspace=0.35, hspace=0.45)
    return fig, axes


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")  # no bbox_inches: the size stays documented
    return path


def _label(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):  # indices: integer ticks only
        axis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.tick_params(labelsize=6)


# -- one case -------------------------------------------------------------------------------
def plot_case(spec: CaseSpec, out_dir: str | os.PathLike) -> list[Path]:
    """Write ``<case>_visible.png`` and ``<case>_probs.png`` for one case.

    Parameters
    ----------
    spec : CaseSpec
        The case (``probs`` must be among its tensors, as in every golden bundle).
    out_dir : path
        Created if absent.

    Returns
    -------
    list of Path
        The files written: a (B, Hq) grid of panels each.

    Examples
    --------
    >>> import tempfile, pytest; _ = pytest.importorskip("matplotlib")
    >>> from refattn.bundle.suites import build_suite
    >>> paths = plot_case(case_spec(build_suite("contract")[1]), tempfile.mkdtemp())
    >>> [p.name.split("source_")[1] for p in paths]
    ['visible.png', 'probs.png']
    """
    _, _, colors = _matplotlib()
    out = Path(out_dir)
    B, Hq = spec.score_shape[:2]
    raw = spec.visible_full()  # (B, Hq, Q, K) as the relation states it
    lent = spec.visible_full(sanitized=True) & ~raw  # key 0 lent to unused empty rows
    unused = ~spec.query_valid_full()[:, 0, :, 0]  # (B, Q)
    cmap = colors.ListedColormap(["#ffffff", "#1f3b73", "#f28e2b"])
    fig, axes = _grid(B, Hq, f"{spec.case_id}: visibility. Dark: query i reads key j; orange: "
                      "key 0 lent to an unused empty row; grey rows: query_valid False")
    for (b, h), ax in np.ndenumerate(np.empty(axes.shape)):
        code = raw[b, h].astype(np.int8) + 2 * lent[b, h]  # (Q, K): 0, 1 or 2
        ax = axes[b, h]
        ax.imshow(code, cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
        for i in np.flatnonzero(unused[b]):
            ax.axhspan(i - 0.5, i + 0.5, color="0.5", alpha=0.45, linewidth=0)
        _label(ax, f"b={b} h={h}", "key j", "query i")
    paths = [_save(fig, out / f"{spec.case_id}_visible.png")]
    if "probs" not in spec.tensors:
        raise RefAttnError(f"{spec.case_id}: the case stores no 'probs' to draw")
    probs = spec.tensors["probs"]  # (B, Hq, Q, K)
    support = spec.visible_full(sanitized=True)  # (B, Hq, Q, K): where P may be non-zero
    viridis = _viridis().with_extremes(bad=MASKED_COLOR)  # masked cells: grey, off the scale
    fig, axes = _grid(B, Hq, f"{spec.case_id}: probabilities P (pre-dropout) per head; grey cells: "
                      "masked")
    image = None
    for (b, h), _ in np.ndenumerate(np.empty(axes.shape)):
        ax = axes[b, h]
        shown = np.ma.masked_array(probs[b, h], mask=~support[b, h])  # (Q, K)
        image = ax.imshow(shown, cmap=viridis, vmin=0.0, vmax=1.0,
                          interpolation="nearest", aspect="auto")
        _label(ax, f"b={b} h={h}", "key j", "query i")
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.04, pad=0.02)
    bar.ax.tick_params(which="both", labelsize=6)
    if not support.all():  # the legend note of the grey cells
        from matplotlib.patches import Patch

        fig.legend(handles=[Patch(facecolor=MASKED_COLOR, edgecolor="0.3", label="masked")],
                   loc="lower right", fontsize=6, frameon=False)
    paths.append(_save(fig, out / f"{spec.case_id}_probs.png"))
    return paths


# -- a candidate's error ------------------------------------------------------------------------
_QUERY_ROWS = ("q", "grad_q", "output", "grad_output")
_KEY_ROWS = ("k", "v", "grad_k", "grad_v")
_ROW_STATS = ("row_max", "lse", "row_dot", "row_dot_output", "sink_probs")


def _axes_names(name: str, ndim: int) -> tuple[str, str, str]:
    """(panel label letters, image row axis, image column axis) of a canonical tensor."""
    if ndim == 4 and name in _QUERY_ROWS:
        return "bh", "query i", "feature"
    if ndim == 4 and name in _KEY_ROWS:
        return "bh", "key j", "feature"
    if ndim == 4:
        return "bh", "query i", "key j"
    if ndim == 3 and name in _ROW_STATS:
        return "b", "head h", "query i"
    return "", "second-to-last axis", "last axis"


def _panels(x: np.ndarray) -> np.ndarray:
    """A tensor as (rows, cols, n, m) panels: the last two axes are the image, the two before
    them the grid (a (B, H, Q, D) tensor: one panel per (b, h))."""
    x = np.asarray(x)
    x = x.reshape((1,) * max(0, 4 - x.ndim) + x.shape)  # at least (1, 1, 1, 1)
    return x.reshape(int(np.prod(x.shape[:-3])), *x.shape[-3:])


def plot_error(spec: CaseSpec, candidate: Mapping[str, Any], out_dir: str | os.PathLike, *,
               dtype: Any = None, tolerances: Any = None,
               tensors: Sequence[str] | None = None) -> list[Path]:
    """Write ``<case>_error_<tensor>.png`` for every tensor the candidate holds.

    Parameters
    ----------
    spec : CaseSpec
    candidate : mapping of str to array
        Canonical names to arrays (as for ``refattn compare``).
    out_dir : path
    dtype, tolerances
        As for :func:`refattn.bundle.comparison.harness.compare` (the worst element and the bound
        drawn are its).
    tensors : sequence of str, optional
        Only these tensors (default: every numerically compared one).

    Returns
    -------
    list of Path

    Examples
    --------
    >>> import tempfile, pytest; _ = pytest.importorskip("matplotlib")
    >>> from refattn.bundle.suites import build_suite
    >>> spec = case_spec(build_suite("contract")[1])
    >>> out = spec.tensors["output"].copy(); out[0, 0, 1, 0] += 1e-6
    >>> [p.name for p in plot_error(spec, {"output": out}, tempfile.mkdtemp())]
    ['loop7_cross_attention_padded_source_error_output.png']
    """
    _, _, colors = _matplotlib()
    report = compare(candidate, spec, dtype=dtype, tolerances=tolerances, check="listed")
    rows = [t for t in report.tensors if t.rule in ("float64", "reference_relative")
            and (tensors is None or t.name in tensors)]
    if tensors is not None:
        missing = sorted(set(tensors) - {t.name for t in rows})
        if missing:
            raise RefAttnError(f"--tensor: {missing} not compared numerically (the candidate "
                               "lacks them, or they are boolean or integer)")
    paths = []
    for row in rows:
        c = np.asarray(candidate[row.name], dtype=np.float64)
        g = np.asarray(spec.tensors[row.name], dtype=np.float64)
        with np.errstate(invalid="ignore"):
            err = np.abs(c - g)
        paths.append(_error_figure(spec.case_id, row, report.precision, _panels(err),
                                   _axes_names(row.name, g.ndim), colors, Path(out_dir)))
    return paths


def _error_figure(case_id: str, row: TensorReport, precision: str, err: np.ndarray,
                  names: tuple[str, str, str], colors: Any, out: Path) -> Path:
    from matplotlib.patches import Rectangle

    R, C, n, m = err.shape
    letters, ylabel, xlabel = names
    verdict = "ok" if row.passed else "FAIL"
    worst = "" if row.worst_index is None else (
        f". Worst {format_index(row.worst_index)}: {plain(row.worst_candidate)} vs golden "
        f"{plain(row.worst_golden)}, error {row.max_abs_error:.2e}, tolerance {row.bound:.2e}")
    fig, axes = _grid(R, C, f"{case_id} {row.name} ({precision}, {verdict}): |candidate - "
                      f"golden|, white where equal, magenta where one side is not finite{worst}")
    finite = err[np.isfinite(err) & (err > 0)]
    top = float(finite.max()) if finite.size else 1.0
    low = float(finite.min()) if finite.size else top
    norm = colors.LogNorm(vmin=max(min(low, top / 10), top * 1e-12), vmax=top)
    bad = colors.ListedColormap(["#ff00ff"])
    wi = None  # the worst element's (panel row, panel column, i, j)
    if row.worst_index is not None and row.max_abs_error > 0:  # nothing to mark when exact
        flat = np.ravel_multi_index(row.worst_index, row.shape) if row.shape else 0
        wi = tuple(int(x) for x in np.unravel_index(flat, (R, C, n, m)))
    image = None
    for (r, c), _ in np.ndenumerate(np.empty(axes.shape)):
        ax = axes[r, c]
        e = err[r, c]  # (n, m)
        image = ax.imshow(np.where(e > 0, e, np.nan), cmap="viridis", norm=norm,
                          interpolation="nearest", aspect="auto")  # exact elements: blank
        nonfinite = ~np.isfinite(e)
        if nonfinite.any():
            ax.imshow(np.where(nonfinite, 1.0, np.nan), cmap=bad, interpolation="nearest",
                      aspect="auto")
        label = {"bh": f"b={r} h={c}", "b": f"b={c}"}.get(letters, f"[{r}, {c}]")
        _label(ax, label, xlabel, ylabel)
        if wi is not None and wi[:2] == (r, c):
            ax.add_patch(Rectangle((wi[3] - 0.5, wi[2] - 0.5), 1, 1, fill=False,
                                   edgecolor="red", linewidth=2.0))
            ax.set_title(f"{label}: worst", fontsize=8, color="red")
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.04, pad=0.02)
    bar.ax.tick_params(which="both", labelsize=6)
    return _save(fig, out / f"{case_id}_error_{row.name}.png")


# -- reading what to draw -----------------------------------------------------------------------
def load_specs(source: str | os.PathLike, *, case: str | None = None) -> list[CaseSpec]:
    """The cases at ``source``: a case file (``DIR/cases/<id>.safetensors``, read with its
    bundle's manifest) or a bundle directory (every case, or only ``case``).

    Raises
    ------
    RefAttnError
        Naming the path when it is neither, or the case id when the bundle lacks it.
    """
    path = Path(source)
    if path.is_dir():
        manifest = check_schema(read_manifest(path / "manifest.json"))
        entries = manifest["cases"]
        if case is not None:
            if case not in entries:
                raise RefAttnError(f"--case: {case!r} is not in {path} (it has "
                                   f"{len(entries)} cases)")
            entries = {case: entries[case]}
        return [case_spec(load(path / e["file"], manifest=manifest)) for e in entries.values()]
    if not path.is_file():
        raise RefAttnError(f"{path}: expected a case file or a bundle directory")
    return [case_spec(load(path))]
