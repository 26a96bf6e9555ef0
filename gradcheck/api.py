"""``check_vjp`` and ``assert_gradients``: compare a hand-written vjp with numeric derivatives.

Owns the public entry points: input validation (float64 only), mode and method selection, the
tolerance model, and assembling the :class:`~gradcheck.report.Report`. Defers the numeric
derivatives to :mod:`gradcheck.methods`, directions and localisation to
:mod:`gradcheck.directional`, and formatting to :mod:`gradcheck.report`.

Tolerance model (no fixed rtol). For one comparison of an analytic value ``a`` with a numeric
value ``n = <v, J w>`` (``w`` a unit element times its scale in full mode, a random direction in
directional mode)::

    tol = safety * (E_num + rounding_ulps * eps * ||v|| * (||J w|| + c * ||w||)
                    + eps * sum_i |g_i w_i|)

``E_num`` is the numeric method's own error estimate (Richardson spread plus rounding noise;
zero for complex step), the second term is the rounding of the analytic and numeric
arithmetic, scaled by ``||v|| ||J w||`` and never by the sum of the direction's entries, with a
floor ``c`` (the input's root-mean-square Jacobian column norm) so that exactly-zero
derivatives tolerate rounding noise; the last term is the rounding of ``<g, w>`` itself.
Where a comparison comes near this and the caller supplies ``term_scale`` (the magnitudes of the
terms the vjp sums, e.g. ``P (|G_P| + |D|)`` for attention's score gradient), the rounding
bound ``2 * rounding_ulps * eps * term_scale`` (the vjp's rounding, and the numeric
derivative's, which sums the same terms) is added before the verdict: a derivative far
below the rounding of the backward's own intermediates (a saturated softmax) cannot be
resolved in float64 and is not reported as wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from gradcheck._boundary import shown
from gradcheck.directional import bisect, cotangent, direction
from gradcheck.errors import GradcheckError, float64_array, public
from gradcheck.methods import (
    CD_STEP,
    EPS,
    Jvp,
    NotComplexSafe,
    central_jvp,
    complex_safety,
    complex_step_jvp,
    exact_direction,
    pooled_errors,
)
from gradcheck.report import InputReport, Report, Worst, error_ratio, quantiles, scale_fit

__all__ = ["GradientCheckError", "assert_gradients", "check_vjp"]

Mode = Literal["auto", "full", "directional"]
MethodChoice = Literal["auto", "complex_step", "central"]
Projector = Callable[[np.ndarray], np.ndarray]
#: the term-magnitude rounding bound is consulted once an error reaches this share of the
#: tolerance (so a ratio near 1 in a report is borderline, not an artefact of laziness)
TERM_TRIGGER = 0.1
#: seconds a check must run before its progress bar appears (automatic mode)
PROGRESS_DELAY = 0.5


class GradientCheckError(AssertionError):
    """A failed :func:`assert_gradients`; ``.report`` holds the :class:`Report`."""

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


class _Counted:
    """``fn`` with a call counter (the report states the cost)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, **kw: np.ndarray) -> np.ndarray:
        self.calls += 1
        return self.fn(**kw)


