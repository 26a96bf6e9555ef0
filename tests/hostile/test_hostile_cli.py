"""Hostile command lines, SPEC files and scheduler endpoints (issue 25, items 3 and 5).

Each probe ends in one line on stderr and exit code 2, with no traceback, however the input
was meant to hang or exhaust the machine: scheduler endpoints that accept and never answer,
answer HTTP, refuse, or claim a huge first frame; addresses dask cannot parse; YAML aliases
(a 400-byte "billion laughs" file), nesting and value counts past the limits; SPEC cases too
large to compute, refused from their shapes before any tensor is drawn; more local workers
than cores. The tests bound each command's run by a generous subprocess timeout (the command
must end; how fast is never asserted) and check the line it prints.
"""

from __future__ import annotations

import http.server
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from refattn.bundle.sweeps import grid as sweep_module
from refattn.bundle.sweeps.grid import (
    MAX_SPEC_DEPTH,
    MAX_SPEC_VALUES,
    build_case,
    case_budget,
    case_id,
    check_budget,
    check_spec,
    expand,
    normalize,
    read_spec,
)
from refattn.cli import main
from refattn.distributed.cluster import usable_cores
from refattn.distributed.sweep import run_sweep
from refattn.engine.exact.backend import estimate_seconds
from refattn.errors import RefAttnError

#: seconds a refused command may run, imports on a loaded machine included (never asserted
#: as a speed: a command that hangs is what this catches)
ENDS_WITHIN = 180
SPEC_OK = 'name = "t"\n[[grid]]\nshape = [[1, 1, 1, 2, 2, 4, 4]]\n'


def run_cli(*args: str, timeout: float = ENDS_WITHIN) -> subprocess.CompletedProcess:
    """``refattn ARGS`` in a fresh interpreter: what reaches stderr at exit counts too."""
    code = "import sys; from refattn.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert err.count("\n") == 1 and err.endswith("\n"), err[-2000:]
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# -- scheduler endpoints ------------------------------------------------------------------------
class _Listener:
    """A loopback TCP listener that accepts and then does what ``behaviour`` says."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by the test
                return
            self.conns.append(conn)
            if self.behaviour == "huge_frame":  # dask reads 8 bytes as a frame length
                conn.sendall(struct.pack("<Q", 2**40))

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def endpoint(request) -> Iterator[str]:
    """``tcp://127.0.0.1:PORT`` of a silent listener, an HTTP server, a port nobody listens
    on, or a listener that claims a 1 TiB first frame and stops."""
    kind = request.param
    if kind == "http":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                 http.server.SimpleHTTPRequestHandler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        server.server_close()
    elif kind == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield f"tcp://127.0.0.1:{port}"
    else:
        listener = _Listener(kind)
        yield f"tcp://127.0.0.1:{listener.port}"
        listener.close()


@pytest.mark.parametrize("endpoint", ["silent", "http", "refused", "huge_frame"],
                         indirect=True)
def test_sweep_scheduler_that_never_answers_ends_within_the_timeout(endpoint, tmp_path):
    pytest.importorskip("distributed")
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC_OK)
    result = run_cli("sweep", str(spec), "--out", str(tmp_path / "b"), "--scheduler",
                     endpoint, "--timeout", "1.5")
    assert_one_line_error(result, f"--scheduler {endpoint}: no dask scheduler answered "
                          "within 1.5 s")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("endpoint", ["silent"], indirect=True)
def test_verify_scheduler_that_never_answers_ends_within_the_timeout(endpoint, tmp_path):
    pytest.importorskip("distributed")
    result = run_cli("verify", str(tmp_path / "bundle"), "--scheduler", endpoint,
                     "--timeout", "2.5")
    assert_one_line_error(result, f"--scheduler {endpoint}: no dask scheduler answered "
                          "within 2.5 s")


def test_unreachable_address_leaves_no_traceback_at_exit(tmp_path):
    pytest.importorskip("distributed")
    result = run_cli("sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"),
                     "--scheduler", "garbage://x", "--timeout", "3")
    assert_one_line_error(result, "--scheduler garbage://x: not a dask scheduler address")


@pytest.mark.parametrize(("address", "expected"), [
    ("http://127.0.0.1:8786", "unknown address scheme 'http'"),
    ("garbage://x", "unknown address scheme 'garbage'"),
    ("tcp://[::1", "invalid address"),
    ("tcp://127.0.0.1", "missing port"),
    ("tcp://127.0.0.1:0", "port in [1, 65535]"),
    ("tcp://127.0.0.1:70000", "port in [1, 65535]"),
    ("tcp://h:1\nsecond line", "not a dask scheduler address"),
    ("inproc://x", "unknown address scheme 'inproc'"),
])
def test_addresses_dask_cannot_reach_are_named_before_connecting(address, expected, tmp_path,
                                                                 capsys):
    pytest.importorskip("distributed")
    for command in (["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b")],
                    ["verify", str(tmp_path / "b")]):
        assert main([*command, "--scheduler", address, "--timeout", "7"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err


_FAKE_SCHEDULER = """
import asyncio, sys
from distributed.core import Server

