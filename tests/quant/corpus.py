"""Issue 41, item 5: a corpus of random FA3-style and SageAttention-style calls, each with the
honest and the buggy float32 simulations of its kernel (``sims.py``, written from the kernels'
sources, not from refattn's emulator), and the bookkeeping that turns a check into detection
rates.

A generated :class:`CorpusCall` holds the :class:`refattn.AttentionCall` as the kernel receives
it (FP8 codes for FA3, fp16 values for SageAttention), the preset's name and keyword arguments
(FA3's descales and kv tile), and zero-argument functions that run each honest variant and each
planted bug of the simulation. Everything is deterministic from the seed (call ``i`` of seed
``s`` draws from ``SeedSequence([s, kernel, i])``; the random summation orders from
``[s, kernel, i, 1]``).

:func:`evaluate` runs every variant of every call through a check supplied by the caller,

    check(call, target, candidate) -> (passed, radius_stats)

where ``call`` is the AttentionCall, ``target`` a :class:`Target` (the preset's name, its
keyword arguments ``preset_kwargs`` and the spec changes of the kernel's configuration: none,
except SageAttention's ``smooth_k=False`` variants, ``{"k_smoothing": False}``, the argument
SageAttention exposes) and ``candidate`` the dict of the kernel's returned tensors
(``{"output": O, "lse": L}`` for FA3, ``{"output": O}`` for SageAttention, whose preset
emulates no LSE); ``radius_stats`` is the caller's (a dict with ``"median"`` and ``"max"`` of
the output interval's radius is what :func:`summarize` reads). :func:`quant_check` builds that
check on :mod:`refattn.quant` (imported when called).

A bug "changes the output by more than the honest kernels' own error" on a call when
``max|O_bug - O_ref| > max_h max|O_h - O_ref|``, ``O_ref`` the reference honest output (FA3:
sequential; SageAttention: smoothed, product-first) and h over the honest variants of the
reference's configuration (FA3: all five orders; SageAttention: the two smoothed scale orders,
since the bugs are planted in the smoothed kernel and the unsmoothed one differs from it by a
whole quantisation error); a NaN on one side only counts as an infinite difference.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import refattn
from refattn.masks import causal as causal_mask

from . import sims

__all__ = [
    "FA3_CORPUS_BUGS",
    "FA3_HONEST",
    "SAGE_CORPUS_BUGS",
    "SAGE_HONEST",
    "CallVerdict",
    "CorpusCall",
    "Target",
    "evaluate",
    "fa3_calls",
    "fa3_kblock_n",
    "max_abs_diff",
    "quant_check",
    "sage_calls",
    "summarize",
]

#: FA3's honest variants: the summation order of both products (``sims.ACCUMULATORS``)
FA3_HONEST = sims.ACCUMULATORS
#: FA3's planted bugs of issue 41
FA3_CORPUS_BUGS = ("no_v_descale", "no_log2e", "scale_twice", "drop_last_tile", "natural_exp",
                   "p_e5m2", "no_offset", "l_after_rounding")
#: SageAttention's honest variants: name -> sims.sageattention_int8 keywords (smooth_k is the
#: kernel's own option: the spec follows it, see Target)
SAGE_HONEST: dict[str, dict[str, Any]] = {
    "smooth_product_first": {"smooth_k": True, "scale_order": "product_first"},
    "smooth_sequential": {"smooth_k": True, "scale_order": "sequential"},
    "plain_product_first": {"smooth_k": False, "scale_order": "product_first"},
    "plain_sequential": {"smooth_k": False, "scale_order": "sequential"},
}
#: SageAttention's planted bugs of issue 41
SAGE_CORPUS_BUGS = ("no_log2e_prescale", "no_alpha_rescale", "single_k_scale")

_KERNEL_IDS = {"fa3_fp8": 3, "sageattention_int8": 8}


def fa3_kblock_n(head_dim: int, *, v_colmajor: bool = False) -> int:
    """FA3's FP8 kBlockN on SM90 for a head dimension (``hopper/tile_size.h``
    ``tile_size_fwd_sm90``, element_size 1, two MMA warpgroups, no paging, no local window,
    no softcap): 160 (D <= 64), 128 (<= 96), 224 (<= 128; 192 with ``v_colmajor``), 160
    (<= 192), 128 (<= 256)."""
    if head_dim <= 64:
        return 160
    if head_dim <= 96:
        return 128
    if head_dim <= 128:
        return 192 if v_colmajor else 224
    if head_dim <= 192:
        return 160
    return 128


@dataclass(frozen=True)
class Target:
    """What a candidate is checked against: ``preset(preset, **kwargs)``, then
    ``.replace(**changes)`` when there are changes (the kernel's configuration)."""

    preset: str
    kwargs: dict[str, Any]
    changes: dict[str, Any] = field(default_factory=dict)

    def spec(self) -> Any:
        """The QuantSpec (imports :mod:`refattn.quant`)."""
        from refattn.quant import preset
        spec = preset(self.preset, **self.kwargs)
        return spec.replace(**self.changes) if self.changes else spec


@dataclass(frozen=True)
class CorpusCall:
    """One generated call and the simulations of its kernel.

    Attributes
    ----------
    name : str
        ``"<kernel>-<seed>-<i>"``.
    kernel : str
        The preset's name: ``"fa3_fp8"`` or ``"sageattention_int8"``.
    call : refattn.AttentionCall
        As the kernel receives it.
    preset_kwargs : dict
        ``preset(kernel, **preset_kwargs)``'s keywords (FA3: ``q_descale``, ``k_descale``,
        ``v_descale`` (B, Hkv) float32 values and ``kv_tile``; SageAttention: ``dtype``,
        ``kv_tile``).
    honest, bugs : dict of str to callable
        ``f() -> sims.SimResult``: each honest variant, each planted bug.
    reference : str
        The honest variant the bugs' changes are measured from (the bugs run in its
        configuration).
    changes : dict of str to dict
        Honest variant -> its spec changes (absent: none; see :class:`Target`).
    info : dict
        B, Hq, Hkv, Q, K, D, causal, amplitude, block_n (and FA3's unit_descales).
    """

    name: str
    kernel: str
    call: refattn.AttentionCall
    preset_kwargs: dict[str, Any]
    honest: dict[str, Callable[[], sims.SimResult]]
    bugs: dict[str, Callable[[], sims.SimResult]]
    reference: str
    info: dict[str, Any]
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def target(self, variant: str | None = None) -> Target:
        """The Target of an honest variant (None, or a bug: the reference's)."""
        return Target(self.kernel, self.preset_kwargs, dict(self.changes.get(variant, {})))

    def candidate(self, result: sims.SimResult) -> dict[str, np.ndarray]:
        """What the kernel returns: output, and FA3's natural-log LSE."""
        if self.kernel == "fa3_fp8" and result.lse is not None:
            return {"output": result.output, "lse": result.lse}
        return {"output": result.output}


def _seq(seed: int, kernel: str, i: int, *extra: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, _KERNEL_IDS[kernel], i, *extra])


