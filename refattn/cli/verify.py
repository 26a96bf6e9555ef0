"""``refattn verify DIR``: checksums, recomputation and gradient check of a golden bundle."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from refattn._checks import bounded_int, int_text
from refattn.bundle.verification.gradients import GradcheckMethod
from refattn.bundle.verification.recompute import REQUIREMENTS
from refattn.bundle.verification.record import bundle_digest, remember
from refattn.cli.sweep import add_cluster_arguments
from refattn.distributed.cluster import connect
from refattn.distributed.verification import verify
from refattn.engine.exact.backend import DEFAULT_MAX_SECONDS
from refattn.errors import RefAttnError

__all__ = ["GRADCHECK_METHODS", "add_parser", "integer_value", "seconds_value"]

#: the spellings of ``--gradcheck-method`` (those of ``refattn gradcheck --method``), and the
#: verifier's name for each
GRADCHECK_METHODS = ("auto", "complex_step", "central")
_VERIFIER_METHOD: dict[str, GradcheckMethod] = {"auto": "auto", "complex_step": "check_vjp",
                                               "central": "central_difference"}
_OLD_SPELLING = {"check_vjp": "complex_step", "central_difference": "central"}


def _gradcheck_method(text: str) -> str:
    """A ``--gradcheck-method`` value; an old spelling is accepted with a note on stderr."""
    if text in _OLD_SPELLING:
        new = _OLD_SPELLING[text]
        print(f"refattn verify: note: --gradcheck-method {text} is now spelled {new} "
              "(as in refattn gradcheck --method); the old spelling will be removed",
              file=sys.stderr)
        return new
    return text


def seconds_value(text: str) -> float:
    """A ``--exact-max-seconds`` or ``golden --max-seconds`` value: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got "
                                         f"{text!r}")
    return value


def integer_value(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer option in ``[lo, hi]``: the text read as an int
    and bounded by :func:`~refattn._checks.bounded_int`, or a one-line argparse error.

    Parameters
    ----------
    lo, hi : int
        The allowed range, both ends included.

    Returns
    -------
    callable
        ``str -> int``, raising :class:`argparse.ArgumentTypeError`.

    Examples
    --------
    >>> repeats = integer_value(1, 100)
    >>> repeats("5")
    5
    >>> try:
    ...     repeats("2147483648")
    ... except argparse.ArgumentTypeError as exc:
    ...     print(exc)
    2**31 is outside the allowed range [1, 100]
    """
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than Python converts
            shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
            raise argparse.ArgumentTypeError(f"expected an integer in [{int_text(lo)}, "
                                             f"{int_text(hi)}], got {shown}") from None
        try:
            return bounded_int("value", value, lo=lo, hi=hi)
        except RefAttnError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    return integer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check a golden bundle: sha256 of files and tensors, recomputation, "
        "gradient check (exit 1 on failure)",
        description="Check a golden bundle: the manifest against its JSON Schema, the sha256 of "
        "every file and tensor, each case recomputed by the exact generator whatever the manifest "
        "claims (bit-identical to the correctly rounded result, or within the documented "
        "float64 backend bound of it: docs/verify.md), "
        "its conventions and flags against the rebuilt call, and its stored gradients by a "
        "gradient check. Exit 0 when every case passes, 1 when one fails, 2 on an error.",
        epilog="examples:\n"
        "  refattn verify goldens\n"
        "  refattn verify --exact goldens                    # + the rounding certificate\n"
        "  refattn verify goldens --require exact            # every case bit-identical\n"
        "  refattn verify goldens --gradcheck-method central --json",
    )
    p.add_argument("directory", help="bundle directory (manifest.json and cases/)")
    p.add_argument("--no-recompute", action="store_true",
                   help="skip recomputing each case with the engine")
    p.add_argument("--no-gradcheck", action="store_true",
                   help="skip the finite-difference check of each case's backward")
    p.add_argument("--gradcheck-method", default="auto", type=_gradcheck_method,
                   choices=GRADCHECK_METHODS, metavar="{auto,complex_step,central}",
                   help="numeric derivative of the gradient check, spelled as refattn "
                   "gradcheck --method spells it: complex_step (= auto: gradcheck.check_vjp) "
                   "or central (Richardson central differences along one random direction); "
                   "the old spellings check_vjp and central_difference still work")
    p.add_argument("--backend", default=None,
                   help="another engine to run on every case too (e.g. numba): its tensors "
                   "must meet the float64 rule against the stored ones; cases it cannot run "
                   "are noted (the exact recomputation runs whatever this says)")
    p.add_argument("--require", default="float64", choices=REQUIREMENTS,
                   help="float64 (default): each case bit-identical to the correctly rounded "
                   "result or within the documented float64 backend bound of it; exact: "
                   "fail every case that is not bit-identical to it")
    p.add_argument("--exact-max-seconds", type=seconds_value, default=DEFAULT_MAX_SECONDS,
                   metavar="S",
                   help="the exact generator's limit per case, on its estimate before any "
                   "arithmetic (default %(default)g); a case over it is checked against a "
                   "float64 recomputation within twice the bound, and says so")
    p.add_argument("--exact", action="store_true",
                   help="also run the rounding certificate: every stored element must be the "
                   "correctly rounded value of its definition (independent interval check)")
    p.add_argument("--json", action="store_true",
                   help="print the report as one JSON document")
    p.add_argument("--no-legend", action="store_true",
                   help="leave out the lines that explain the columns")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (one is drawn only on a terminal anyway)")
    add_cluster_arguments(p)  # --workers N / --scheduler ADDR: the cases checked in parallel
    p.set_defaults(func=run)


def _digest(directory: str) -> str | None:
    """The bundle's digest, or None where its manifest cannot be read (verify names why)."""
    try:
        return bundle_digest(directory)
    except RefAttnError:
        return None


def run(args: argparse.Namespace) -> int:
    with connect(workers=args.workers, scheduler=args.scheduler, timeout=args.timeout) as client:
        digest = _digest(args.directory)  # these bytes; a pass is recorded only for them
        report = verify(args.directory, client=client, recompute=not args.no_recompute,
                        gradcheck=not args.no_gradcheck,
                        gradcheck_method=_VERIFIER_METHOD[args.gradcheck_method],
                        backend=args.backend, exact=args.exact, require=args.require,
                        exact_max_seconds=args.exact_max_seconds,
                        progress=False if args.quiet else None, timeout=args.timeout)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.format(legend=not args.no_legend))
    if (report.passed and not args.no_recompute and digest is not None
            and _digest(args.directory) == digest):
        remember(digest, report, gradcheck=not args.no_gradcheck)  # the plugin's certificate
    return 0 if report.passed else 1
