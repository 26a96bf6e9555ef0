"""The pytest plugin is a trust boundary (issue 40, item 1): it compares a kernel only against a
bundle ``refattn verify`` passes.

The attacks of the issue: a bundle whose golden ``output`` was multiplied by 1.5 and one whose
``output`` is all NaN, every checksum recomputed, made a 1.5x-wrong (or all-NaN) kernel pass
and the correct one fail; a bundle with no case made the plugin skip everything and exit 0.
Now each fails the session, naming verify's reason; an honest bundle's pass is recorded in the
user's cache under the digest of its bytes (never anything the bundle says), so a second
session does not verify again, and a changed byte needs a new verify run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from refattn.bundle.suites import build_suite
from refattn.bundle.verification import record as record_module
from refattn.bundle.verification.record import bundle_digest, record_path, trusted
from refattn.bundle.verification.verifier import verify
from refattn.bundle.writing.write import write_bundle
from refattn.errors import RefAttnError
from tests.bundle.resealing import reseal_case

pytest_plugins = ["pytester"]

CASE = "loop7_cross_attention_padded_source"

#: a kernel that returns the golden output times ``factor`` (1.0: the correct kernel)
KERNEL_TEST = """
import numpy as np
from refattn.testing import Supports, assert_matches, cases

@cases(Supports(dtypes=("float64",), dropout=("multiplier",)), suite="contract")
def test_kernel(case):
    out = {factor!r} * case.plain.q[..., :1] * 0 + np.asarray(case.expected["output"])
    assert_matches(case, {{"output": out}})
"""


def _bundle(root: Path) -> Path:
    out = root / "b"
    write_bundle(out, build_suite("contract")[:2], suite="contract", progress=False)
    return out


def _tamper(bundle: Path, change) -> None:
    """Change the golden tensors of CASE and re-seal every sha256 (an attacker with an editor
    and sha256sum)."""
    reseal_case(bundle, CASE, change)


@pytest.mark.parametrize(("change", "factor"), [
    (lambda t: t["output"].__imul__(1.5), 1.5),
    (lambda t: t["output"].fill(np.nan), float("nan")),
], ids=["output_x1.5", "output_nan"])
def test_a_tampered_bundle_fails_the_session_whatever_the_kernel(pytester, tmp_path, change,
                                                                 factor):
    bundle = _bundle(tmp_path)
    _tamper(bundle, change)
    assert not verify(bundle, gradcheck=False).passed  # verify's verdict, for reference
    for kernel in (factor, 1.0):  # the kernel the tampered golden favours, and the correct one
        pytester.makepyfile(KERNEL_TEST.format(factor=kernel))
        result = pytester.runpytest(f"--refattn-bundle={bundle}")
        text = "\n".join(result.errlines + result.outlines)
        assert result.ret != pytest.ExitCode.OK, text  # collection stops with the reason
        assert "refattn verify fails this bundle" in text and CASE in text
        assert "passed" not in result.outlines[-1]


def test_a_bundle_with_no_case_fails_verify_and_the_session(pytester, tmp_path):
    bundle = _bundle(tmp_path)
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    for entry in m["cases"].values():
        (bundle / entry["file"]).unlink()
    m["cases"] = {}
    path.write_text(json.dumps(m))
    report = verify(bundle, gradcheck=False)
    assert not report.passed
    assert "the bundle holds no case" in report.format()
    pytester.makepyfile(KERNEL_TEST.format(factor=1.0))
    result = pytester.runpytest(f"--refattn-bundle={bundle}")
    assert result.ret != pytest.ExitCode.OK
    assert "holds no case" in "\n".join(result.errlines + result.outlines)


def test_an_honest_bundle_is_verified_once_then_recognised_by_its_bytes(tmp_path, monkeypatch):
    bundle = _bundle(tmp_path)
    digest = trusted(bundle, gradcheck=False)  # verified now, and recorded
    assert digest == bundle_digest(bundle) and record_path(digest).is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("verify ran again for bytes it had passed")

    monkeypatch.setattr(record_module, "verify", refuse)
    assert trusted(bundle) == digest  # the record answers
    _tamper(bundle, lambda t: t["output"].__imul__(1.5))  # one changed byte: a new digest
    assert bundle_digest(bundle) != digest
    with pytest.raises(AssertionError, match="verify ran again"):
        trusted(bundle)


def test_nothing_in_a_bundle_can_stand_in_for_a_record(tmp_path):
    """A record-shaped file inside the bundle, or one naming the digest of the honest bytes,
    certifies nothing about tampered bytes."""
    bundle = _bundle(tmp_path)
    honest = trusted(bundle, gradcheck=False)
    _tamper(bundle, lambda t: t["output"].__imul__(1.5))
    forged = {"digest": bundle_digest(bundle), "refattn": "0.1.0", "recomputed": True}
    (bundle / "verified.json").write_text(json.dumps(forged))
    record_path(honest).write_text(json.dumps({**forged, "digest": honest}))
    with pytest.raises(RefAttnError, match="refattn verify fails this bundle"):
        trusted(bundle, gradcheck=False)


def test_refattn_verify_records_a_pass_the_plugin_then_accepts(tmp_path, capsys):
    from refattn.cli import main

    bundle = _bundle(tmp_path)
    assert main(["verify", str(bundle), "--no-gradcheck", "--quiet"]) == 0
    assert record_path(bundle_digest(bundle)).is_file()
    capsys.readouterr()
    assert main(["verify", str(bundle), "--no-recompute", "--quiet"]) == 0  # no recompute:
    assert json.loads(record_path(bundle_digest(bundle)).read_text())["recomputed"] is True


def test_nan_in_one_cases_cotangent_fails_that_case_only(tmp_path):
    bundle = tmp_path / "b"
    write_bundle(bundle, build_suite("contract"), suite="contract", progress=False)
    _tamper(bundle, lambda t: t["grad_output"].__setitem__((0, 0, 0, 0), np.nan))
    report = verify(bundle)  # the gradient check too: it used to abort the whole run
    failed = [c.case_id for c in report.cases if not c.passed]
    assert failed == [CASE] and len(report.cases) == 5
    (problem,) = report.all_problems
    assert problem.reason.startswith("grad_output: non-finite value nan at index (0, 0, 0, 0)")
