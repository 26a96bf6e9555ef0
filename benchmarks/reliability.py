"""The figures of docs/reliability.md's before/after tables, measured again (issue 40, item 5).

Every probe runs as a user runs it: one ``refattn`` command (or one short script) in a fresh
interpreter of its own, started from this small driver, which imports neither numpy nor
refattn. Each probe reports its wall seconds (from start to exit, the interpreter's start and
imports included) and its peak RSS: ``ru_maxrss`` of that child alone, from ``os.wait4``
(the per-child form of ``getrusage(RUSAGE_CHILDREN)``; Linux folds the parent's own peak into
a child's at ``exec``, so the driver's peak is printed too: every figure is at least that).
The outcome (the verdict, or the first words of the one-line error) is printed next to it.

The probes (issue 25), each at the issue's full size:

1. a 2 GiB sparse case file whose manifest claims ``q`` is ``[1, 1, 16384, 16384]`` (2 GiB of
   float64) while the file keeps its honest small header (a hole up to 2 GiB):
   ``refattn verify DIR``, ``refattn compare FILE CANDIDATE``, ``refattn diagnostics FILE``;
2. a 2 GiB sparse case file whose own header claims that ``q`` too (a consistent header,
   zeros for data), with the same manifest: the same three commands;
3. ``AttentionCall`` with a bias ``np.broadcast_to(0., (1, 1, 32768, 32768))`` (then
   ``forward`` refuses it naming the bytes), and with ``visible=np.broadcast_to(True,
   (1, 1, 65536, 65536))``;
4. ``refattn sweep big.toml`` of a case needing 3.2 TiB (refused before any tensor is drawn).

The bundle is the contract suite's Loop 7 case (bias, padding, an explicit head map), as in
``tests/hostile/test_hostile_inputs.py``, which runs probes 1 and 2 at a quarter of this size.
The files are sparse: they take no disk space, and reading a hole costs no disk I/O.

Usage::

    python3 benchmarks/reliability.py              # every probe, 3 runs each (about 5 minutes)
    python3 benchmarks/reliability.py --runs 1     # one run each
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import cpu_model  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parents[1]
LOOP7 = "loop7_cross_attention_padded_source"
#: the shape the manifest (and in probe 2 the header) claims for q: 2 GiB of float64
CLAIM = [1, 1, 16384, 16384]

#: writes the one-case bundle DIR/hole and DIR/header (probes 1 and 2) and DIR/candidate
BUILD = f"""
import json, shutil, sys
from pathlib import Path
import numpy as np
import refattn
from safetensors.numpy import save
from refattn.bundle import write_bundle
from refattn.bundle.suites import build_suite

root = Path(sys.argv[1])
case = [c for c in build_suite("contract") if c.case_id == {LOOP7!r}]
write_bundle(root / "hole", case, suite="contract", progress=False)
shutil.copytree(root / "hole", root / "header")
shape = {CLAIM!r}
size = 8 * int(np.prod(shape))
for name in ("hole", "header"):
    manifest = json.loads((root / name / "manifest.json").read_text())
    manifest["cases"][{LOOP7!r}]["tensors"]["q"]["shape"] = shape
    (root / name / "manifest.json").write_text(json.dumps(manifest))
    path = root / name / "cases" / {LOOP7 + ".safetensors"!r}
    if name == "hole":  # the honest small header, then a hole up to 2 GiB
        with open(path, "r+b") as fh:
            fh.truncate(size)
    else:  # a header that claims the 2 GiB q itself, zeros (a hole) for its data
        meta = {{"case_id": {LOOP7!r}, "tensors": {{"q": "0" * 64}}}}
        head = json.dumps({{"q": {{"dtype": "F64", "shape": shape, "data_offsets": [0, size]}},
                           "__metadata__": {{"refattn": json.dumps(meta)}}}}).encode()
        head += b" " * (-len(head) % 8)
        with open(path, "wb") as fh:
            fh.write(len(head).to_bytes(8, "little") + head)
            fh.truncate(8 + len(head) + size)
out = refattn.forward(case[0].call).output  # an honest candidate
(root / "candidate.safetensors").write_bytes(save({{"output": np.array(out)}}))
"""

#: probe 3: the broadcast bias (then forward), or the broadcast mask
BROADCAST = """
import sys
import numpy as np, refattn
if sys.argv[1] == "bias":
    q = np.zeros((1, 1, 32768, 4))
    call = refattn.AttentionCall(q, q, q, bias=np.broadcast_to(np.zeros(1), (1, 1, 32768, 32768)))
    try:
        refattn.forward(call)
        print("forward accepted")
    except refattn.RefAttnError as exc:
        print("accepted; forward refused:", str(exc)[:60])
