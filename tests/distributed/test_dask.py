"""On a 2-worker LocalCluster (processes, loopback): sweeps, sharded calls and verify give the
bytes and verdicts of the local run; a worker killed mid-sweep is survived; a scheduler that
does not answer is a clear error."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import refattn  # noqa: E402
from refattn.bundle.sweeps.grid import check_spec, expand  # noqa: E402
from refattn.bundle.verification.verifier import verify as verify_serial  # noqa: E402
from refattn.cli import main  # noqa: E402
from refattn.distributed import connect, run_sweep, value_and_grad  # noqa: E402
from refattn.distributed import verify as verify_parallel  # noqa: E402
from refattn.distributed.shard import plan_shards  # noqa: E402
from refattn.dropout import Philox  # noqa: E402
from refattn.errors import RefAttnError  # noqa: E402
from refattn.masks import causal, relation  # noqa: E402

SPEC = {
    "name": "dask",
    "grid": [{"shape": [[1, 2, 1, 3, 5, 4, 4], [2, 2, 2, 4, 4, 4, 6]],
              "mask": ["none", "causal_lower_right", {"kind": "window", "left": 1}],
              "dropout": ["none", {"p": 0.25, "seed": 9}]}],
}
NAMES = ("grad_q", "grad_k", "grad_v", "grad_bias", "row_dot", "row_dot_output")


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def client():
    with connect(workers=2, memory_limit="1GiB") as c:
        yield c


@pytest.fixture(scope="module")
def sweep():
    return expand(check_spec(SPEC))


@pytest.fixture(scope="module")
def local_bundle(sweep, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "bundle"
    run_sweep(sweep, out, progress=False)
    return out


def test_cluster_is_two_processes_on_loopback(client):
    info = client.scheduler_info()
    assert len(info["workers"]) == 2
    assert info["address"].startswith("tcp://127.0.0.1:")
    assert all(a.startswith("tcp://127.0.0.1:") for a in info["workers"])
    pids = client.run(os.getpid)
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    psutil = pytest.importorskip("psutil")
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [c.laddr for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) >= 3  # scheduler, its status page, workers and nannies
    assert {a.ip for a in listening} == {"127.0.0.1"}


@pytest.mark.parametrize("tasks", [None, 1, 12])
def test_sweep_on_workers_is_byte_identical_to_the_local_run(client, sweep, local_bundle,
                                                             tmp_path, tasks):
    out = tmp_path / "b"
    result = run_sweep(sweep, out, client=client, progress=False, tasks=tasks)
    assert result.computed == len(sweep.cases) == 12
    assert result.tasks == (tasks or 12)
    assert tree(out) == tree(local_bundle)


def test_parallel_verify_gives_the_serial_verdicts(client, local_bundle, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(local_bundle, bad)
    victim = sorted((bad / "cases").iterdir())
    victim[0].write_bytes(victim[0].read_bytes()[:-8])  # truncated: fails before recompute
    data = bytearray(victim[3].read_bytes())
    data[-9] ^= 0x10  # one tensor altered
    victim[3].write_bytes(bytes(data))
    for directory in (local_bundle, bad):
        serial = verify_serial(directory, gradcheck=False, progress=False)
        parallel = verify_parallel(directory, client=client, gradcheck=False, progress=False)
        assert parallel.to_dict() == serial.to_dict()
        assert parallel.passed == (directory == local_bundle)


def _local(call, g, bq, bk):
    trace = refattn.forward(call, backend="numba", materialize=False, block_q=bq, block_k=bk)
    return trace.output, refattn.backward(trace, g)


def _calls():
    rng = np.random.default_rng(20)
    B, Hq, Hkv, Q, K, D = 2, 4, 2, 40, 36, 8
    q = rng.standard_normal((B, Hq, Q, D))
    k = rng.standard_normal((B, Hkv, K, D))
    v = rng.standard_normal((B, Hkv, K, D))
    g = rng.standard_normal((B, Hq, Q, D))
    pos = np.arange(Q)[None]
    kpos = np.arange(K)[None]
    yield "gqa", refattn.AttentionCall(q, k, v), g
    yield "causal_philox", refattn.AttentionCall(
        q, k, v, visible=causal(Q, K, alignment="upper_left"), dropout=Philox(0.2, seed=5)), g
    yield "window_union_keypad_bias", refattn.AttentionCall(
        q, k, v, visible=relation(pos, kpos, causal=True, window=(3, 0))
        | relation(pos, kpos, kpos < 2, causal=True),
        bias=rng.standard_normal((B, 1, 1, K))), g
    yield "dense_visible_sanitized_rows", refattn.AttentionCall(
        q, k, v, visible=rng.random((B, 1, Q, K)) < 0.5, query_valid=rng.random((B, 1, Q, 1)) < .8,
        all_masked_rows="sanitize_then_zero_invalid_query"), g
    yield "scalar_bias_explicit_head_map", refattn.AttentionCall(
        q, k, v, bias=rng.standard_normal((1, 1, 1, 1)), head_map=np.array([1, 0, 0, 1])), g
    one = refattn.AttentionCall(q[:1, :1], k[:1, :1], v[:1, :1],
                                dropout=np.where(rng.random((1, 1, Q, K)) < 0.2, 0.0, 1.25))
    yield "one_head_key_chunks", one, g[:1, :1]


@pytest.mark.parametrize("name, call, g", list(_calls()), ids=lambda x: x if isinstance(
    x, str) else "")
@pytest.mark.parametrize("rows", [None, 16])
def test_sharded_call_is_bit_identical_to_the_local_streaming_run(client, name, call, g, rows):
    out0, g0 = _local(call, g, 8, 8)  # first: compiles (or loads) the kernels the workers use
    out1, g1 = value_and_grad(call, g, client=client, block_q=8, block_k=8, rows_per_shard=rows)
    plan = plan_shards(call, block_q=8, block_k=8, rows_per_shard=rows)
    if rows is not None and name != "scalar_bias_explicit_head_map":
        assert plan.split_backward and len(plan.query_ranges) == 3 and len(plan.key_ranges) == 3
    assert out1.tobytes() == out0.tobytes()
    for n in NAMES:
        a, b = getattr(g0, n), getattr(g1, n)
        assert (a is None) == (b is None), n
        if a is not None:
            assert a.shape == b.shape and a.tobytes() == b.tobytes(), n


class Recording:
    """The real client, recording what value_and_grad scatters and submits."""

    def __init__(self, client):
        self.client, self.scattered, self.arguments = client, [], []
        self.scattered_keys: list[str] = []

    def scatter(self, data, **kw):
        self.scattered.append((type(data).__name__, kw.get("broadcast")))
        future = self.client.scatter(data, **kw)
        self.scattered_keys.append(str(future.key))
        return future

    def submit(self, fn, *args, **kw):
        self.arguments.append([type(a).__name__ for a in args])
        return self.client.submit(fn, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.client, name)


def _fetched(client):
    """(key, nbytes) of every key a worker fetched from another since the last clear."""
    moved = client.run(lambda dask_worker: [
        (str(key), nbytes) for entry in dask_worker.transfer_incoming_log
        for key, nbytes in entry["keys"].items()])
    return [pair for pairs in moved.values() for pair in pairs]


@pytest.mark.parametrize("memory_manager", ["stopped", "running"])
def test_inputs_travel_once_per_worker_not_once_per_task(client, memory_manager):
    """What value_and_grad guarantees about data movement, and what it leaves to dask.

    Guaranteed by the code: the call and grad_output are scattered once, broadcast to every
    worker; tasks carry futures and small descriptions only; a query shard's full result never
    travels, only its saved forward rows (a ``saved_rows`` task of microseconds, which dask
    never steals, runs where the query shard ran). Left to the scheduler: dask's active memory
    manager (on by default, every 2 s) drops broadcast replicas it considers superfluous, and
    a task later placed or stolen onto that worker fetches the call again: measured under
    2-core load, the 20 kB grad_output and the 56-byte call moved in 3 of 15 runs. So with
    the memory manager stopped nothing else moves; with it running the scattered inputs may
    move again too, but never a task's own arrays or a shard's result.
    """
    _, call, g = next(_calls())
    _local(call, g, 8, 8)
    running = client.amm.running()
    if memory_manager == "stopped":
        client.amm.stop()
    else:
        client.amm.start()
    try:
        client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
        spy = Recording(client)
        value_and_grad(call, g, client=spy, block_q=8, block_k=8, rows_per_shard=8)
        moved = _fetched(client)
    finally:
        (client.amm.start if running else client.amm.stop)()
    # the call and grad_output are scattered once, to every worker ...
    assert spy.scattered == [("AttentionCall", True), ("ndarray", True)]
    # ... and no task carries an array or a call, only futures and small descriptions
    assert len(spy.arguments) > 20
    assert all("ndarray" not in a and "AttentionCall" not in a for a in spy.arguments)
    scattered = tuple(spy.scattered_keys)
    for key, nbytes in moved:
        if memory_manager == "running" and key in scattered:
            continue  # a dropped broadcast replica fetched again (dask's memory manager)
        # otherwise only the query shards' saved forward rows (output, lse, row max of 8 rows
        # and 2 heads, about 1.5 kB) travel, to the key shards
        assert "saved_rows" in key, (key, nbytes)
        assert nbytes < 4_000, (key, nbytes)


def test_worker_killed_mid_sweep_is_survived(tmp_path):
    # cases of about 50 ms, one per task: the sweep runs long enough to kill a worker mid-case
    sweep = expand(check_spec({"name": "kill", "grid": [{
        "shape": [[1, 2, 2, 24, 24, 16, 16]], "mask": ["none", "causal_upper_left"],
        "seed": list(range(8))}]}))
    run_sweep(sweep, tmp_path / "local", progress=False)
    out = tmp_path / "b"
    killed = {}
    with connect(workers=2, memory_limit="1GiB") as c:
        pids = c.run(os.getpid)
        c.run(lambda: __import__("refattn.distributed.sweep"))

        def killer():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed:
                busy = [w for w, keys in c.processing().items() if keys]
                if busy:
                    killed["worker"] = busy[0]
                    os.kill(pids[busy[0]], signal.SIGKILL)
                    return
                time.sleep(0.002)

        thread = threading.Thread(target=killer)
        thread.start()
        result = run_sweep(sweep, out, client=c, progress=False, tasks=len(sweep.cases))
        thread.join()
        assert killed, "no task was seen running"
        assert killed["worker"] not in c.scheduler_info()["workers"]  # it died mid-sweep
    assert result.computed == len(sweep.cases) == 16
    assert tree(out) == tree(tmp_path / "local")  # nothing partial, the same bytes
    assert verify_serial(out, gradcheck=False, progress=False).passed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_scheduler_that_does_not_answer_is_a_clear_error():
    address = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(RefAttnError) as err:
        with connect(scheduler=address, timeout=1):
            pass
    assert f"--scheduler {address}: no dask scheduler answered within 1 s" in str(err.value)


def test_cli_scheduler_and_workers(client, local_bundle, sweep, tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "cli"\n[[grid]]\nshape = [[1, 1, 1, 2, 3, 4, 4]]\n'
                    'mask = ["none", "causal_upper_left"]\n')
    address = client.scheduler.address
    assert main(["sweep", str(spec), "--out", str(tmp_path / "a"), "--scheduler", address,
                 "--quiet"]) == 0
    assert main(["sweep", str(spec), "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    assert main(["verify", str(tmp_path / "a"), "--scheduler", address, "--quiet",
                 "--no-gradcheck"]) == 0
    capsys.readouterr()
    bad = f"tcp://127.0.0.1:{_free_port()}"
    assert main(["sweep", str(spec), "--out", str(tmp_path / "c"), "--scheduler", bad,
                 "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no dask scheduler answered within 1 s" in err
    assert main(["sweep", str(spec), "--out", str(tmp_path / "c"), "--workers", "0"]) == 2
    assert "--workers: expected a number of worker processes" in capsys.readouterr().err