async def stall(**kw):
    await asyncio.sleep(3600)

def identity():  # refattn's probe asks with no arguments; dask's client with n_workers
    return {"type": "Scheduler", "id": "fake"}

async def main():
    handlers = {"identity": lambda **kw: identity(), "register-client": stall}
    if sys.argv[1] == "fail":
        handlers = {"identity": identity}
    server = Server(handlers)
    await server.listen("tcp://127.0.0.1:0")
    print(server.address, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["stall", "fail"])
def test_a_scheduler_that_answers_the_probe_then_fails_the_client(tmp_path, mode):
    """dask's handshake and identity pass; the client's registration is never answered, or
    its own identity request fails: the client is given up (dask's own timeout, under
    refattn's watchdog) in one line, with neither ``Client.__del__``'s traceback nor dask's
    "Closing dangling stream" warnings."""
    pytest.importorskip("distributed")
    server = subprocess.Popen([sys.executable, "-c", _FAKE_SCHEDULER, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = server.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address
        result = run_cli("sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "b"),
                         "--scheduler", address, "--timeout", "2")
        assert_one_line_error(result, f"--scheduler {address}: no dask scheduler answered "
                              "within 2 s as a client")
    finally:
        server.kill()
        server.wait()


def test_a_worker_is_not_a_scheduler():
    pytest.importorskip("distributed")
    from refattn.distributed import connect

    with connect(workers=1, memory_limit="1GiB") as client:
        worker = next(iter(client.scheduler_info()["workers"]))
        with pytest.raises(RefAttnError, match="a dask Worker answered, not a dask scheduler"):
            with connect(scheduler=worker, timeout=5):
                pass
        with connect(scheduler=client.scheduler.address, timeout=5) as other:
            assert other.scheduler_info()["workers"]  # the real scheduler still serves


# -- --workers ------------------------------------------------------------------------------------
def test_more_workers_than_cores_is_refused_before_any_process_starts(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC_OK)
    cores = usable_cores()
    for workers in (cores + 1, 1000):
        assert main(["sweep", str(spec), "--out", str(tmp_path / "b"), "--workers",
                     str(workers)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert f"--workers {workers}: this machine lets refattn use {cores} CPU core" in err
        assert main(["verify", str(tmp_path / "b"), "--workers", str(workers)]) == 2
        assert f"expected at most {cores} worker processes" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


# -- YAML and TOML SPEC files -------------------------------------------------------------------
def billion_laughs(levels: int = 9, width: int = 10) -> str:
    """A YAML SPEC whose ``shape`` is width**levels values, spelled with aliases."""
    lines = ["a0: &a0 [" + ", ".join(["1"] * width) + "]"]
    for n in range(1, levels):
        lines.append(f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * width) + "]")
    return "\n".join([*lines, "name: t", f"grid: [{{shape: *a{levels - 1}}}]", ""])


def test_yaml_billion_laughs_is_refused_in_bounded_time_and_memory(tmp_path):
    pytest.importorskip("yaml")
    spec = tmp_path / "laughs.yaml"
    spec.write_text(billion_laughs())
    assert spec.stat().st_size < 600
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = run_cli("sweep", str(spec), "--out", str(tmp_path / "b"))
    assert_one_line_error(result, "line 2: YAML alias *a0: aliases are not allowed")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # peak RSS of the largest child so far, in KiB: a CLI start is about 60 MB; the file
    # once took 478 MB within 20 s and kept growing
    assert peak < 400 * 1024 or peak == before, peak


@pytest.mark.parametrize("text", [
    "base: &b {mask: none}\nname: t\ngrid: [{shape: [[1, 1, 1, 2, 2, 4, 4]]}]\n"
    "case: [{<<: *b, shape: [1, 1, 1, 2, 2, 4, 4]}]\n",  # a merge key is an alias too
    "name: t\ngrid: [{shape: [&s [1, 1, 1, 2, 2, 4, 4], *s]}]\n",
])
def test_every_yaml_alias_is_refused(tmp_path, text):
    pytest.importorskip("yaml")
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(RefAttnError, match="aliases are not allowed in a SPEC"):
        read_spec(tmp_path / "s.yaml")


def test_a_yaml_anchor_without_alias_is_harmless_and_read(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "s.yaml").write_text("name: t\ngrid: [{shape: &s [[1, 1, 1, 2, 2, 4, 4]]}]\n")
    assert read_spec(tmp_path / "s.yaml")["grid"][0]["shape"] == [[1, 1, 1, 2, 2, 4, 4]]


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("deep.yaml", "name: t\nx: " + "[" * 100_000 + "]" * 100_000 + "\n",
     f"nested more than {MAX_SPEC_DEPTH} deep"),
    ("deep.toml", 'name = "t"\nx = ' + "[" * 100_000 + "]" * 100_000 + "\n",
     f"nested more than {MAX_SPEC_DEPTH} deep"),
    ("inline.toml", 'name = "t"\nx = ' + "{a = " * 5_000 + "1" + "}" * 5_000 + "\n",
     f"nested more than {MAX_SPEC_DEPTH} deep"),
    ("many.yaml", "name: t\nseed: [" + ", ".join(["0"] * (MAX_SPEC_VALUES + 1)) + "]\n",
     f"more than {MAX_SPEC_VALUES} values"),
    ("many.toml", 'name = "t"\nseed = [' + ", ".join(["0"] * (MAX_SPEC_VALUES + 1)) + "]\n",
     f"more than {MAX_SPEC_VALUES} values"),
])
def test_deep_or_huge_spec_files_are_one_line(tmp_path, capsys, name, text, expected):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    (tmp_path / name).write_text(text)
    assert main(["sweep", str(tmp_path / name), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err[:500]


def test_shared_python_objects_count_every_time_they_occur():
    """The Python analogue of aliases: a 10-level tree of shared 10-lists stands for 10**10
    values; checking it stops at the limit instead of walking (or printing) them all."""
    value: object = [1] * 10
    for _ in range(9):
        value = [value] * 10
    with pytest.raises(RefAttnError, match=f"more than {MAX_SPEC_VALUES} values"):
        check_spec({"name": "t", "grid": [{"shape": value}]})


def test_schema_errors_never_print_a_huge_value():
    bad_shapes = [[1, 1, 1, 2, 2, 4]] * 10_001  # too many values, and each one too short
    with pytest.raises(RefAttnError) as err:
        check_spec({"name": "t", "grid": [{"shape": bad_shapes}]})
    assert str(err.value).startswith("SPEC: grid/0/shape")
    assert len(str(err.value)) < 400


# -- a SPEC case's cost, from its shape -----------------------------------------------------------
@pytest.mark.parametrize(("shape", "scores"), [
    ([65536] * 7, 65536**4),                       # once: ValueError: array is too big
    ([8, 64, 64, 2048, 2048, 64, 64], 8 * 64 * 2048 * 2048),  # once: 21.6 s, 4.26 GB drawn
])
def test_a_case_too_large_is_refused_from_its_shape(tmp_path, capsys, monkeypatch, shape,
                                                    scores):
    def no_tensors(description):
        raise AssertionError("a tensor was drawn before the case's cost was checked")

    monkeypatch.setattr(sweep_module, "_rng", no_tensors)
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "t"\n[[case]]\nshape = {shape}\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    cid = case_id(normalize({"shape": shape}))
    assert err.count("\n") == 1
    assert f"case/0: case {cid}: needs about {case_budget(normalize({'shape': shape})).bytes}"\
           f" bytes" in err
    assert f"({scores} score elements), more than the limit of " in err
    assert not (tmp_path / "b").exists()


def test_the_big_spec_case_ends_in_one_line_in_a_fresh_process(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "t"\n[[case]]\nshape = [8, 64, 64, 2048, 2048, 64, 64]\n')
    result = run_cli("sweep", str(spec), "--out", str(tmp_path / "b"))
    assert_one_line_error(result, "of memory to compute and check")


def test_time_and_memory_limits_name_the_case_and_the_limit(monkeypatch):
    monkeypatch.setattr(sweep_module, "_rng", lambda d: pytest.fail("tensors were drawn"))
    doc = {"name": "t", "grid": [{"shape": [[1, 2, 1, 128, 128, 64, 64]]}]}
    with pytest.raises(RefAttnError, match=r"grid/0: case dot-none-1x2x1x128x128x64x64-\w+: "
                       r"needs about \d+ bytes .* more than the limit of 1000000 bytes"):
        expand(check_spec(doc), max_bytes=10**6)
    with pytest.raises(RefAttnError, match=r"would take about 0\.786 s to compute and check "
                       r"\(32768 score elements, each correctly rounded\), over the limit of "
                       r"0\.5 s per case"):
        expand(check_spec(doc), max_bytes=None, max_seconds=0.5)


class _WorkersWithLittleMemory:
    """A client whose workers each have 1 MB; anything past the budget check fails."""

    def scheduler_info(self):
        return {"workers": {"tcp://127.0.0.1:1": {"memory_limit": 10**6}}}


def test_a_case_over_the_workers_memory_limit_is_refused_before_submitting(tmp_path):
    sweep = expand(check_spec({"name": "t", "case": [{"shape": [1, 2, 1, 64, 64, 8, 8]}]}))
    with pytest.raises(RefAttnError, match=r"sweep t: case/0: case \S+: needs about \d+ bytes"
                       r" .* more than the limit of 1000000 bytes"):
        run_sweep(sweep, tmp_path / "b", client=_WorkersWithLittleMemory(), progress=False)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("fields", [
    {"shape": [1, 1, 1, 3, 5, 4, 4]},
    {"shape": [2, 4, 2, 3, 7, 8, 4], "mask": "causal_lower_right", "bias": "random"},
    {"shape": [1, 2, 1, 4, 6, 8, 8], "score": {"family": "additive", "da": 3}},
    {"shape": [1, 2, 2, 4, 6, 8, 8], "score": "cosine"},
    {"shape": [2, 2, 2, 4, 6, 8, 8], "score": "bilinear"},
    {"shape": [1, 4, 2, 4, 6, 16, 8], "score": {"family": "bilinear", "shared": True}},
])
def test_the_time_estimate_is_the_exact_generators_own(fields):
    """From the shape alone, the seconds the exact backend estimates from the built call;
    for the bilinear family, plus 4e-6 s * B * Hq * Dk**2 * (2 + (Q + K) / 8) for W."""
    d = normalize(fields)
    B, Hq, _, Q, K, Dk, _ = fields["shape"]
    extra = 4e-6 * B * Hq * Dk**2 * (2 + (Q + K) / 8) if d["score"]["family"] == "bilinear" \
        else 0.0
    assert case_budget(d).seconds == pytest.approx(
        estimate_seconds(build_case(d).call) + extra, rel=1e-12)


@pytest.mark.parametrize("fields", [
    {"shape": [2, 1, 1, 128, 128, 8, 8], "bias": "random", "mask": "causal_lower_right",
     "dropout": {"p": 0.1, "seed": 1}, "generator": "numpy"},
    {"shape": [1, 1, 1, 64, 64, 16, 16], "score": {"family": "additive", "da": 8},
     "generator": "numpy"},
    {"shape": [2, 1, 1, 16, 16, 256, 256], "generator": "exact"},
    {"shape": [1, 1, 1, 16, 16, 512, 512], "score": "cosine", "generator": "exact"},
    {"shape": [1, 4, 1, 4, 4, 128, 8], "score": {"family": "bilinear", "shared": True},
     "generator": "numpy"},
    {"shape": [1, 2, 1, 8, 8, 128, 128], "score": "bilinear", "generator": "exact"},
])
def test_the_memory_estimate_bounds_the_measured_peak(fields):
    """Peak RSS growth of computing and checking one case, in a fresh process, is below the
    estimate, and the estimate is not more than 4x (plus 8 MiB) above it. Linux only: the
    peak is reset (``/proc/self/clear_refs``) after imports and warm-up."""
    code = textwrap.dedent(f"""
        from refattn.bundle.sweeps.grid import case_id, normalize
        from refattn.distributed.sweep import encode_batch

        def kib(field):
            with open("/proc/self/status") as fh:
                return next(int(line.split()[1]) for line in fh if line.startswith(field))

        small = normalize({{"shape": [1, 1, 1, 2, 2, 4, 4],
                           "generator": {fields["generator"]!r}}})
        encode_batch([(case_id(small), small)])   # imports, compilation, caches
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")                          # the peak (VmHWM) starts again from here
        before = kib("VmRSS:")
        d = normalize({fields!r})
        encode_batch([(case_id(d), d)])
        print(1024 * (kib("VmHWM:") - before))
    """)
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=ENDS_WITHIN, check=True)
    grown = int(run.stdout.split()[-1])
    estimate = case_budget(normalize(fields)).bytes
    assert 0 < grown <= estimate, (grown, estimate)
    assert estimate <= 4 * grown + 8 * 2**20, (grown, estimate)


def test_check_budget_passes_a_case_within_both_limits():
    d = normalize({"shape": [1, 2, 1, 128, 128, 64, 64]})
    budget = check_budget(d, max_bytes=2**30, max_seconds=1.0)
    assert budget.scores == 2 * 128 * 128
    # q and grad_output (B, Hq, Q, D); k and v (B, Hkv, K, D)
    assert budget.input_bytes == 8 * (2 * 128 * 64 * 2 + 128 * 64 * 2)


@pytest.mark.parametrize(("field", "expected"), [
    ("scale = [inf]", "scale: expected a finite number, got inf"),
    ("scale = [nan]", "scale: expected a finite number, got nan"),
    ('score = [{ family = "cosine", eps = inf }]', "score eps: expected a finite number"),
    ("dropout = [{ p = nan, seed = 1 }]", "dropout p: expected a finite number, got nan"),
])
def test_non_finite_numbers_are_named(tmp_path, capsys, field, expected):
    """TOML and YAML spell inf and nan, which JSON Schema cannot refuse (they once ended in
    json's ValueError: Out of range float values are not JSON compliant)."""
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "t"\n[[grid]]\nshape = [[1, 1, 1, 2, 2, 4, 4]]\n{field}\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"grid/0: {expected}" in err, err


# -- generated SPEC documents ---------------------------------------------------------------------
_WORDS = ["none", "causal_upper_left", "causal_lower_right", "dot", "cosine", "additive",
          "bilinear", "window", "key_padding", "prefix", "segments", "causal", "random",
          "alibi", "exact", "numpy", "default", "upper_left", "lower_right"]
_KEYS = ["shape", "score", "scale", "mask", "bias", "dropout", "seed", "generator", "family",
         "eps", "da", "shared", "kind", "alignment", "left", "right", "causal", "pad",
         "length", "count", "p", "offset", "B", "Hq", "Hkv", "Q", "K", "Dk", "Dv"]


def _spec_documents():
    """SPEC documents near the schema: each field drawn from values of its own kind (small
    and edge-case numbers, inf and nan, every mask kind with in- and out-of-range parameters)
    or, now and then, from anything at all."""
    from hypothesis import strategies as st

    weird = st.recursive(
        st.integers(-2**70, 2**70) | st.booleans() | st.none() | st.text(max_size=4)
        | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(_WORDS),
        lambda inner: st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=3), max_leaves=8)
    counts = st.integers(0, 6) | st.sampled_from([65536, 2**64])
    numbers = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
        [0.0, 1e-320, 0.5, 1 - 2**-33, 1.0, 1e308])
    axes = st.lists(st.integers(1, 5), min_size=7, max_size=7)
    shape = axes | axes.map(lambda a: dict(zip(("B", "Hq", "Hkv", "Q", "K", "Dk", "Dv"), a,
                                               strict=True)))
    score = st.sampled_from(["dot", "bilinear", "cosine", "additive"]) | st.fixed_dictionaries(
        {"family": st.sampled_from(["dot", "bilinear", "cosine", "additive"])},
        optional={"eps": numbers, "da": counts, "shared": st.booleans()})
    mask = st.sampled_from(["none", "causal_upper_left", "causal_lower_right"]) | (
        st.fixed_dictionaries(
            {"kind": st.sampled_from(["causal", "window", "key_padding", "prefix", "segments"])},
            optional={"alignment": st.sampled_from(["upper_left", "lower_right"]),
                      "left": counts, "right": counts, "causal": st.booleans(),
                      "pad": counts, "length": counts, "count": counts}))
    dropout = st.just("none") | st.fixed_dictionaries(
        {"p": numbers, "seed": st.integers(0, 2**64)}, optional={"offset": counts})
    kinds = {"shape": shape, "score": score, "scale": st.just("default") | numbers,
             "mask": mask, "bias": st.sampled_from(["none", "random", "alibi"]),
             "dropout": dropout, "seed": st.integers(0, 2**64), "generator":
             st.sampled_from(["exact", "numpy"])}
    fields = st.fixed_dictionaries({}, optional={
        key: value | weird if key != "shape" else value for key, value in kinds.items()})
    grid = st.fixed_dictionaries({"shape": st.lists(shape, min_size=1, max_size=2)}, optional={
        key: st.lists(value, min_size=1, max_size=2) | weird
        for key, value in kinds.items() if key != "shape"})
    return st.fixed_dictionaries({"name": st.just("f")}, optional={
        "grid": st.lists(grid, min_size=1, max_size=2),
        "case": st.lists(fields.map(lambda f: {"shape": [1, 1, 1, 2, 2, 2, 2], **f}),
                         min_size=1, max_size=2),
        "defaults": fields,
    })


def test_generated_spec_documents_end_in_a_sweep_or_a_refattn_error():
    """Any document (wrong types, inf and nan, huge integers, unknown words, partial shapes)
    either expands or raises RefAttnError: never another exception (a traceback in the CLI).
    Cases are held to 64 MiB so that a valid large shape is refused, not drawn."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_spec_documents())
    def check(doc):
        try:
            expand(check_spec(doc), max_bytes=64 * 2**20)
        except RefAttnError:
            pass

    check()


# -- a scheduler that stops answering in the middle of a sweep ----------------------------------
def _wait_for(predicate, seconds: float, what: str):
    """Poll ``predicate()`` until it returns something true, at most ``seconds``."""
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {seconds} s")


def _stop(process: subprocess.Popen) -> None:
    import os
    import signal

    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
    process.wait(timeout=60)


def test_a_scheduler_paused_mid_sweep_ends_the_sweep_in_one_line_and_it_resumes(tmp_path,
                                                                                capsys):
    """A real dask scheduler and worker on loopback; once the first case is staged the
    scheduler process is paused (SIGSTOP): the sweep ends with one line naming the address
    and exit 2 (it used to wait forever), what finished stays staged, no bundle is swapped
    in, and the same command run again (here without the cluster) resumes from the staging."""
    pytest.importorskip("distributed")
    import json
    import os
    import signal
    import time

    from refattn.bundle.storage.transaction import RESUME_MARK

    spec = tmp_path / "s.toml"
    spec.write_text('name = "paused"\n[[grid]]\nshape = [[1, 2, 1, 64, 64, 32, 32]]\n'
                    f"seed = {list(range(12))}\n")
    out = tmp_path / "b"
    file = tmp_path / "scheduler.json"
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    sweep = None
    try:
        _wait_for(lambda: file.exists() and file.read_text().strip(), 120, "scheduler file")
        address = json.loads(file.read_text())["address"]
        worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
             str(file), "--nthreads", "1", "--nworkers", "1", "--no-dashboard",
             "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        code = "import sys; from refattn.cli import main; sys.exit(main(sys.argv[1:]))"
        sweep = subprocess.Popen([sys.executable, "-c", code, "sweep", str(spec), "--out",
                                  str(out), "--scheduler", address, "--timeout", "3",
                                  "--quiet"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def staged():
            return [p for p in tmp_path.glob(f".b{RESUME_MARK}*/bundle/cases/*.safetensors")]

        _wait_for(lambda: staged() or sweep.poll() is not None, 120, "first staged case")
        assert sweep.poll() is None, "the sweep ended before the scheduler could be paused"
        os.kill(scheduler.pid, signal.SIGSTOP)
        paused = time.monotonic()
        stdout, stderr = sweep.communicate(timeout=120)
        with capsys.disabled():
            print(f"\nerror line {time.monotonic() - paused:.1f} s after SIGSTOP: {stderr}")
        result = subprocess.CompletedProcess(sweep.args, sweep.returncode, stdout, stderr)
        assert_one_line_error(result, f"the dask scheduler at {address} did not answer",
                              "rerun the same command to resume")
        assert not (out / "manifest.json").exists()  # the bundle was not swapped in
        kept = staged()
        assert 1 <= len(kept) < 12, len(kept)
    finally:
        for process in (sweep, worker, scheduler):
            if process is not None:
                _stop(process)
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", str(out), "--quiet"]) == 0
    assert f"computed {12 - len(kept)}, reused {len(kept)})" in capsys.readouterr().out
    assert len(json.loads((out / "manifest.json").read_text())["cases"]) == 12
