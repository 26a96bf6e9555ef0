"""Check an FP8 attention kernel on the CPU with refattn (issue 28, quantised attention).

The kernel under test is FlashAttention-3's FP8 forward written with torch's float8 dtypes
(the arithmetic of ``hopper/softmax.h``, see docs/quant-sources.md); refattn judges it against
the emulated pipeline of the ``fa3_fp8`` preset: every cast bit-exact, every fp32 sum bounded
over all summation orders, so the kernel's output must lie inside the interval, with no tuned
tolerance. The report also gives its distance from the real (unquantised) result.

    python examples/fp8_torch_kernel.py     # one random call: the report, then a planted bug
    pytest examples/fp8_torch_kernel.py     # the same, and the quantised golden cases of the
                                            # refattn plugin (Supports(quantized=...))

torch's casts to float8 round to nearest even. ``cvt.rn.satfinite``, the kernel's cast,
saturates: a finite overflow or +-inf becomes +-448. torch 2.13 saturates e4m3fn too, but
earlier versions (and ml_dtypes) turn every ``|x| > 464`` into NaN, so the kernel below clamps
to +-448 before each cast, which is exact on every version. A float64 tensor is rounded to
float32 first by ``.to(float8)``: cast from float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import refattn
from refattn.masks import causal
from refattn.quant import preset
from refattn.testing import Supports, cases

E4M3_MAX = 448.0


def to_e4m3(x: Any) -> Any:
    """float32 torch tensor -> float8_e4m3fn, saturating like ``cvt.rn.satfinite``."""
    import torch

    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fa3_fp8_kernel(q8: Any, k8: Any, v8: Any, q_descale: Any, k_descale: Any, v_descale: Any,
                   *, scale: float, is_causal: bool = False, bug: str | None = None
                   ) -> tuple[Any, Any]:
    """FA3's FP8 forward in torch float32 arithmetic: the function under test.

    Parameters
    ----------
    q8 : (B, Hq, Q, Dk) float8_e4m3fn; k8 : (B, Hkv, K, Dk); v8 : (B, Hkv, K, Dv)
    q_descale, k_descale, v_descale : (B, Hkv) float32
    scale : float
        The softmax scale.
    is_causal : bool
        The lower-right causal triangle (key j visible from query i when j <= i + K - Q).
    bug : {None, "no_v_descale"}
        Plant a bug: the v descale left out of the normalisation.

    Returns
    -------
    out : (B, Hq, Q, Dv) bfloat16
    lse : (B, Hq, Q) float32
    """
    import torch

    g = q8.shape[1] // k8.shape[1]  # query heads per kv head

    def per_query_head(d: Any) -> Any:  # (B, Hkv) -> (B, Hq, 1, 1)
        return d.to(torch.float32).repeat_interleave(g, dim=1)[..., None, None]

    k = k8.to(torch.float32).repeat_interleave(g, dim=1)
    v = v8.to(torch.float32).repeat_interleave(g, dim=1)
    # the descales fold into the exponent's factor: c = fl(scale log2 e) fl(qd kd)
    c = torch.tensor(scale * math.log2(math.e), dtype=torch.float32) * (
        per_query_head(q_descale) * per_query_head(k_descale))
    s = q8.to(torch.float32) @ k.transpose(-1, -2)  # (B, Hq, Q, K), raw S on the codes
    if is_causal:
        Q, K = s.shape[-2:]
        visible = torch.ones(Q, K, dtype=torch.bool).tril(diagonal=K - Q)
        s = s.masked_fill(~visible, -math.inf)
    m = s.amax(dim=-1, keepdim=True)  # the row max of the raw S
    p = torch.exp2(s * c - (m * c - 8.0))  # FA3's offset: p in [0, 256]
    row_sum = p.sum(dim=-1)  # l from the float32 p, before P's cast
    acc = to_e4m3(p).to(torch.float32) @ v  # P cast to e4m3 (satfinite), PV in float32
    vd = per_query_head(v_descale)[..., 0] if bug != "no_v_descale" else 1.0
    out = acc * ((1.0 / row_sum) * vd)[..., None]
    lse = m[..., 0] * c[..., 0] * math.log(2.0) + torch.log(row_sum / 256.0)
    return out.to(torch.bfloat16), lse


def _numpy(x: Any) -> np.ndarray:
    import torch

    return x.to(torch.float64).numpy()


def run_kernel(call: refattn.AttentionCall, spec: Any, *, is_causal: bool,
               bug: str | None = None) -> dict[str, np.ndarray]:
    """Feed the kernel the call as it receives it (codes and descales), float64 results."""
    import torch

    B, Hkv = call.k.shape[:2]

    def descale(tq: Any) -> Any:
        return torch.from_numpy(np.broadcast_to(tq.scale, (B, Hkv)).astype(np.float32))

    q8, k8, v8 = (to_e4m3(torch.from_numpy(x.astype(np.float32)))
                  for x in (call.q, call.k, call.v))  # exact: the values are codes
    out, lse = fa3_fp8_kernel(q8, k8, v8, descale(spec.q), descale(spec.k), descale(spec.v),
                              scale=call.scale, is_causal=is_causal, bug=bug)
    return {"output": _numpy(out), "lse": _numpy(lse)}


def random_call(seed: int = 0) -> tuple[refattn.AttentionCall, Any]:
    """A causal GQA call as an FP8 kernel receives it: e4m3 codes, (B, Hkv) descales."""
    import torch

    B, Hq, Hkv, Q, K, D = 2, 4, 2, 5, 7, 16
    gen = torch.Generator().manual_seed(seed)
    codes = [_numpy(to_e4m3(torch.randn(B, h, n, D, generator=gen)))
             for h, n in ((Hq, Q), (Hkv, K), (Hkv, K))]
    descales = [np.asarray(np.exp2(torch.randint(-1, 2, (B, Hkv), generator=gen).numpy()),
                           dtype=np.float64) for _ in range(3)]
    spec = preset("fa3_fp8", q_descale=descales[0], k_descale=descales[1],
                  v_descale=descales[2])
    call = refattn.AttentionCall(*codes, scale=D ** -0.5,
                                 visible=causal(Q, K, alignment="lower_right"))
    return call, spec


def check(call: refattn.AttentionCall, spec: Any, candidate: dict[str, np.ndarray]
          ) -> tuple[Any, list[str]]:
    """refattn's verdict: the emulated pipeline, the candidate against it, and (when it
    fails) the planted bugs whose emulation contains it."""
    from refattn.quant.check import check_candidate
    from refattn.quant.diagnosis import diagnose
    from refattn.quant.pipeline import quantized

    result = quantized(call, spec)
    report = check_candidate(result, candidate)
    return report, ([] if report.passed else diagnose(result, candidate))


def test_fa3_fp8_kernel_on_a_random_call():
    pytest.importorskip("torch")
    call, spec = random_call()
    report, _ = check(call, spec, run_kernel(call, spec, is_causal=True))
    assert report.passed, report


def test_a_missing_v_descale_is_caught_and_named():
    pytest.importorskip("torch")
    call, spec = random_call()
    report, diagnosis = check(call, spec, run_kernel(call, spec, is_causal=True,
                                                     bug="no_v_descale"))
    assert not report.passed
    assert [line.split(":")[0] for line in diagnosis] == ["missing_v_descale"], diagnosis


@cases(Supports(quantized=("fa3_fp8",), masks="causal", causal_alignment="lower_right"))
def test_fa3_fp8_kernel_on_golden_cases(case):
    pytest.importorskip("torch")
    quant = case.quant  # the spec with its descales, and the call as the kernel receives it
    report, diagnosis = check(quant.call, quant.spec,
                              run_kernel(quant.call, quant.spec,
                                         is_causal=not case.visible.all()))
    assert report.passed, (report, diagnosis)


if __name__ == "__main__":
    call, spec = random_call()
    print(check(call, spec, run_kernel(call, spec, is_causal=True))[0])
    print("\nwith the v descale left out:")
    report, diagnosis = check(call, spec, run_kernel(call, spec, is_causal=True,
                                                     bug="no_v_descale"))
    print(report, *diagnosis, sep="\n")