def _heads(rng: np.random.Generator) -> tuple[int, int]:
    Hq = int(rng.choice([2, 4, 8]))
    Hkv = int(rng.choice([d for d in (1, 2, 4, 8) if Hq % d == 0]))
    return Hq, Hkv


def _amp(rng: np.random.Generator, amplitude: float | tuple[float, float]) -> float:
    if isinstance(amplitude, tuple):
        return float(rng.uniform(*amplitude))
    return float(amplitude)


def fa3_calls(n: int, seed: int = 0, *, max_len: int = 256,
              amplitude: float | tuple[float, float] = (1.0, 4.0),
              block_n: int | None = None, dims: tuple[int, ...] = (64, 128),
              causal_fraction: float = 2 / 3, unit_descale_fraction: float = 0.25,
              min_len: int = 1, max_q: int | None = None,
              preset_extra: dict[str, Any] | None = None) -> list[CorpusCall]:
    """``n`` random FA3-style calls.

    D from ``dims``; K uniform in [min_len, max_len]; causal (lower-right) with probability
    ``causal_fraction`` and then Q uniform in [min_len, min(K, max_q)] (every row sees a key),
    else Q uniform in [min_len, max_q] (``max_q`` None: ``max_len``); B in {1, 2}; Hq in
    {2, 4, 8} with Hkv a divisor (1 = MQA);
    q, k, v = satfinite e4m3(randn x a) with a uniform in ``amplitude`` (a pair) or fixed (a
    float); float32 descales (B, Hkv) log-uniform in [0.25, 4], all three 1 with probability
    ``unit_descale_fraction``; scale = D^-1/2. ``block_n``: the kv tile of the simulations
    and of the preset (``kv_tile``); None: :func:`fa3_kblock_n` of D. ``preset_extra``: more
    preset keywords (e.g. what lets the preset take a tile off FA3's table).
    """
    max_q = max_len if max_q is None else max_q
    out = []
    for i in range(n):
        rng = np.random.default_rng(_seq(seed, "fa3_fp8", i))
        D = int(rng.choice(dims))
        causal = bool(rng.random() < causal_fraction)
        K = int(rng.integers(min_len, max_len + 1))
        Q = int(rng.integers(min_len, min(K, max_q) + 1)) if causal else int(
            rng.integers(min_len, max_q + 1))
        B = int(rng.integers(1, 3))
        Hq, Hkv = _heads(rng)
        a = _amp(rng, amplitude)

        def e4m3(shape: tuple[int, ...], rng=rng, a=a) -> np.ndarray:
            return sims.cast(rng.standard_normal(shape) * a, "e4m3fn",
                             saturate=True).astype(np.float64)
        q, k, v = e4m3((B, Hq, Q, D)), e4m3((B, Hkv, K, D)), e4m3((B, Hkv, K, D))
        unit = bool(rng.random() < unit_descale_fraction)
        qd, kd, vd = (np.ones((B, Hkv)) if unit else sims.f32_scales(rng, (B, Hkv), 0.25, 4.0)
                      for _ in range(3))
        tile = fa3_kblock_n(D) if block_n is None else int(block_n)
        scale = D ** -0.5
        call = refattn.AttentionCall(
            q, k, v, scale=scale,
            visible=causal_mask(Q, K, alignment="lower_right") if causal else None)
        kw = {"q": q, "k": k, "v": v, "scale": scale, "q_descale": qd, "k_descale": kd,
              "v_descale": vd, "causal": causal, "block_n": tile}
        rseed = _seq(seed, "fa3_fp8", i, 1)

        def honest(acc: str, kw=kw, rseed=rseed) -> Callable[[], sims.SimResult]:
            return lambda: sims.fa3_fp8(**kw, accumulate=acc,
                                        rng=np.random.default_rng(rseed))

        def buggy(bug: str, kw=kw) -> Callable[[], sims.SimResult]:
            return lambda: sims.fa3_fp8(**kw, bug=bug)
        out.append(CorpusCall(
            name=f"fa3_fp8-{seed}-{i}", kernel="fa3_fp8", call=call,
            preset_kwargs={"q_descale": qd, "k_descale": kd, "v_descale": vd, "kv_tile": tile,
                           **(preset_extra or {})},
            honest={h: honest(h) for h in FA3_HONEST},
            bugs={b: buggy(b) for b in FA3_CORPUS_BUGS}, reference="sequential",
            info={"B": B, "Hq": Hq, "Hkv": Hkv, "Q": Q, "K": K, "D": D, "causal": causal,
                  "amplitude": a, "block_n": tile, "unit_descales": unit}))
    return out


