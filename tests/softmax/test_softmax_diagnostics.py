"""Row diagnostics (contract, "Better diagnostics") and the ``refattn diagnostics`` command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats

import refattn
from refattn.bundle import GoldenCase, write_bundle
from refattn.cli import main
from refattn.dropout import Philox
from refattn.errors import RefAttnError
from refattn.softmax import diagnostics, softmax


def _scores_and_support(seed: int = 0):
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((2, 3, 4, 6)) * 2.0
    vis = rng.random((2, 3, 4, 6)) < 0.6
    vis[..., 0] = True
    vis[0, 0, 0] = [True, False, False, False, False, False]  # a singleton row
    return s, vis


def test_diagnostics_match_independent_formulas():
    s, vis = _scores_and_support()
    p = softmax(s, vis)
    d = diagnostics(p, vis, k=3)
    for idx in np.ndindex(*p.shape[:-1]):
        legal = vis[idx]
        pl, sl = p[idx][legal], s[idx][legal]
        n = legal.sum()
        H = scipy.stats.entropy(pl)  # second implementation of -sum p log p
        assert d.n_legal[idx] == n
        assert d.entropy[idx] == pytest.approx(H, abs=1e-14)
        assert d.effective_support[idx] == pytest.approx(math.exp(H), rel=1e-14)
        norm = 0.0 if n == 1 else H / math.log(n)
        assert d.normalized_entropy[idx] == pytest.approx(norm, abs=1e-14)
        assert d.top_k_mass[idx] == pytest.approx(np.sort(pl)[::-1][:3].sum(), abs=1e-15)
        assert d.max_probability[idx] == pl.max()
        # the logit gap from the scores themselves (probability ratios cancel the offset)
        gap = math.inf if n == 1 else float(np.diff(np.sort(sl))[-1])
        assert d.logit_gap[idx] == pytest.approx(gap, abs=1e-12)
    assert d.k == 3 and (d.n_underflow == 0).all()


def test_uniform_and_one_hot_endpoints():
    d = diagnostics(np.array([[0.25] * 4, [1.0, 0.0, 0.0, 0.0]]))
    assert d.entropy[0] == pytest.approx(math.log(4), abs=1e-15)
    assert d.normalized_entropy[0] == pytest.approx(1.0, abs=1e-15)
    assert d.effective_support[0] == pytest.approx(4.0, rel=1e-15)
    assert d.logit_gap[0] == 0.0
    # [1, 0, 0, 0] with every key legal: entropy 0, three legal keys underflowed/zero mass
    assert d.entropy[1] == 0.0 and d.effective_support[1] == 1.0
    assert d.logit_gap[1] == math.inf and d.n_underflow[1] == 3


@pytest.mark.parametrize(
    ("probs", "visible", "message"),
    [
        (np.array([0.5, 0.5]), np.array([True, False]), "puts 0.5 on excluded key 1"),
        (np.array([0.6, 0.6]), None, r"row \(\) \(the only row\) sums to 1.2"),
        (np.array([-0.1, 1.1]), None, "expected a finite probability >= 0"),
        (np.array([np.nan, 1.0]), None, "expected a finite probability >= 0"),
        (np.array([0.0, 0.0]), np.array([False, False]), "empty legal support"),
        (np.array([0.5, 0.5], dtype=np.float32), None, "expected dtype float64"),
    ],
)
def test_diagnostics_validate_probabilities(probs, visible, message):
    with pytest.raises(RefAttnError, match=message):
        diagnostics(probs, visible)


def test_diagnostics_reject_bad_k():
    with pytest.raises(RefAttnError, match="k: expected a positive integer"):
        diagnostics(np.array([1.0]), k=0)


def _bundle(tmp_path):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in [(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 2)])
    vis = np.ones((1, 1, 3, 5), bool)
    vis[0, 0, 2, 1:] = False  # query 2 reads one key only
    qv = np.array([True, False, True]).reshape(1, 1, 3, 1)  # query 1 is unused
    call = refattn.AttentionCall(q * 3.0, k, v, visible=vis, query_valid=qv,
                                 dropout=Philox(0.2, 5))
    case = GoldenCase("diag_case", call, rng.standard_normal((1, 2, 3, 2)), "diagnostics test")
    write_bundle(tmp_path, [case], suite="test")
    return tmp_path / "cases" / "diag_case.safetensors", call


def test_command_summarises_a_golden_case(tmp_path, capsys):
    path, call = _bundle(tmp_path)
    assert main(["diagnostics", str(path), "--json", "--k", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["case_id"] == "diag_case" and out["object"] == "pre_dropout_probabilities"
    assert (out["rows"], out["consumed"], out["unused"], out["sanitized"]) == (6, 4, 2, 0)
    # recompute the head-1 numbers directly from a fresh forward of the same call
    t = refattn.forward(call)
    d = diagnostics(t.probs, call.visible_full(), k=1)
    rows = [(0, 1, 0), (0, 1, 2)]
    head1 = out["heads"][1]
    assert head1["rows"] == 2
    assert head1["entropy"]["mean"] == pytest.approx(np.mean([d.entropy[r] for r in rows]))
    assert head1["top_k_mass"]["max"] == pytest.approx(max(d.top_k_mass[r] for r in rows))
    assert head1["n_legal"] == {"min": 1, "max": 5}
    assert head1["logit_gap"]["infinite_rows"] == 1  # the singleton row
    assert main(["diagnostics", str(tmp_path)]) == 0  # a bundle directory, text output
    text = capsys.readouterr().out
    assert "case diag_case" in text and "h=1" in text and "4 of 6 rows consumed" in text


def test_command_reports_errors_in_one_line(tmp_path, capsys):
    assert main(["diagnostics", str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refattn diagnostics: error:") and "cannot read" in err
