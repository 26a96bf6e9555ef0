"""The pytest plugin ``refattn`` (entry point ``pytest11``): golden cases as test parameters.

Owns the collection hooks: the ``refattn_cases`` marker (what :func:`cases` returns) and the
``refattn_case`` argument parametrise a test with every case of the installed conformance
suite, or of a bundle directory (``bundle=``, ``--refattn-bundle DIR`` or the ini option
``refattn_bundle``), once per dtype the :class:`~refattn.testing.Supports` declares; test ids
are the case names (``causal_square``, or ``causal_square-float32`` when several dtypes run).
A case outside the declaration is collected as skipped, with the reason. A bundle's cases are
read with verify's checks (:func:`refattn.bundle.verification.checked.checked_cases`: confined
reads, header and hashes first, the call rebuilt through the gate, finite inputs); a case that fails
them is collected as a test that FAILS with the reason, never skipped.

Importing this module (pytest does it in every session once refattn is installed) imports
pytest and the standard library only; the cases are read and the engine imported only when a
test asks for them. Defers eligibility to :mod:`refattn.testing.supports` and the cases to
:mod:`refattn.testing.case`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ARGNAME", "MARKER", "cases"]

#: the marker :func:`cases` applies
MARKER = "refattn_cases"
#: the argument a test may name to receive the cases without the marker (default Supports)
ARGNAME = "refattn_case"
#: the mark of a bundle case that failed verify's checks (its test fails with the reason)
_BROKEN = "refattn_rejected_case"


def cases(supports: Any = None, *, suite: str = "conformance", bundle: Any = None,
          argname: str = "case") -> pytest.MarkDecorator:
    """Parametrise a test with the golden cases its function supports.

    Parameters
    ----------
    supports : Supports, optional
        What the function computes (default :class:`~refattn.testing.Supports`: dot scores,
        no dropout, GQA, bias, any mask, float64). Each eligible case runs once per dtype in
        ``supports.dtypes``; the others are reported as skipped with the reason.
    suite : {"conformance", "contract"}
        The installed suite, when no bundle is named.
    bundle : path, optional
        A bundle directory to read the cases from (the command line's ``--refattn-bundle``
        applies when this is not given).
    argname : str
        The test's argument that receives a :class:`~refattn.testing.Case`.

    Returns
    -------
    pytest.MarkDecorator

    Examples
    --------
    >>> from refattn.testing import Supports
    >>> mark = cases(Supports(dtypes=("float32",)))
    >>> mark.name, mark.kwargs["argname"]
    ('refattn_cases', 'case')
    """
    return getattr(pytest.mark, MARKER)(supports=supports, suite=suite, bundle=bundle,
                                        argname=argname)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refattn", "refattn golden cases")
    group.addoption("--refattn-bundle", metavar="DIR", default=None,
                    help="read the cases of refattn.testing.cases tests from this bundle "
                    "directory (default: the installed conformance suite)")
    parser.addini("refattn_bundle", "bundle directory for refattn.testing.cases tests "
                  "(relative to the rootdir)", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(supports=None, *, suite='conformance', bundle=None, "
        "argname='case'): run the test once per refattn golden case and dtype "
        "(refattn.testing.cases)")
    config.addinivalue_line(
        "markers", f"{_BROKEN}(reason): a bundle case that failed verify's checks; its test "
        "fails with the reason")


def _bundle_option(config: pytest.Config) -> Path | None:
    option = config.getoption("--refattn-bundle", default=None)
    if option:
        return Path(option)
    ini = config.getini("refattn_bundle")
    return Path(config.rootpath, ini) if ini else None


def _params(config: pytest.Config, supports: Any, suite: str, bundle: Any) -> list[Any]:
    from refattn.errors import RefAttnError
    from refattn.testing.case import Case, load_cases
    from refattn.testing.supports import Supports, ineligibility

    supports = Supports() if supports is None else supports
    if not isinstance(supports, Supports):
        raise pytest.UsageError(f"refattn.testing.cases: supports must be a "
                                f"refattn.testing.Supports, got {type(supports).__name__}")
    source = bundle if bundle is not None else _bundle_option(config)
    several = len(supports.dtypes) > 1
    params: list[Any] = []
    specs: Sequence[Any]
    try:
        if source is None:
            specs = load_cases(None, suite=suite)
        else:  # verify's checks; a case that fails them FAILS, never skips
            specs, params = _bundle_cases(Path(source), supports, several)
    except RefAttnError as exc:
        raise pytest.UsageError(f"refattn.testing.cases: {exc}") from None
    for spec in specs:
        for dtype in supports.dtypes:
            reason = ineligibility(spec, supports, dtype)
            marks = () if reason is None else (
                pytest.mark.skip(reason=f"{spec.case_id}: {reason}"),)
            ident = f"{spec.case_id}-{dtype}" if several else spec.case_id
            params.append(pytest.param(Case(spec, dtype), id=ident, marks=marks))
    return params


def _bundle_cases(directory: Path, supports: Any, several: bool) -> tuple[list[Any], list[Any]]:
    """The specs of a bundle's cases that pass verify's reading checks, and one failing
    parameter per case that does not (:func:`refattn.bundle.verification.checked.checked_cases`)."""
    from refattn.bundle.verification.checked import checked_cases
    from refattn.errors import RefAttnError

    if not directory.is_dir():
        raise RefAttnError(f"{directory}: not a bundle directory (expected manifest.json and "
                           "cases/ written by refattn golden)")
    specs, failing = [], []
    for checked in checked_cases(directory):
        if checked.spec is not None:
            specs.append(checked.spec)
            continue
        for dtype in supports.dtypes:
            ident = f"{checked.case_id}-{dtype}" if several else checked.case_id
            failing.append(pytest.param(None, id=ident, marks=getattr(pytest.mark, _BROKEN)(
                reason=f"{checked.case_id}: {checked.failure}")))
    return specs, failing


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """A bundle case that failed verify's checks fails its test (never a skip)."""
    marker = item.get_closest_marker(_BROKEN)
    if marker is not None:
        pytest.fail(f"refattn bundle case rejected: {marker.kwargs['reason']}", pytrace=False)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        if ARGNAME in metafunc.fixturenames:  # the plain argument: default declaration
            metafunc.parametrize(ARGNAME, _params(metafunc.config, None, "conformance", None))
        return
    if marker.args:
        raise pytest.UsageError(f"@{MARKER}: pass supports= by keyword (use "
                                "refattn.testing.cases(...))")
    kw = marker.kwargs
    argname = kw.get("argname", "case")
    if argname not in metafunc.fixturenames:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: refattn.testing.cases gives "
                                f"the cases as argument {argname!r}, which the test does not "
                                "take")
    metafunc.parametrize(argname, _params(metafunc.config, kw.get("supports"),
                                          kw.get("suite", "conformance"), kw.get("bundle")))