def sage_calls(n: int, seed: int = 0, *, max_len: int = 256,
               amplitude: float | tuple[float, float] = (1.0, 4.0),
               dims: tuple[int, ...] = (64, 128), causal_fraction: float = 2 / 3,
               min_len: int = 2) -> list[CorpusCall]:
    """``n`` random SageAttention-style calls (``sageattn_qk_int8_pv_fp16_triton``, fp16).

    D from ``dims``; causal with probability ``causal_fraction`` and then Q = K (the kernel's
    triangle is upper-left), else Q, K uniform in [min_len, max_len] each; B in {1, 2}; Hq in
    {2, 4, 8} with Hkv a divisor; q, v = fp16(randn x a), k = fp16(randn x a + b) with a
    per-(batch, kv head, channel) bias b = randn x a (what the smoothing removes); a as in
    :func:`fa3_calls`. The kernel's blocks: BLOCK_M = 128 queries (Q's scales), BLOCK_N = 64
    keys (K's scales and the online softmax's tile); the preset with ``dtype="fp16"`` and
    ``kv_tile=64``. ``min_len`` >= 2: one key smoothed by its own mean is a block of zeros,
    which the kernel divides by (0/0) and the preset refuses.
    """
    out = []
    for i in range(n):
        rng = np.random.default_rng(_seq(seed, "sageattention_int8", i))
        D = int(rng.choice(dims))
        causal = bool(rng.random() < causal_fraction)
        K = int(rng.integers(min_len, max_len + 1))
        Q = K if causal else int(rng.integers(min_len, max_len + 1))
        B = int(rng.integers(1, 3))
        Hq, Hkv = _heads(rng)
        a = _amp(rng, amplitude)

        def fp16(x: np.ndarray) -> np.ndarray:
            return sims.cast(x, "fp16", saturate=False).astype(np.float64)
        q = fp16(rng.standard_normal((B, Hq, Q, D)) * a)
        k = fp16(rng.standard_normal((B, Hkv, K, D)) * a
                 + rng.standard_normal((B, Hkv, 1, D)) * a)
        v = fp16(rng.standard_normal((B, Hkv, K, D)) * a)
        scale = D ** -0.5
        call = refattn.AttentionCall(
            q, k, v, scale=scale,
            visible=causal_mask(Q, K, alignment="upper_left") if causal else None)
        kw = {"q": q, "k": k, "v": v, "scale": scale, "dtype": "fp16", "causal": causal,
              "blkq": 128, "blkk": 64}

        def honest(opts: dict[str, Any], kw=kw) -> Callable[[], sims.SimResult]:
            return lambda: sims.sageattention_int8(**kw, **opts)

        def buggy(bug: str, kw=kw) -> Callable[[], sims.SimResult]:
            return lambda: sims.sageattention_int8(**kw, bug=bug)
        out.append(CorpusCall(
            name=f"sageattention_int8-{seed}-{i}", kernel="sageattention_int8", call=call,
            preset_kwargs={"dtype": "fp16", "kv_tile": 64},
            honest={h: honest(o) for h, o in SAGE_HONEST.items()},
            bugs={b: buggy(b) for b in SAGE_CORPUS_BUGS}, reference="smooth_product_first",
            changes={h: {"k_smoothing": False} for h, o in SAGE_HONEST.items()
                     if not o["smooth_k"]},
            info={"B": B, "Hq": Hq, "Hkv": Hkv, "Q": Q, "K": K, "D": D, "causal": causal,
                  "amplitude": a, "block_n": 64}))
    return out


