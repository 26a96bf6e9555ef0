"""``refattn gradcheck``: runs the checker on refattn's own backward and prints the reports."""

from __future__ import annotations

import pytest

from refattn.cli import main


def test_gradcheck_command_passes_and_prints_both_reports(capsys):
    rc = main(["gradcheck", "--shape", "1,2,1,3,5,4,3", "--causal", "lower_right",
               "--dropout", "0.25", "--seed", "7", "--bias", "broadcast"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "B=1, Hq=2, Hkv=1, Q=3, K=5, Dk=4, Dv=3" in out
    assert "causal lower_right" in out and "dropout p=0.25 seed=7" in out
    assert "gradcheck PASSED; mode full" in out
    assert "attention identities PASSED" in out
    for name in ("q", "k", "v", "bias"):
        assert f"\n{name} " in out


def test_gradcheck_command_directional_with_empty_causal_rows(capsys):
    # lower-right with Q > K leaves the first rows without keys: they become unused rows
    rc = main(["gradcheck", "--shape", "2,4,2,6,3,4,3", "--causal", "lower_right",
               "--mode", "directional", "--directions", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mode directional" in out and "unused rows" in out


@pytest.mark.parametrize("shape", ["1,2,3", "1,2,1,3,0,4,3", "a,b,c,d,e,f,g"])
def test_gradcheck_command_rejects_bad_shapes(shape, capsys):
    assert main(["gradcheck", "--shape", shape]) == 2
    err = capsys.readouterr().err
    assert "B,Hq,Hkv,Q,K,Dk,Dv" in err and len(err.strip().splitlines()) == 1