else:
    x = np.zeros((1, 1, 65536, 2))
    refattn.AttentionCall(x, x, x, visible=np.broadcast_to(np.True_, (1, 1, 65536, 65536)))
    print("accepted (a view)")
"""

BIG_SPEC = 'name = "big"\n[[case]]\nshape = [8, 64, 64, 2048, 2048, 64, 64]\n'


def environment() -> str:
    cpu = cpu_model()
    try:
        mem = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
        memory = f"{int(mem) / 2**20:.1f} GiB memory"
    except (OSError, StopIteration):
        memory = "memory ?"
    return (f"CPU {cpu}, {os.cpu_count()} cores, {memory}; Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def measure(argv: list[str], cwd: Path) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes, exit code, the first line of its output) of one fresh
    process running ``argv``."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "REFATTN_QUIET": "1"})
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    # the verdict line of verify, else the first line (a one-line error, or a script's answer)
    lines = [line for line in text.splitlines() if line.strip()]
    shown = next((line for line in lines if line in ("PASS", "FAIL")), lines[0] if lines else "")
    problem = next((line.strip() for line in lines if "FAIL" in line and "q" in line
                    and line.strip() not in ("PASS", "FAIL")), "")
    if shown == "FAIL" and problem:
        shown = f"FAIL: {problem}"
    return seconds, usage.ru_maxrss * 1024, proc.returncode, shown


def report(name: str, runs: list[tuple[float, int, int, str]]) -> None:
    secs = [r[0] for r in runs]
    peaks = [r[1] for r in runs]
    codes = sorted({r[2] for r in runs})
    spread = f" ({min(secs):.2f}-{max(secs):.2f})" if len(runs) > 1 else ""
    print(f"  {name}: {statistics.median(secs):.2f} s{spread}, peak RSS "
          f"{max(peaks) / 2**30:.3f} GiB ({max(peaks) / 2**20:.0f} MiB), exit "
          f"{'/'.join(map(str, codes))} [{load()}]")
    print(f"      {runs[-1][3][:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per probe")
    args = parser.parse_args()
    py = sys.executable
    cli = [py, "-m", "refattn"]
    print(environment())
    print(f"start: {load()}")
    root = Path(tempfile.mkdtemp(prefix="refattn-reliability-"))
    try:
        t0 = time.perf_counter()
        subprocess.run([py, "-c", BUILD, str(root)], check=True, cwd=ROOT)
        used = sum(f.stat().st_blocks for f in root.rglob("*") if f.is_file()) * 512
        print(f"fixtures built in {time.perf_counter() - t0:.1f} s under {root} (sparse: "
              f"{used / 2**20:.1f} MiB on disk)")
        for name, what in (("hole", "manifest claims q is 2 GiB, honest small header"),
                           ("header", "the file's own header claims that q too")):
            file = root / name / "cases" / f"{LOOP7}.safetensors"
            print(f"\n2 GiB sparse case file ({file.stat().st_size} bytes), {what}:")
            probes = [("verify", [*cli, "verify", str(root / name), "--quiet"]),
                      ("compare", [*cli, "compare", str(file),
                                   str(root / "candidate.safetensors")]),
                      ("diagnostics", [*cli, "diagnostics", str(file)])]
            for label, argv in probes:
                report(label, [measure(argv, root) for _ in range(args.runs)])
        print("\nbroadcast inputs stay views:")
        report("AttentionCall(bias=np.broadcast_to(0., (1,1,32768,32768))), then forward",
               [measure([py, "-c", BROADCAST, "bias"], root) for _ in range(args.runs)])
        report("AttentionCall(visible=np.broadcast_to(True, (1,1,65536,65536)))",
               [measure([py, "-c", BROADCAST, "visible"], root) for _ in range(args.runs)])
        (root / "big.toml").write_text(BIG_SPEC)
        print("\na SPEC whose one case needs 3.2 TiB:")
        report("refattn sweep big.toml --out big",
               [measure([*cli, "sweep", "big.toml", "--out", "big", "--quiet"], root)
                for _ in range(args.runs)])
        print("\nbaseline: the interpreter with refattn imported")
        report("python -c 'import refattn'",
               [measure([py, "-c", "import refattn"], root) for _ in range(args.runs)])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nend: {load()}; this driver's own peak RSS {driver / 2**20:.0f} MiB (a floor of "
          "every child's figure)")


if __name__ == "__main__":
    main()