def max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y| with NaN against a number (or inf against a different value) as +inf and
    NaN against NaN as 0; 0.0 for empty arrays."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    with np.errstate(invalid="ignore"):
        d = np.abs(x - y)
    both_nan = np.isnan(x) & np.isnan(y)
    same = (x == y) | both_nan
    d = np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))
    return float(d.max()) if d.size else 0.0


@dataclass
class CallVerdict:
    """What :func:`evaluate` found on one call.

    honest, bugs : variant -> whether the check passed it (a passing bug is missed)
    honest_diff : honest variant -> max |O_h - O_ref|
    honest_error : max of ``honest_diff`` over the variants of the reference's configuration
        (the honest kernels' own error)
    bug_diff : bug -> max |O_bug - O_ref|
    affected : bug -> ``bug_diff > honest_error``
    radius : the check's radius statistics of the call (from the reference's check)
    seconds : {"sims": ..., "check": ...}
    """

    name: str
    kernel: str
    info: dict[str, Any]
    honest: dict[str, bool] = field(default_factory=dict)
    honest_diff: dict[str, float] = field(default_factory=dict)
    honest_error: float = 0.0
    bugs: dict[str, bool] = field(default_factory=dict)
    bug_diff: dict[str, float] = field(default_factory=dict)
    affected: dict[str, bool] = field(default_factory=dict)
    radius: Any = None
    seconds: dict[str, float] = field(default_factory=dict)


Check = Callable[[refattn.AttentionCall, Target, dict[str, np.ndarray]], tuple[bool, Any]]