def _validate_inputs(inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if not isinstance(inputs, Mapping) or not inputs:
        raise GradcheckError("inputs: expected a non-empty mapping of name -> float64 ndarray")
    out = {}
    for name, x in inputs.items():
        arr = np.array(float64_array(f"inputs[{name!r}]", x), copy=True)
        arr.flags.writeable = False
        out[str(name)] = arr
    return out


def _analytic(name: str, grads: object, x: np.ndarray) -> tuple[np.ndarray | None, str | None]:
    """The vjp's gradient for ``name`` shaped like ``x``, and a structural problem in words."""
    if not isinstance(grads, Mapping):
        raise GradcheckError(
            f"vjp: expected a mapping of input name -> gradient, got {type(grads).__name__}"
        )
    if name not in grads or grads[name] is None:
        return None, f"vjp returned no gradient for {name!r}"
    g = np.asarray(grads[name])
    problems = []
    if g.dtype != np.float64:
        problems.append(f"analytic gradient has dtype {g.dtype}, expected float64")
        if g.dtype.kind not in "fiu":
            return None, problems[0]
        g = g.astype(np.float64)
    if g.shape != x.shape:
        try:
            reducible = np.broadcast_shapes(x.shape, g.shape) == g.shape
        except ValueError:
            reducible = False
        if not reducible:
            return None, (f"analytic gradient has shape {g.shape}, the input has shape "
                          f"{x.shape}, and no broadcast reduction maps one to the other")
        lead = g.ndim - x.ndim
        axes = tuple(range(lead)) + tuple(
            lead + a for a, n in enumerate(x.shape) if n == 1 and g.shape[lead + a] != 1
        )
        problems.append(
            f"analytic gradient has shape {g.shape} but the input has shape {x.shape}: "
            f"not reduced over its broadcast axes {axes} (compared after summing them)"
        )
        g = g.sum(axis=axes).reshape(x.shape)
    bad = np.argwhere(~np.isfinite(g))
    if bad.size:
        problems.append(f"analytic gradient is non-finite at {tuple(int(i) for i in bad[0])}")
    return g, ("; ".join(problems) or None)


class _Checker:
    def __init__(self, fn: Callable[..., Any], inputs: dict[str, np.ndarray], *,
                 step: float, levels: int, safety: float, rounding_ulps: float) -> None:
        self.fn = _Counted(fn)
        self.inputs = inputs
        self.step, self.levels = step, levels
        self.safety, self.ulps = safety, rounding_ulps
        self.methods: dict[str, str] = {}

    def jvp(self, name: str, w: np.ndarray) -> Jvp:
        if self.methods[name] == "complex_step":
            try:
                return complex_step_jvp(self.fn, self.inputs, name, w)
            except NotComplexSafe as exc:
                raise GradcheckError(f"method 'complex_step' for {name!r}: fn {exc}") from None
        return central_jvp(self.fn, self.inputs, name, w, step=self.step, levels=self.levels)

    def tol(self, err: Any, vnorm: float, jnorm: Any, floor: Any, dot: Any) -> Any:
        return self.safety * (err + self.ulps * EPS * vnorm * (jnorm + floor) + EPS * dot)


def _rel(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    den = np.maximum(np.maximum(np.abs(a), np.abs(n)), np.finfo(np.float64).tiny)
    return np.abs(a - n) / den


@public
def check_vjp(
    fn: Callable[..., np.ndarray],
    vjp: Callable[..., Mapping[str, np.ndarray]],
    inputs: Mapping[str, np.ndarray],
    *,
    grad_output: np.ndarray | None = None,
    mode: Mode = "auto",
    method: MethodChoice = "auto",
    seed: int = 0,
    wrt: Sequence[str] | None = None,
    directions: int = 3,
    full_limit: int = 2048,
    safety: float = 4.0,
    rounding_ulps: float = 64.0,
    step: float = CD_STEP,
    levels: int = 3,
    null_space: Mapping[str, Projector] | None = None,
    localize: bool = True,
    term_scale: Callable[..., Mapping[str, np.ndarray]] | None = None,
    progress: bool | None = None,
) -> Report:
    """Check a hand-written vector-Jacobian product against numeric derivatives.

    Parameters
    ----------
    fn : callable
        ``fn(**inputs) -> (out) float64 ndarray``. Complex-safe functions (analytic operations
        only) get the exact complex-step method automatically.
    vjp : callable
        ``vjp(grad_output, **inputs) -> {name: gradient}``, each gradient shaped like its
        input: the gradient of ``<grad_output, fn(**inputs)>``.
    inputs : mapping of str to float64 ndarray
        The point; anything but finite float64 is an error (never cast).
    grad_output : (out) float64 ndarray, optional
        The cotangent ``v`` (first round). Default: standard Gaussian from ``seed``.
    mode : {"auto", "full", "directional"}
        ``"full"`` compares every element's derivative (small inputs); ``"directional"``
        compares ``<vjp(v), w>`` with ``<v, J w>`` for ``directions`` random signed Gaussian
        directions per input and fresh Gaussian cotangents; ``"auto"`` picks full when the
        checked inputs have at most ``full_limit`` elements in total.
    method : {"auto", "complex_step", "central"}
        ``"auto"`` tests each input for complex safety and says why when it falls back to
        Richardson central differences.
    seed : int
        Draws the cotangents and directions (same seed, same check).
    wrt : sequence of str, optional
        The inputs to check (default: all).
    directions : int
        Rounds in directional mode (one cotangent and one direction per input each).
    full_limit : int
        Size limit of ``mode="auto"``'s full mode.
    safety : float
        Multiplier on the estimated error (the tolerance is ``safety`` x the estimate).
    rounding_ulps : float
        Rounding allowance, in units of ``eps * ||v|| * ||J w||``.
    step : float
        Base central-difference step (per element scaled by ``max(|x|, 1)``).
    levels : int
        Richardson levels (steps ``step * 2**k``).
    null_space : mapping of str to callable, optional
        ``P(a)``: the component of ``a`` along directions in which ``fn`` is exactly constant
        (for attention, a constant shift of every key). Removed from random directions and
        checked exactly: ``P(vjp)`` must vanish.
    localize : bool
        Directional mode: bisect a failing direction down to one element index.
    term_scale : callable, optional
        ``term_scale(grad_output, **inputs) -> {name: magnitudes}`` (each shaped like its
        input): the sum of ``|terms|`` the vjp adds up for each element, whose
        ``eps``-multiple bounds the vjp's own rounding. Consulted only for comparisons that
        come within a tenth of the tolerance without it.
    progress : bool or None
        A progress bar (tqdm, on standard error) over the numeric derivatives: None (default)
        only on a terminal and once the check has run for half a second, False never, True
        always.

    Returns
    -------
    Report
        ``report.passed``, per-input results, ``str(report)`` a readable table.

    Raises
    ------
    GradcheckError
        On non-float64 or non-finite inputs or cotangent, a non-float64 ``fn`` output, an
        unknown option, or a ``vjp`` that does not return a mapping.

    Examples
    --------
    >>> fn = lambda x, y: np.sin(x) * y
    >>> vjp = lambda g, x, y: {"x": g * np.cos(x) * y, "y": g * np.sin(x)}
    >>> inputs = {"x": np.array([0.3, -1.2]), "y": np.array([2.0, 0.5])}
    >>> report = check_vjp(fn, vjp, inputs)
    >>> report.passed, report.mode, report.inputs["x"].method
    (True, 'full', 'complex_step')
    >>> bad = lambda g, x, y: {"x": g * np.cos(x), "y": g * np.sin(x)}
    >>> check_vjp(fn, bad, inputs).failed
    ['x']
    """
    inputs = _validate_inputs(inputs)
    names = list(inputs) if wrt is None else [str(n) for n in wrt]
    for n in names:
        if n not in inputs:
            raise GradcheckError(f"wrt: {n!r} is not an input (inputs: {sorted(inputs)})")
    if mode not in ("auto", "full", "directional"):
        raise GradcheckError(f"mode: expected 'auto', 'full' or 'directional', got {mode!r}")
    if method not in ("auto", "complex_step", "central"):
        raise GradcheckError(
            f"method: expected 'auto', 'complex_step' or 'central', got {method!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise GradcheckError(f"seed: expected a non-negative integer, got {seed!r}")
    limits = (("directions", directions, 1024), ("levels", levels, 16),
              ("full_limit", full_limit, 2**31))
    for what, count, top in limits:
        if not 1 <= count <= top:
            raise GradcheckError(f"{what}: expected an integer in [1, {top}], got "
                                 f"{shown(count)}")
    if not 2.0**-40 <= step <= 2.0**-4 or not step * 2.0 ** (levels - 1) < 1.0:
        raise GradcheckError(f"step: expected a relative step in [2**-40, 1/16] with step * "
                             f"2**(levels - 1) < 1, got {step!r} and levels {levels}")
    if not 1.0 <= safety <= 2.0**20 or not 0.0 <= rounding_ulps <= 2.0**40:
        raise GradcheckError(f"safety, rounding_ulps: expected safety in [1, 2**20] and "
                             f"rounding_ulps in [0, 2**40], got {safety!r}, {rounding_ulps!r}")
    null_space = dict(null_space or {})

    checker = _Checker(fn, inputs, step=step, levels=levels, safety=safety,
                       rounding_ulps=rounding_ulps)
    f0 = float64_array("fn output", checker.fn(**inputs))
    if mode == "auto":
        mode = "full" if sum(inputs[n].size for n in names) <= full_limit else "directional"
    rounds = 1 if mode == "full" else int(directions)

    cotangents = []
    for r in range(rounds):
        if r == 0 and grad_output is not None:
            v = float64_array("grad_output", grad_output)
            if v.shape != f0.shape:
                raise GradcheckError(
                    f"grad_output: expected the output's shape {list(f0.shape)}, "
                    f"got {list(v.shape)}"
                )
        else:
            v = cotangent(f0.shape, seed=int(seed), round_=r)
        cotangents.append(np.array(v, dtype=np.float64))
    n_vjp = 0
    grads = []
    for v in cotangents:
        grads.append(vjp(v.copy(), **inputs))
        n_vjp += 1
    analytic: dict[str, list[np.ndarray | None]] = {n: [] for n in names}
    problems: dict[str, str | None] = dict.fromkeys(names)
    for gr in grads:
        for n in names:
            g, problem = _analytic(n, gr, inputs[n])
            analytic[n].append(g)
            problems[n] = problems[n] or problem

    # -- method per input --------------------------------------------------------------
    notes: list[str] = []
    method_note: dict[str, str] = {}
    first: dict[str, Jvp] = {}
    dirs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for n in names:
        w0 = direction(inputs[n], seed=int(seed), name=n, round_=0,
                       null_projector=null_space.get(n), step=step, levels=levels)
        if not np.any(w0):  # every direction is null: test safety along an unprojected one
            w0 = direction(inputs[n], seed=int(seed), name=n, round_=0, step=step,
                           levels=levels)
        dirs[n].append(w0)
        if method == "auto":
            verdict = complex_safety(checker.fn, inputs, n, w0, step=step,
                                     rounding_ulps=rounding_ulps)
            checker.methods[n] = "complex_step" if verdict.safe else "central"
            method_note[n] = verdict.reason
            chosen = verdict.complex if verdict.safe else verdict.central
            if chosen is not None and (verdict.safe or len(chosen.steps) == levels):
                first[n] = chosen  # reused as round 0 (a fallback only at the same levels)
            if verdict.central is not None and verdict.central.project(cotangents[0]).kink:
                notes.append(f"{n}: the central difference along the safety-test direction "
                             "is non-smooth (error grows as the step shrinks)")
        else:
            checker.methods[n] = method
            method_note[n] = ("complex step (requested)" if method == "complex_step"
                              else f"central differences, {levels} Richardson level(s) "
                                   "(requested)")

    # -- comparisons -------------------------------------------------------------------
    reports: dict[str, InputReport] = {}
    total = sum(inputs[n].size for n in names) if mode == "full" else rounds * len(names)
    with _progress_bar(total, progress) as bar:
        if mode == "full":
            cols = {n: _full_columns(checker, n, cotangents[0], bar) for n in names}
        else:
            cols = {n: _directional_columns(checker, n, cotangents, seed=int(seed),
                                            null=null_space.get(n), first=first.get(n),
                                            dirs=dirs[n], bar=bar) for n in names}
    # rms Jacobian column norm per input: the rounding floor (global when an input has none)
    col_scale = {n: c["col_rms"] for n, c in cols.items()}
    global_scale = max(col_scale.values(), default=0.0)
    cache: dict[int, Mapping[str, np.ndarray]] = {}

    def terms(r: int) -> Mapping[str, np.ndarray]:
        if term_scale is None:
            return {}
        if r not in cache:
            cache[r] = term_scale(cotangents[r].copy(), **inputs)
        return cache[r]

    for n in names:
        c = cols[n]
        floor = col_scale[n] if col_scale[n] > 0 else global_scale
        reports[n] = _compare(
            checker, n, mode, c, analytic[n], cotangents, floor=floor,
            method_note=method_note[n], problem=problems[n], null=null_space.get(n),
            localize=localize, terms=terms,
        )
    settings = {"directions": rounds if mode == "directional" else directions,
                "safety": safety, "rounding_ulps": rounding_ulps, "step": step,
                "levels": levels, "full_limit": full_limit}
    return Report(
        inputs=reports, mode=mode, method=method, seed=int(seed),
        cotangents=tuple(cotangents), directions={n: tuple(d) for n, d in dirs.items()},
        notes=tuple(notes), n_fn_calls=checker.fn.calls, n_vjp_calls=n_vjp,
        settings=settings,
    )


class _NoBar:
    """Stands in for a tqdm bar when none is drawn."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def _progress_bar(total: int, enabled: bool | None) -> Any:
    """A tqdm bar over ``total`` numeric derivatives (refattn's policy, without refattn: None
    draws it only on a terminal after half a second, False never, True always)."""
    if enabled is False:
        return _NoBar()
    from tqdm import tqdm

    auto = {"disable": None, "delay": PROGRESS_DELAY} if enabled is None else {}
    return tqdm(total=total, desc="gradcheck", unit="jvp", file=sys.stderr, leave=False,
                dynamic_ncols=True, **auto)


def _full_columns(checker: _Checker, name: str, v: np.ndarray, bar: Any) -> dict[str, Any]:
    """Every element's numeric derivative ``<v, J e_i>`` with estimate and column norm."""
    x = checker.inputs[name]
    num, err, norm, wabs = (np.zeros(x.shape) for _ in range(4))
    kinks, projections = [], []
    for i in range(x.size):
        idx = np.unravel_index(i, x.shape)
        raw = np.zeros(x.shape)
        raw[idx] = max(abs(float(x[idx])), 1.0)  # per-element step eps^(1/3) * max(|x|, 1)
        w = exact_direction(x, raw, step=checker.step, levels=checker.levels)
        p = checker.jvp(name, w).project(v)
        projections.append(p)
        wi = float(w[idx])
        num[idx], norm[idx], wabs[idx] = p.value / wi, p.norm / abs(wi), abs(wi)
        if p.kink:
            kinks.append(tuple(int(j) for j in idx))
        bar.update(1)
    # rounding noise pooled over every column of this input (same fn, same neighbourhood)
    err = pooled_errors(projections).reshape(x.shape) / np.where(wabs > 0, wabs, 1.0)
    col_rms = float(np.sqrt(np.mean(norm**2))) if norm.size else 0.0
    return {"numeric": num, "error": err, "norm": norm, "kinks": tuple(kinks),
            "col_rms": col_rms, "w": None}


def _directional_columns(
    checker: _Checker, name: str, cotangents: list[np.ndarray], *, seed: int,
    null: Projector | None, first: Jvp | None, dirs: list[np.ndarray], bar: Any,
) -> dict[str, Any]:
    """``<v_r, J w_r>`` for each round's direction, with estimates and norms."""
    x = checker.inputs[name]
    rounds = len(cotangents)
    num, norm, wnorm = (np.zeros(rounds) for _ in range(3))
    ws, kinks, skipped, projections = [], [], [], []
    for r, v in enumerate(cotangents):
        if r == 0:
            w = dirs[0]
        else:
            w = direction(x, seed=seed, name=name, round_=r, null_projector=null,
                          step=checker.step, levels=checker.levels,
                          exact=checker.methods[name] != "complex_step")
            dirs.append(w)
        ws.append(w)
        if not np.any(w):  # the input's every direction is null: nothing to compare
            skipped.append(r)
        j = first if (r == 0 and first is not None) else checker.jvp(name, w)
        p = j.project(v)
        projections.append(p)
        num[r], norm[r], wnorm[r] = p.value, p.norm, np.linalg.norm(w)
        if p.kink:
            kinks.append(r)
        bar.update(1)
    err = pooled_errors(projections)  # rounding noise pooled over the rounds
    ok = wnorm > 0
    col_rms = float(np.sqrt(np.mean((norm[ok] / wnorm[ok]) ** 2))) if ok.any() else 0.0
    return {"numeric": num, "error": err, "norm": norm, "kinks": tuple(kinks),
            "col_rms": col_rms, "w": ws, "wnorm": wnorm, "skipped": skipped}


def _term(terms: Callable[[int], Mapping[str, np.ndarray]], r: int, name: str,
          shape: tuple[int, ...]) -> np.ndarray | None:
    s = terms(r).get(name)
    if s is None or np.shape(s) != shape:
        return None
    return np.abs(np.asarray(s, dtype=np.float64))


def _element(checker: _Checker, name: str, idx: tuple[int, ...], g: np.ndarray,
             v: np.ndarray, floor: float, term: float = 0.0) -> Worst:
    """Check one element exactly as full mode does (used after bisection)."""
    x = checker.inputs[name]
    raw = np.zeros(x.shape)
    raw[idx] = max(abs(float(x[idx])), 1.0)
    w = exact_direction(x, raw, step=checker.step, levels=checker.levels)
    p = checker.jvp(name, w).project(v)
    wi = float(w[idx])
    a, n = float(g[idx]), p.value / wi
    e = abs(a - n)
    t = float(checker.tol(p.error / abs(wi), float(np.linalg.norm(v)), p.norm / abs(wi),
                          floor, abs(a))) + 2.0 * checker.safety * checker.ulps * EPS * term
    return Worst(idx, None, a, n, e, float(_rel(np.array(a), np.array(n))), p.error / abs(wi),
                 t, e / t if t > 0 else (0.0 if e == 0 else np.inf))


def _compare(
    checker: _Checker, name: str, mode: str, c: dict[str, Any],
    analytic: list[np.ndarray | None], cotangents: list[np.ndarray], *, floor: float,
    method_note: str, problem: str | None, null: Projector | None, localize: bool,
    terms: Callable[[int], Mapping[str, np.ndarray]],
) -> InputReport:
    x = checker.inputs[name]
    method = checker.methods[name]
    base = {"name": name, "shape": tuple(x.shape), "mode": mode, "method": method,
            "method_note": method_note, "kinks": c["kinks"], "problem": problem}
    if any(g is None for g in analytic):
        return InputReport(n_checked=0, n_over=0, worst=None, quantiles=quantiles(np.zeros(0)),
                           scale_fit=None, **base)
    gs: list[np.ndarray] = [g for g in analytic if g is not None]
    # multiplies a magnitude of summed terms; twice, because the numeric side (complex step
    # differentiates the same cancelling sums forward) rounds at that scale as well
    bound = 2.0 * checker.safety * checker.ulps * EPS
    null_ratio = None
    if null is not None:
        ratios = []
        for r, (g, v) in enumerate(zip(gs, cotangents, strict=True)):
            # the exact derivative along a null direction is zero: only rounding remains
            res = float(np.linalg.norm(np.broadcast_to(null(g), g.shape)))
            t = bound * (float(np.linalg.norm(g))
                         + float(np.linalg.norm(v)) * floor * np.sqrt(g.size))
            if res > TERM_TRIGGER * t and (s := _term(terms, r, name, x.shape)) is not None:
                t += bound * float(np.linalg.norm(s))
            ratios.append(res / t if t > 0 else (0.0 if res == 0 else np.inf))
        null_ratio = float(max(ratios))
    localized = False
    if mode == "full":
        v = cotangents[0]
        a, n = gs[0], c["numeric"]
        abs_err = np.abs(a - n)
        tol = checker.tol(c["error"], float(np.linalg.norm(v)), c["norm"], floor, np.abs(a))
        if (abs_err > TERM_TRIGGER * tol).any() and (
                s := _term(terms, 0, name, x.shape)) is not None:
            tol = tol + bound * s  # the vjp's own rounding, where it sums large terms
        ratio = error_ratio(abs_err, tol)
        rel = _rel(a, n)
        k = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else None
        worst = None if k is None else Worst(
            tuple(int(i) for i in k), None, float(a[k]), float(n[k]), float(abs_err[k]),
            float(rel[k]), float(c["error"][k]), float(tol[k]), float(ratio[k]))
        return InputReport(
            n_checked=int(a.size), n_over=int((ratio > 1.0).sum()), worst=worst,
            quantiles=quantiles(rel), scale_fit=scale_fit(a, n), null_ratio=null_ratio,
            analytic=a, numeric=n, ratio=ratio, **base)
    # directional
    ws = c["w"]
    a = np.array([float(g.ravel() @ w.ravel()) for g, w in zip(gs, ws, strict=True)])
    dot = np.array([float(np.abs(g.ravel() * w.ravel()).sum()) for g, w in
                    zip(gs, ws, strict=True)])
    n = c["numeric"]
    vnorms = np.array([np.linalg.norm(v) for v in cotangents])
    tol = checker.tol(c["error"], 1.0, vnorms * c["norm"], vnorms * floor * c["wnorm"], dot)
    abs_err = np.abs(a - n)
    for r in map(int, np.flatnonzero(abs_err > TERM_TRIGGER * tol)):
        if (s := _term(terms, r, name, x.shape)) is not None:
            tol[r] += bound * float(np.abs(s.ravel() * ws[r].ravel()).sum())
    ratio = error_ratio(abs_err, tol)
    for r in c["skipped"]:
        ratio[r] = 0.0
    rel = _rel(a, n)
    r = int(np.argmax(ratio))
    worst = Worst(None, r, float(a[r]), float(n[r]), float(abs_err[r]), float(rel[r]),
                  float(c["error"][r]), float(tol[r]), float(ratio[r]))
    n_over = int((ratio > 1.0).sum())
    if n_over and localize and x.size > 0:
        v, g, w = cotangents[r], gs[r], ws[r]
        idx, _ = bisect(g, w, float(a[r] - n[r]),
                        lambda ws_: checker.jvp(name, ws_).project(v).value)
        s = _term(terms, r, name, x.shape)
        el = _element(checker, name, idx, g, v, floor, 0.0 if s is None else float(s[idx]))
        worst = Worst(idx, r, el.analytic, el.numeric, el.abs_error, el.rel_error,
                      el.error_estimate, el.tolerance, el.ratio)
        localized = True
    notes = method_note
    if c["skipped"]:
        notes += f"; rounds {c['skipped']} skipped (every direction is null)"
    base["method_note"] = notes
    return InputReport(
        n_checked=len(ws) - len(c["skipped"]), n_over=n_over, worst=worst,
        quantiles=quantiles(rel), scale_fit=scale_fit(a, n), null_ratio=null_ratio,
        localized=localized, analytic=a, numeric=n, ratio=ratio, **base)


@public
def assert_gradients(
    fn: Callable[..., np.ndarray],
    vjp: Callable[..., Mapping[str, np.ndarray]],
    inputs: Mapping[str, np.ndarray],
    **options: Any,
) -> Report:
    """:func:`check_vjp` for pytest: returns the report, raises when a gradient is wrong.

    Raises
    ------
    GradientCheckError
        An ``AssertionError`` whose message is the report's table and whose ``.report`` is
        the :class:`Report`.

    Examples
    --------
    >>> fn = lambda x: x**3
    >>> assert_gradients(fn, lambda g, x: {"x": 3 * g * x**2}, {"x": np.array([1.5])}).passed
    True
    >>> try:
    ...     assert_gradients(fn, lambda g, x: {"x": 2 * g * x**2}, {"x": np.array([1.5])})
    ... except AssertionError as exc:
    ...     print(exc.report.inputs["x"].scale_fit.describe().split(" (")[0])
    analytic = 0.666667 x numeric
    """
    report = check_vjp(fn, vjp, inputs, **options)
    if not report.passed:
        raise GradientCheckError(report)
    return report
