"""Planted backward bugs under torch.autograd.gradcheck (defaults and fast mode) and under ours.

Each mutation from :mod:`gradcheck.mutations` is wrapped as the backward of a
``torch.autograd.Function`` whose forward is refattn's NumPy reference, and checked three ways,
side by side in one run:

- ``torch.autograd.gradcheck`` with its defaults (slow mode: eps=1e-6, atol=1e-5, rtol=1e-3,
  every Jacobian entry compared with ``|a - n| <= atol + rtol |n|``) on a small GQA call;
  the "torch margin" column is that criterion's worst ``|a - n| / (atol + rtol |n|)``,
  recomputed here from the exact (complex-step) numeric Jacobian and the analytic Jacobian
  (one vjp per output element); below 1 means torch passes;
- ``torch.autograd.gradcheck(fast_mode=True)`` on a moderate call, whose atol is multiplied by
  ``sum(u) * sum(v)`` for its non-negative random vectors (the figure is printed);
- ``gradcheck.check_attention`` (ours): full mode on the small call, directional mode on the
  moderate one; the figures are the worst error/tolerance and where it is.

torch is optional: without it the script prints our results only.

Run: ``python3 benchmarks/gradcheck_vs_torch.py``
"""

from __future__ import annotations

import sys
import time

import numpy as np

from gradcheck import check_attention
from gradcheck import mutations as mut
from gradcheck.attention import attention_problem
from refattn import AttentionCall
from refattn.engine.reduce import reduce_to_shape

ATOL, RTOL = 1e-5, 1e-3  # torch.autograd.gradcheck defaults


def make_call(B, Hq, Hkv, Q, K, Dk, Dv, *, seed, spread=1.0, ignored_key=False):
    rng = np.random.default_rng(seed)
    q = spread * rng.standard_normal((B, Hq, Q, Dk))
    k = spread * rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    bias = rng.standard_normal((1, Hq, 1, K))
    if ignored_key:
        bias[..., -1] -= 9.0  # a legal key that attention nearly ignores (probability ~1e-4)
    return AttentionCall(q, k, v, bias=bias)


def jacobians(call, backward):
    """Exact numeric Jacobian (complex step) and analytic Jacobian (vjp per output element)."""
    problem = attention_problem(call, backward=backward)
    out = problem.fn(**problem.inputs)
    numeric, analytic = {}, {}
    for name, x in problem.inputs.items():
        cols = np.empty((out.size, x.size))
        for i in range(x.size):
            xc = x.astype(np.complex128)
            xc.flat[i] += 1e-20j
            cols[:, i] = problem.fn(**{**problem.inputs, name: xc}).imag.ravel() / 1e-20
        numeric[name] = cols
        analytic[name] = np.empty_like(cols)
    for j in range(out.size):
        e = np.zeros(out.shape)
        e.flat[j] = 1.0
        grads = problem.vjp(e, **problem.inputs)
        for name, x in problem.inputs.items():
            g = grads[name]
            if g.shape != x.shape:  # torch sums an expandable gradient to the input's shape
                g = reduce_to_shape(g, x.shape)
            analytic[name][j] = g.ravel()
    return numeric, analytic


def torch_margin(numeric, analytic):
    """torch's slow-mode criterion: worst |a - n| / (atol + rtol |n|) over all entries."""
    return max(float(np.max(np.abs(analytic[n] - numeric[n]) / (ATOL + RTOL * np.abs(numeric[n]))))
               for n in numeric)


def small_gradient_key(call):
    """The key element whose largest Jacobian entry is smallest (but not zero)."""
    numeric, _ = jacobians(call, None)
    col_max = np.abs(numeric["k"]).max(axis=0)
    i = int(np.argmin(np.where(col_max > 0, col_max, np.inf)))
    return tuple(int(a) for a in np.unravel_index(i, call.k.shape)), float(col_max[i])


def torch_function(call, backward):
    import torch

    problem = attention_problem(call, backward=backward)
    names = list(problem.inputs)

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            arrays = {n: t.detach().numpy() for n, t in zip(names, tensors, strict=True)}
            ctx.arrays = arrays
            return torch.from_numpy(problem.fn(**arrays))

        @staticmethod
        def backward(ctx, grad):
            grads = problem.vjp(np.array(grad.detach().numpy(), dtype=np.float64),
                                **ctx.arrays)
            return tuple(torch.from_numpy(np.array(grads[n], dtype=np.float64)) for n in names)

    tensors = tuple(torch.tensor(np.array(problem.inputs[n]), requires_grad=True)
                    for n in names)
    return Attention.apply, tensors


def torch_verdict(call, backward, *, fast):
    import torch

    fn, tensors = torch_function(call, backward)
    torch.manual_seed(0)
    try:
        return bool(torch.autograd.gradcheck(fn, tensors, fast_mode=fast, raise_exception=False))
    except Exception as exc:  # a backward torch itself rejects (shape it cannot reduce, ...)
        return f"error: {type(exc).__name__}"