def evaluate(calls: Iterable[CorpusCall], check: Check, *, honest: Iterable[str] | None = None,
             bugs: Iterable[str] | None = None,
             progress: Callable[[CallVerdict], None] | None = None) -> list[CallVerdict]:
    """Run every honest variant and planted bug of each call through ``check``.

    ``honest`` / ``bugs``: a subset of the variants / bugs to run (the reference always runs).
    ``progress(verdict)`` after each call.
    """
    out = []
    for cc in calls:
        v = CallVerdict(cc.name, cc.kernel, dict(cc.info))
        hs = list(cc.honest) if honest is None else [h for h in cc.honest if h in set(honest)]
        if cc.reference not in hs:
            hs.insert(0, cc.reference)
        bs = list(cc.bugs) if bugs is None else [b for b in cc.bugs if b in set(bugs)]
        t_sim = t_chk = 0.0
        outputs = {}
        for kind, names, table in (("honest", hs, cc.honest), ("bug", bs, cc.bugs)):
            for name in names:
                t0 = time.perf_counter()
                res = table[name]()
                t1 = time.perf_counter()
                target = cc.target(name if kind == "honest" else None)
                passed, radius = check(cc.call, target, cc.candidate(res))
                t_chk += time.perf_counter() - t1
                t_sim += t1 - t0
                outputs[kind, name] = res.output
                if kind == "honest":
                    v.honest[name] = bool(passed)
                    if name == cc.reference:
                        v.radius = radius
                else:
                    v.bugs[name] = bool(passed)
        ref = outputs["honest", cc.reference]
        v.honest_diff = {h: max_abs_diff(outputs["honest", h], ref) for h in hs}
        same = cc.changes.get(cc.reference, {})
        v.honest_error = max(d for h, d in v.honest_diff.items()
                             if cc.changes.get(h, {}) == same)
        v.bug_diff = {b: max_abs_diff(outputs["bug", b], ref) for b in bs}
        v.affected = {b: v.bug_diff[b] > v.honest_error for b in bs}
        v.seconds = {"sims": t_sim, "check": t_chk}
        out.append(v)
        if progress is not None:
            progress(v)
    return out


def summarize(verdicts: Iterable[CallVerdict]) -> dict[str, Any]:
    """Per bug: calls, affected, caught among affected, rate (None without affected calls);
    per honest variant: calls and false alarms; the radius: median of the per-call medians,
    max of the per-call maxima (where the check's radius statistics are dicts with
    ``"median"`` and ``"max"``)."""
    verdicts = list(verdicts)
    bugs: dict[str, dict[str, Any]] = {}
    honest: dict[str, dict[str, int]] = {}
    med, mx = [], []
    for v in verdicts:
        for b, passed in v.bugs.items():
            row = bugs.setdefault(b, {"calls": 0, "affected": 0, "caught": 0,
                                      "caught_unaffected": 0})
            row["calls"] += 1
            if v.affected[b]:
                row["affected"] += 1
                row["caught"] += int(not passed)
            else:
                row["caught_unaffected"] += int(not passed)
        for h, passed in v.honest.items():
            row = honest.setdefault(h, {"calls": 0, "false_alarms": 0})
            row["calls"] += 1
            row["false_alarms"] += int(not passed)
        if isinstance(v.radius, dict):
            med.append(v.radius.get("median", math.nan))
            mx.append(v.radius.get("max", math.nan))
    for row in bugs.values():
        row["rate"] = row["caught"] / row["affected"] if row["affected"] else None
    return {"bugs": bugs, "honest": honest,
            "radius_median": float(np.median(med)) if med else math.nan,
            "radius_max": float(np.max(mx)) if mx else math.nan}


def quant_check(**preset_overrides: Any) -> Check:
    """The check on :mod:`refattn.quant`: ``check_candidate(quantized(call, spec),
    candidate)`` with the target's spec (its preset keywords updated by
    ``preset_overrides``, e.g. ``mma_bits=24``); radius statistics of the emulated output
    (finite radii: median, max; and the count of infinite ones). The emulations of the last
    call are cached (evaluate() checks every variant of a call in a row)."""
    from refattn.quant import check_candidate, quantized

    cache: dict[Any, Any] = {}

    def check(call: refattn.AttentionCall, target: Target,
              candidate: dict[str, np.ndarray]) -> tuple[bool, dict[str, float]]:
        if cache.get("call") is not call:
            cache.clear()
            cache["call"] = call
        key = repr(sorted(target.changes.items()))
        if key not in cache:
            spec = Target(target.preset, {**target.kwargs, **preset_overrides},
                          target.changes).spec()
            res = quantized(call, spec)
            rad = np.asarray(res.emulated["output"].rad, dtype=np.float64)
            fin = rad[np.isfinite(rad)]
            stats = {"median": float(np.median(fin)) if fin.size else math.inf,
                     "max": float(fin.max()) if fin.size else math.inf,
                     "infinite": int(rad.size - fin.size)}
            cache[key] = (res, stats)
        res, stats = cache[key]
        return bool(check_candidate(res, candidate).passed), stats
    return check
