"""Score families: the unscaled compatibility ``u`` of every query-key pair, and its backward.

Owns the four compatibility families of the contract ("Deriving the score families", "One
batched implementation oracle for all four families"): :class:`Dot` (the default),
:class:`Bilinear` (Luong general), :class:`Additive` (Bahdanau, tanh hidden layer, computed in
key blocks under a bounded workspace) and :class:`Cosine` (explicit zero-norm policy). Each
family maps effective queries and keys to ``u`` and back-propagates ``G_u`` into the queries,
keys and its own parameters. Defers the multiplier ``alpha`` and its placement to
:mod:`refattn.call.placement`, and everything after ``u`` (softcap, bias, visibility,
softmax) to :mod:`refattn.engine.reference`.

The arithmetic is complex-safe (no ``abs``, no casts on values that carry derivatives), so a
complex-step derivative check runs through it unchanged.

Shapes: q ``(B, Hq, Q, Dq)``, k ``(B, Hq, K, Dk)`` (keys already gathered per query head),
u ``(B, Hq, Q, K)``. For dot and cosine ``Dq == Dk``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from refattn._checks import INT64_MAX, bounded_float, bounded_int, float64_input, int_text
from refattn.errors import RefAttnError
from refattn.records import float_record, tensor_record

__all__ = [
    "Additive",
    "Bilinear",
    "Cosine",
    "Dot",
    "ScoreFamily",
    "ScoreGradients",
]


class ScoreGradients(NamedTuple):
    """Backward of one score family.

    Attributes
    ----------
    grad_q : (B, Hq, Q, Dq) ndarray
    grad_k : (B, Hq, K, Dk) ndarray
        Per query head (the caller sums heads that share a kv head).
    params : dict of str to ndarray
        Gradient of every family parameter, each in its parameter's own shape.
    """

    grad_q: np.ndarray
    grad_k: np.ndarray
    params: dict[str, np.ndarray]


def _param(name: str, x: object, ndim: tuple[int, ...]) -> np.ndarray:
    out = np.array(float64_input(name, x, ndim), copy=True)
    out.flags.writeable = False
    return out


class ScoreFamily:
    """Base of the score families (see :class:`Dot`, :class:`Bilinear`, ...).

    Class attributes
    ----------------
    name : str
        ``"dot"``, ``"bilinear"``, ``"additive"`` or ``"cosine"``.
    linear_in_operands : bool
        ``u`` is linear in q and in k, so the multiplier may move into either operand
        (scale placements ``"q"``, ``"k"``, ``"split"`` are the same model).
    requires_equal_width : bool
        ``Dq == Dk`` is required.
    has_default_scale : bool
        Only dot attention has a canonical multiplier (``Dk ** -0.5``).
    """

    name: ClassVar[str]
    linear_in_operands: ClassVar[bool]
    requires_equal_width: ClassVar[bool]
    has_default_scale: ClassVar[bool] = False

    def parameters(self) -> dict[str, np.ndarray]:
        """The family's own parameter arrays by name (empty for dot and cosine)."""
        return {}

    def check_call(self, *, Hq: int, Dq: int, Dk: int) -> None:
        """Raise :class:`RefAttnError` if the parameters do not fit a call's axes."""
        if self.requires_equal_width and Dq != Dk:
            raise RefAttnError(
                f"k: feature axis Dk={Dk} must equal q's Dk={Dq} for the {self.name} score"
            )

    def compatibility(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Unscaled compatibility ``u``: (B, Hq, Q, Dq), (B, Hq, K, Dk) -> (B, Hq, Q, K)."""
        raise NotImplementedError

    def compatibility_backward(
        self, grad_u: np.ndarray, q: np.ndarray, k: np.ndarray
    ) -> ScoreGradients:
        """Vector-Jacobian product of :meth:`compatibility` at ``(q, k)`` with ``G_u``."""
        raise NotImplementedError

    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description (family, parameter ledger, policies)."""
        return {"family": self.name, "parameters": {}}

    def with_arrays(self, **arrays: np.ndarray) -> ScoreFamily:
        """A copy with some parameters replaced, WITHOUT validation (complex allowed).

        For derivative checks only (complex step, finite differences); a call built with
        an unchecked family is still gated by :class:`~refattn.AttentionCall`.
        """
        unknown = set(arrays) - set(self.parameters())
        if unknown:
            raise RefAttnError(f"{self.name}: unknown parameter(s) {sorted(unknown)}")
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        for name, value in arrays.items():
            object.__setattr__(copy, name, np.asarray(value))
        return copy


@dataclass(frozen=True, eq=False)
class Dot(ScoreFamily):
    """Dot-product compatibility ``u_ij = q_i . k_j`` (the default family).

    Examples
    --------
    >>> q = np.ones((1, 1, 2, 3)); k = np.arange(6.0).reshape(1, 1, 2, 3)
    >>> Dot().compatibility(q, k)[0, 0].tolist()
    [[3.0, 12.0], [3.0, 12.0]]
    """

    name: ClassVar[str] = "dot"
    linear_in_operands: ClassVar[bool] = True
    requires_equal_width: ClassVar[bool] = True
    has_default_scale: ClassVar[bool] = True

    def compatibility(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return q @ k.swapaxes(-1, -2)  # (B, Hq, Q, K): one GEMM per head

    def compatibility_backward(
        self, grad_u: np.ndarray, q: np.ndarray, k: np.ndarray
    ) -> ScoreGradients:
        return ScoreGradients(grad_u @ k, grad_u.swapaxes(-1, -2) @ q, {})


@dataclass(frozen=True, eq=False)
class Bilinear(ScoreFamily):
    """Bilinear (Luong "general") compatibility ``u_ij = q_i W_h k_j^T``.

    Parameters
    ----------
    W : (Hq, Dq, Dk) or (Dq, Dk) float64 ndarray
        Per-query-head metric, or one metric shared by every head.

    Examples
    --------
    >>> W = np.diag([1.0, 2.0])
    >>> q = np.array([[[[1.0, 1.0]]]]); k = np.array([[[[3.0, 4.0]]]])
    >>> Bilinear(W).compatibility(q, k).ravel().tolist()
    [11.0]
    """

    W: np.ndarray
    name: ClassVar[str] = "bilinear"
    linear_in_operands: ClassVar[bool] = True
    requires_equal_width: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "W", _param("W", self.W, (2, 3)))

    def parameters(self) -> dict[str, np.ndarray]:
        return {"W": self.W}

    @property
    def shared(self) -> bool:
        """Whether one metric ``(Dq, Dk)`` serves every head."""
        return self.W.ndim == 2

    def check_call(self, *, Hq: int, Dq: int, Dk: int) -> None:
        want = (Dq, Dk) if self.shared else (Hq, Dq, Dk)
        if self.W.shape != want:
            letters = "[Dq,Dk]" if self.shared else "[Hq,Dq,Dk]"
            raise RefAttnError(
                f"W: expected shape {letters} = {list(want)}, got {list(self.W.shape)}"
            )

    def compatibility(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        q_metric = q @ self.W  # (B, Hq, Q, Dk); W broadcasts over B (and heads if shared)
        return q_metric @ k.swapaxes(-1, -2)  # (B, Hq, Q, K)

    def compatibility_backward(
        self, grad_u: np.ndarray, q: np.ndarray, k: np.ndarray
    ) -> ScoreGradients:
        q_metric = q @ self.W  # (B, Hq, Q, Dk)
        grad_qm = grad_u @ k  # (B, Hq, Q, Dk)
        grad_k = grad_u.swapaxes(-1, -2) @ q_metric  # (B, Hq, K, Dk)
        grad_q = grad_qm @ self.W.swapaxes(-1, -2)  # (B, Hq, Q, Dq)
        spec = "bhqd,bhqe->de" if self.shared else "bhqd,bhqe->hde"
        grad_w = np.einsum(spec, q, grad_qm)
        return ScoreGradients(grad_q, grad_k, {"W": grad_w})

    def manifest(self) -> dict[str, Any]:
        return {
            "family": self.name,
            "sharing": "shared" if self.shared else "per_head",
            "parameters": {"W": tensor_record(self.W)},
            "parameter_count": int(self.W.size),
        }


@dataclass(frozen=True, eq=False)
class Additive(ScoreFamily):
    """Additive (Bahdanau) compatibility ``u_ij = v . tanh(Wq q_i + Wk k_j + b)``.

    The pair tensor ``(B, Hq, Q, K, Da)`` is never built whole: it is computed in blocks of
    keys (and of queries when one key column alone is too big) holding at most
    ``max_workspace_elements`` elements each; the backward keeps at most three such blocks.

    Parameters
    ----------
    Wq : (Hq, Da, Dq) float64 ndarray
    Wk : (Hq, Da, Dk) float64 ndarray
    b : (Hq, Da) float64 ndarray
    v : (Hq, Da) float64 ndarray
    max_workspace_elements : int
        Bound on one pair block (default 2**20 elements, 8 MiB of float64).

    Examples
    --------
    >>> Wq = np.ones((1, 1, 2)); Wk = np.ones((1, 1, 2)); b = np.zeros((1, 1)); v = np.ones((1, 1))
    >>> u = Additive(Wq, Wk, b, v).compatibility(np.zeros((1, 1, 1, 2)), np.zeros((1, 1, 3, 2)))
    >>> u.ravel().tolist()
    [0.0, 0.0, 0.0]
    """

    Wq: np.ndarray
    Wk: np.ndarray
    b: np.ndarray
    v: np.ndarray
    max_workspace_elements: int = 1 << 20
    name: ClassVar[str] = "additive"
    linear_in_operands: ClassVar[bool] = False
    requires_equal_width: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name, nd in (("Wq", 3), ("Wk", 3), ("b", 2), ("v", 2)):
            object.__setattr__(self, name, _param(name, getattr(self, name), (nd,)))
        H, Da, _ = self.Wq.shape
        if self.Wk.shape[:2] != (H, Da):
            raise RefAttnError(
                f"Wk: leading axes must be [Hq,Da] = {[H, Da]} like Wq, got {list(self.Wk.shape)}"
            )
        for name in ("b", "v"):
            if getattr(self, name).shape != (H, Da):
                raise RefAttnError(
                    f"{name}: expected shape [Hq,Da] = {[H, Da]}, "
                    f"got {list(getattr(self, name).shape)}"
                )
        w = self.max_workspace_elements
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
            raise RefAttnError(f"max_workspace_elements: expected a positive integer, got {w!r}")
        object.__setattr__(self, "max_workspace_elements",  # an int, within int64
                           bounded_int("max_workspace_elements", w, lo=1, hi=INT64_MAX))

    def parameters(self) -> dict[str, np.ndarray]:
        return {"Wq": self.Wq, "Wk": self.Wk, "b": self.b, "v": self.v}

    def check_call(self, *, Hq: int, Dq: int, Dk: int) -> None:
        Da = self.b.shape[1]  # b and v were checked against Wq's [Hq,Da] at construction
        for name, width, letter in (("Wq", Dq, "Dq"), ("Wk", Dk, "Dk")):
            want = (Hq, Da, width)
            got = getattr(self, name).shape
            if got != want:
                raise RefAttnError(
                    f"{name}: expected shape [Hq,Da,{letter}] = {list(want)}, got {list(got)}"
                )

    def block_plan(self, B: int, H: int, Q: int, K: int) -> list[tuple[slice, slice]]:
        """The (query, key) blocks, in execution order, of a ``(B, H, Q, K)`` score.

        Each block's pair tensor ``(B, H, Qb, Kb, Da)`` holds at most
        ``max_workspace_elements`` elements (one key column is the smallest block unless even
        that exceeds the bound; then queries are split too).

        Examples
        --------
        >>> z = np.zeros
        >>> fam = Additive(z((1, 4, 2)), z((1, 4, 2)), z((1, 4)), z((1, 4)),
        ...                max_workspace_elements=24)
        >>> [(qs.start, qs.stop, ks.start, ks.stop) for qs, ks in fam.block_plan(1, 1, 3, 5)]
        [(0, 3, 0, 2), (0, 3, 2, 4), (0, 3, 4, 5)]
        """
        Da = self.b.shape[1]
        budget = int(self.max_workspace_elements)
        per_key = B * H * Q * Da  # elements of one full key column of the pair tensor
        if per_key <= budget:
            qb, kb = Q, max(1, min(K, budget // per_key))
        else:
            qb, kb = max(1, budget // (B * H * Da)), 1
        return [(slice(i, min(i + qb, Q)), slice(j, min(j + kb, K)))
                for i in range(0, Q, qb) for j in range(0, K, kb)]

    def _terms(self, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q_term = np.einsum("bhqd,had->bhqa", q, self.Wq)  # (B, Hq, Q, Da)
        k_term = np.einsum("bhkd,had->bhka", k, self.Wk)  # (B, Hq, K, Da)
        return q_term, k_term

    def _pair(self, q_term: np.ndarray, k_term: np.ndarray, qs: slice, ks: slice) -> np.ndarray:
        # (B, Hq, Qb, Kb, Da): one bounded block of the pair hidden layer
        qt, kt = q_term[:, :, qs, None, :], k_term[:, :, None, ks, :]
        shape = np.broadcast_shapes(qt.shape, kt.shape)
        pre = np.empty(shape, dtype=np.result_type(qt, kt, self.b))  # complex-step safe
        np.add(qt, kt, out=pre)
        pre += self.b[None, :, None, None, :]
        return np.tanh(pre, out=pre)

    def compatibility(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        B, H, Q, _ = q.shape
        K = k.shape[2]
        q_term, k_term = self._terms(q, k)
        dtype = np.result_type(q_term, k_term, self.b, self.v)
        u = np.empty((B, H, Q, K), dtype=dtype)  # (B, Hq, Q, K)
        for qs, ks in self.block_plan(B, H, Q, K):
            pair = self._pair(q_term, k_term, qs, ks)
            u[:, :, qs, ks] = np.einsum("bhqka,ha->bhqk", pair, self.v)
        return u

    def compatibility_backward(
        self, grad_u: np.ndarray, q: np.ndarray, k: np.ndarray
    ) -> ScoreGradients:
        B, H, Q, _ = q.shape
        K = k.shape[2]
        q_term, k_term = self._terms(q, k)
        dtype = np.result_type(q_term, k_term, self.b, self.v, grad_u)
        grad_qt = np.zeros(q_term.shape, dtype=dtype)  # (B, Hq, Q, Da)
        grad_kt = np.zeros(k_term.shape, dtype=dtype)  # (B, Hq, K, Da)
        grad_v = np.zeros(self.v.shape, dtype=dtype)  # (Hq, Da)
        grad_b = np.zeros(self.b.shape, dtype=dtype)  # (Hq, Da)
        for qs, ks in self.block_plan(B, H, Q, K):  # fixed order: deterministic sums
            pair = self._pair(q_term, k_term, qs, ks)  # t, (B, Hq, Qb, Kb, Da)
            g = grad_u[:, :, qs, ks, None]  # (B, Hq, Qb, Kb, 1)
            grad_v += np.einsum("bhqka->ha", g * pair)
            pre_grad = g * (1.0 - pair * pair)  # G_u (1 - t^2): d tanh
            pre_grad *= self.v[None, :, None, None, :]  # (B, Hq, Qb, Kb, Da)
            grad_qt[:, :, qs] += pre_grad.sum(axis=3)
            grad_kt[:, :, ks] += pre_grad.sum(axis=2)
            grad_b += pre_grad.sum(axis=(0, 2, 3))
        grad_q = np.einsum("bhqa,had->bhqd", grad_qt, self.Wq)  # (B, Hq, Q, Dq)
        grad_k = np.einsum("bhka,had->bhkd", grad_kt, self.Wk)  # (B, Hq, K, Dk)
        grad_wq = np.einsum("bhqa,bhqd->had", grad_qt, q)
        grad_wk = np.einsum("bhka,bhkd->had", grad_kt, k)
        return ScoreGradients(grad_q, grad_k,
                              {"Wq": grad_wq, "Wk": grad_wk, "b": grad_b, "v": grad_v})

    def manifest(self) -> dict[str, Any]:
        H, Da, Dq = self.Wq.shape
        Dk = self.Wk.shape[2]
        return {
            "family": self.name,
            "activation": "tanh",
            "Da": int(Da),
            "parameters": {n: tensor_record(a) for n, a in self.parameters().items()},
            "parameter_count": int(H * Da * (Dq + Dk) + 2 * H * Da),
            "pair_tensor": "key_blocks",
            "max_workspace_elements": int(self.max_workspace_elements),
        }


@dataclass(frozen=True, eq=False)
class Cosine(ScoreFamily):
    """Cosine compatibility ``u_ij = q_i k_j / (max(|q_i|, eps) max(|k_j|, eps))``.

    The zero-norm policy is explicit: a norm below ``eps`` is replaced by ``eps`` (so a zero
    vector scores 0 against everything). ``u`` lies in [-1, 1]; the call must supply the
    multiplier (``scale``) explicitly.

    Parameters
    ----------
    eps : float
        Positive floor of every row norm (default 1e-6, the contract's oracle).

    Examples
    --------
    >>> q = np.array([[[[3.0, 4.0]]]]); k = np.array([[[[6.0, 8.0], [0.0, 0.0]]]])
    >>> Cosine().compatibility(q, k).ravel().tolist()
    [1.0, 0.0]
    """

    eps: float = 1e-6
    name: ClassVar[str] = "cosine"
    linear_in_operands: ClassVar[bool] = False
    requires_equal_width: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float, np.floating)):
            raise RefAttnError(f"eps: expected a positive real number, got {self.eps!r}")
        try:  # an int beyond float64's range is refused by name, never an OverflowError
            eps = bounded_float("eps", self.eps, lo=0.0, lo_open=True)
        except RefAttnError:
            shown = int_text(self.eps) if isinstance(self.eps, int) else repr(float(self.eps))
            raise RefAttnError(f"eps: expected a positive finite zero-norm floor, got "
                               f"{shown}") from None
        object.__setattr__(self, "eps", eps)

    def _normalise(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))  # (..., 1); complex-safe
        clamped = norm.real < self.eps  # the policy decision reads the real part only
        n = np.where(clamped, self.eps, norm)
        return x / n, n, clamped

    def compatibility(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        q_hat, _, _ = self._normalise(q)  # (B, Hq, Q, D)
        k_hat, _, _ = self._normalise(k)  # (B, Hq, K, D)
        return q_hat @ k_hat.swapaxes(-1, -2)

    def _unit_backward(
        self, g_hat: np.ndarray, x_hat: np.ndarray, n: np.ndarray, clamped: np.ndarray
    ) -> np.ndarray:
        # unclamped: (I - x_hat x_hat^T) / n; clamped: x / eps is linear, Jacobian I / eps
        radial = (g_hat * x_hat).sum(axis=-1, keepdims=True)
        return np.where(clamped, g_hat, g_hat - x_hat * radial) / n

    def compatibility_backward(
        self, grad_u: np.ndarray, q: np.ndarray, k: np.ndarray
    ) -> ScoreGradients:
        q_hat, nq, cq = self._normalise(q)
        k_hat, nk, ck = self._normalise(k)
        g_qhat = grad_u @ k_hat  # (B, Hq, Q, D)
        g_khat = grad_u.swapaxes(-1, -2) @ q_hat  # (B, Hq, K, D)
        return ScoreGradients(self._unit_backward(g_qhat, q_hat, nq, cq),
                              self._unit_backward(g_khat, k_hat, nk, ck), {})

    def manifest(self) -> dict[str, Any]:
        return {"family": self.name, "parameters": {}, "eps": float_record(self.eps),
                "zero_norm_policy": "clamp_norm_min_eps"}