def fast_mode_atol(call):
    """The fast-mode atol for this call's sizes: atol * sum(u) * sum(v), u, v as torch draws."""
    import torch

    torch.manual_seed(0)
    n_in = call.q.size + call.k.size + call.v.size + call.bias.size
    n_out = call.q.shape[0] * call.q.shape[1] * call.q.shape[2] * call.v.shape[3]
    u, v = torch.rand(n_in, dtype=torch.float64), torch.rand(n_out, dtype=torch.float64)
    return ATOL * float((u / u.norm()).sum()) * float((v / v.norm()).sum())


def ours(call, backward, mode):
    r = check_attention(call, backward=backward, mode=mode)
    bad = [x for x in r.inputs.values() if not x.passed] or list(r.inputs.values())
    worst = max(bad, key=lambda x: x.worst.ratio if x.worst else np.inf)
    where = f"{worst.name} at {worst.worst.where}" if worst.worst else worst.name
    fit = worst.scale_fit.scale if worst.scale_fit else float("nan")
    extra = " (unreduced shape)" if worst.problem and "broadcast axes" in worst.problem else ""
    ratio = worst.worst.ratio if worst.worst else float("nan")
    return r.passed, f"{ratio:.3g}", where + extra, fit


def main() -> int:
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
        print("torch is not installed: printing gradcheck's results only\n")

    small = make_call(2, 6, 3, 3, 5, 3, 2, seed=0, ignored_key=True)  # GQA 6 -> 3
    moderate = make_call(2, 4, 2, 64, 64, 32, 32, seed=1)
    key, key_scale = small_gradient_key(small)
    mutations = [
        ("none (correct backward)", None),
        ("G_S x 1.001 (0.1% error)", mut.grad_scores_scaled(1.001)),
        ("alpha missing in G_Q, G_K", mut.missing_scale()),
        ("G_Q x 1.1 (10% error)", mut.grad_q_scaled(1.1)),
        ("GQA: head 5 summed into kv 0", mut.gqa_wrong_head(query_head=5, kv_head=0)),
        (f"grad_k{list(key)} x 1.1", mut.one_element("k", key, 1.1)),
        ("grad_bias not reduced", mut.bias_unreduced()),
        ("grad_bias first slice, not sum", mut.bias_unreduced(keep_shape=True)),
    ]
    fast_moderate = [("none (correct backward)", None),
                     ("G_S x 1.001 (0.1% error)", mut.grad_scores_scaled(1.001)),
                     ("G_Q x 1.1 (10% error)", mut.grad_q_scaled(1.1)),
                     ("alpha missing in G_Q, G_K", mut.missing_scale()),
                     ("GQA: query head 3 summed into kv 0", mut.gqa_wrong_head(query_head=3,
                                                                            kv_head=0)),
                     ("grad_k[0,1,10,5] x 1.1", mut.one_element("k", (0, 1, 10, 5), 1.1))]
    ax = small.axes
    print(f"small call (full checks): {ax}, bias (1,Hq,1,K) with a nearly ignored last key; "
          f"the one-element bug sits on key element {key}, whose largest Jacobian entry is "
          f"{key_scale:.2e}")
    t0 = time.perf_counter()
    header = (f"{'planted bug':<32} {'torch default':>13} {'torch margin':>12}  "
              f"{'ours (full)':>11} {'err/tol':>9}  worst at / best-fit scale")
    print(header)
    print("-" * len(header))
    for label, m in mutations:
        backward = None if m is None else m.backward
        passed, ratio, where, fit = ours(small, backward, "full")
        if have_torch:
            numeric, analytic = jacobians(small, backward)
            margin = f"{torch_margin(numeric, analytic):.3g}"
            verdict = torch_verdict(small, backward, fast=False)
            tv = {True: "pass", False: "FAIL"}.get(verdict, verdict)
        else:
            margin, tv = "-", "-"
        print(f"{label:<32} {tv:>13} {margin:>12}  {'pass' if passed else 'FAIL':>11} "
              f"{ratio:>9}  {where}; scale {fit:.6g}")
    mx = moderate.axes
    print(f"\nmoderate call (fast/directional checks): {mx}")
    if have_torch:
        atol = fast_mode_atol(moderate)
        print(f"torch fast mode atol here: {ATOL} x sum(u) x sum(v) = {atol:.3g} "
              "(u, v non-negative, unit norm)")
    header = (f"{'planted bug':<36} {'torch fast':>10}  {'ours (directional)':>18} "
              f"{'err/tol':>9}  worst at")
    print(header)
    print("-" * len(header))
    for label, m in fast_moderate:
        backward = None if m is None else m.backward
        passed, ratio, where, _ = ours(moderate, backward, "directional")
        if have_torch:
            verdict = torch_verdict(moderate, backward, fast=True)
            tv = {True: "pass", False: "FAIL"}.get(verdict, verdict)
        else:
            tv = "-"
        print(f"{label:<36} {tv:>10}  {'pass' if passed else 'FAIL':>18} {ratio:>9}  {where}")
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
