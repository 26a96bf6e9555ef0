"""The C++ header and C API (refattn/include) built with cmake + ninja and run (issue 44).

Builds tests/cpp/CMakeLists.txt into a temporary folder with the venv's cmake and ninja first
(pip packages ``cmake``, ``ninja``), then the system's; runs the C++ tests (NIST SHA-256
vectors, the JSON parser, the safetensors bounds, a host kernel over the conformance bundle
with planted bugs), the C test, and the cross-checks against refattn's Python reader and
comparison: the same verdict and the same worst element on every conformance case and a set
of mutated candidates (float64, and float32 with the yardsticks of
:func:`refattn.bundle.native.yardsticks`), and the same refusals on a malformed-bundle corpus
(the mutations of tests/bundle/test_fuzz_reader.py, seeded, plus header attacks re-sealed so
that only the header's bounds can refuse them). Skipped where no C++ compiler, cmake or ninja
is found, except when the environment variable CI is set: then it fails.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from refattn.bundle.comparison.harness import compare
from refattn.bundle.comparison.tolerances import resolve_dtype
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.native import include_dir, yardsticks
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.read import load
from refattn.errors import RefAttnError
from tests.bundle.test_fuzz_reader import _paths

HERE = Path(__file__).resolve().parent
#: the case the malformed corpus mutates (as tests/bundle/test_fuzz_reader.py does)
LOOP7 = "loop7_cross_attention_padded_source"


def _which(name: str) -> str | None:
    """``name`` from the running venv's bin folder first, then from PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def _need(what: str, path: str | None) -> str:
    if path is None:
        message = f"{what} not found (venv bin, then PATH)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, so the C++ tests may not be skipped "
                        "(pip install cmake ninja; apt-get install g++)")
        pytest.skip(message)
    return path


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def _build(build_dir: Path, cxx: str, cc: str) -> Path:
    cmake = _need("cmake", _which("cmake"))
    ninja = _need("ninja", _which("ninja"))
    configure = _run([cmake, "-G", "Ninja", "-S", str(HERE), "-B", str(build_dir),
                      f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DCMAKE_CXX_COMPILER={cxx}",
                      f"-DCMAKE_C_COMPILER={cc}", f"-DREFATTN_INCLUDE={include_dir()}"])
    assert configure.returncode == 0, configure.stdout + configure.stderr
    built = _run([cmake, "--build", str(build_dir), "-j", "1"])
    assert built.returncode == 0, built.stdout + built.stderr
    return build_dir


@pytest.fixture(scope="module")
def gxx_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = _need("a C++ compiler (g++ or c++)", shutil.which("g++") or shutil.which("c++"))
    cc = _need("a C compiler (gcc or cc)", shutil.which("gcc") or shutil.which("cc"))
    return _build(tmp_path_factory.mktemp("gxx"), cxx, cc)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The conformance suite written by the project's own command (exact, a few seconds)."""
    out = tmp_path_factory.mktemp("golden") / "conformance"
    done = _run([sys.executable, "-m", "refattn", "golden", "--suite", "conformance", "--out",
                 str(out), "--quiet"])
    assert done.returncode == 0, done.stderr
    return out


def _tool(build: Path, jobs: list[list[str]], tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "jobs.tsv"
    path.write_text("".join("\t".join(job) + "\n" for job in jobs))
    done = _run([str(build / "refattn_tool"), str(path)])
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == len(jobs)
    return rows


def test_a_missing_compiler_skips_here_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="g\\+\\+ not found"):
        _need("g++", None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        _need("g++", None)
    assert _need("g++", "/usr/bin/g++") == "/usr/bin/g++"


def test_the_venv_tools_come_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    for name in ("python", "cmake"):
        (venv_bin / name).write_text("#!/bin/sh\n")
        (venv_bin / name).chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert _which("cmake") == str(venv_bin / "cmake")
    assert _which("sh") == shutil.which("sh")  # not in the venv: PATH's


# -- the C++ and C tests -----------------------------------------------------------------------
def test_cpp_suite(gxx_build: Path, bundle: Path, tmp_path: Path) -> None:
    done = _run([str(gxx_build / "refattn_tests"), str(bundle), str(tmp_path)])
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr
    assert "PASS: 0 of" in done.stdout
    for planted in ("planted wrong scale", "planted causal triangle",
                    "refused planted flipped tensor byte", "refused planted header offset"):
        assert planted in done.stdout


def test_c_api(gxx_build: Path, bundle: Path) -> None:
    done = _run([str(gxx_build / "c_api_test"), str(bundle)])
    print(done.stdout)
    assert done.returncode == 0 and "PASS: 0 failure(s)" in done.stdout, done.stdout + done.stderr


def _clang() -> tuple[str, str] | None:
    """clang++ and clang, or a versioned pair (Debian's clang-14 installs clang++-14)."""
    if shutil.which("clang++") and shutil.which("clang"):
        return str(shutil.which("clang++")), str(shutil.which("clang"))
    for cxx in sorted(Path("/usr/bin").glob("clang++-*"), reverse=True):
        cc = cxx.with_name(cxx.name.replace("clang++", "clang"))
        if cc.is_file():
            return str(cxx), str(cc)
    return None


def test_clang_builds_and_passes(tmp_path: Path, bundle: Path) -> None:
    found = _clang()
    if found is None:
        pytest.skip("clang++ not installed (g++ is the required compiler)")
    cxx, cc = found
    build = _build(tmp_path / "clang", cxx, cc)
    done = _run([str(build / "refattn_tests"), str(bundle), str(tmp_path)])
    assert done.returncode == 0, done.stdout[-4000:]


def test_nvcc_compiles_the_header(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
    if nvcc is None:
        pytest.skip("nvcc not installed (the CUDA check needs the toolkit, not a GPU)")
    done = _run([nvcc, "-std=c++17", f"-I{include_dir()}", "-Xcompiler",
                 "-Wall,-Wextra,-Werror", "-c", str(HERE / "cuda_header.cu"), "-o",
                 str(tmp_path / "cuda_header.o")])
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "cuda_header.o").stat().st_size > 0


# -- cross-check: the same verdict and worst element as refattn compare ---------------------------
def _mutations(out: np.ndarray, rng: random.Random) -> list[tuple[str, np.ndarray]]:
    """The golden output and candidates with bugs of a known size at seeded positions."""
    flat = out.size
    found: list[tuple[str, np.ndarray]] = [("golden", out.copy())]
    if flat == 0:
        return found
    i = rng.randrange(flat)
    def bump(x: np.ndarray) -> None:
        x.reshape(-1)[i] += 1e-6

    for label, change in (
            ("1e-6 at one element", bump),
            ("within tolerance", lambda x: x.__imul__(1 + 1e-12)),
            ("relative 1e-9", lambda x: x.__imul__(1 + 1e-9)),
            ("NaN at one element", lambda x: x.reshape(-1).__setitem__(i, np.nan)),
            ("inf at one element", lambda x: x.reshape(-1).__setitem__(i, np.inf)),
            ("sign flipped", lambda x: x.__imul__(-1.0)),
            ("rows swapped", lambda x: x.__setitem__(Ellipsis, x[..., ::-1, :]))):
        c = out.copy()
        change(c)
        found.append((label, c))
    return found


def _same(py: Any, cpp: dict[str, Any], label: str) -> list[str]:
    """What differs between the Python TensorReport and the C++ one."""
    cpp_index = None if cpp["worst_index"] is None else tuple(cpp["worst_index"])

    def num(x: Any) -> float:
        return float(x) if not isinstance(x, str) else float(x.replace("inf", "Infinity")
                                                             if x != "nan" else "nan")

    diffs = []
    if py.passed != cpp["passed"]:
        diffs.append(f"{label}: verdict python {py.passed} c++ {cpp['passed']}: {cpp['reason']}")
    if py.worst_index != cpp_index:
        diffs.append(f"{label}: worst index python {py.worst_index} c++ {cpp_index}")
    for field in ("worst_candidate", "worst_golden", "max_abs_error", "bound"):
        a, b = float(getattr(py, field)), num(cpp[field])
        if not (a == b or (np.isnan(a) and np.isnan(b))):
            diffs.append(f"{label}: {field} python {a!r} c++ {b!r}")
    if py.failing_count != cpp["failing_count"]:
        diffs.append(f"{label}: failing python {py.failing_count} c++ {cpp['failing_count']}")
    return diffs


def test_cross_check_float64(gxx_build: Path, bundle: Path, tmp_path: Path) -> None:
    rng = random.Random(44)
    jobs, expected = [], []
    t0 = time.perf_counter()
    manifest = check_schema(read_manifest(bundle / "manifest.json"))  # read once
    cases = list(manifest["cases"])
    for case in cases:
        # the float64 rule needs no call: the golden's tensors (read with every checksum)
        # stand for the case, without rebuilding its call (half a second a case)
        golden = dict(load(bundle / "cases" / f"{case}.safetensors", manifest=manifest).tensors)
        out = np.asarray(golden["output"], dtype=np.float64)
        for k, (label, cand) in enumerate(_mutations(out, rng)):
            path = tmp_path / f"{case}.{k}.safetensors"
            path.write_bytes(save({"output": np.ascontiguousarray(cand)}))
            jobs.append(["compare", str(bundle), case, "output", str(path), "float64", "-"])
            expected.append((f"{case} {label}", compare({"output": cand}, golden,
                                                         dtype="float64")["output"]))
    t1 = time.perf_counter()
    rows = _tool(gxx_build, jobs, tmp_path)
    t2 = time.perf_counter()
    diffs = [d for (label, py), cpp in zip(expected, rows, strict=True)
             for d in _same(py, cpp, label)]
    failing = sum(not py.passed for _, py in expected)
    print(f"float64 cross-check: {len(jobs)} candidates ({failing} failing) on "
          f"{len(cases)} cases, {len(diffs)} disagreements; python {t1 - t0:.2f} s, "
          f"c++ (one process) {t2 - t1:.2f} s")
    assert failing >= len(jobs) // 2  # the mutations do fail
    assert not diffs, "\n".join(diffs[:20])


#: dot-family cases of the float32 cross-check (the yardstick is the naive algorithm's run)
FLOAT32_CASES = ("self_attention_basic", "causal_square", "gqa_hq8_hkv2_causal",
                 "alibi_causal", "softcap_5", "sink_per_head", "dropout_philox",
                 "key_padding_lengths_7_5_2", "large_logits_positive", "query_valid_sanitize")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cross_check_lower_precision(gxx_build: Path, bundle: Path, tmp_path: Path,
                                     dtype: str) -> None:
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    cases = FLOAT32_CASES if dtype == "float32" else FLOAT32_CASES[:4]
    specs = [case_spec(bundle / "cases" / f"{c}.safetensors") for c in cases]
    yard = tmp_path / "yardsticks.json"  # written by the command users run
    done = _run([sys.executable, "-m", "refattn", "yardstick", str(bundle), "--dtype", dtype,
                 "--names", "output", "--out", str(yard)])
    assert done.returncode == 0, done.stderr
    written = json.loads(yard.read_text())["cases"]
    assert {c: written[c] for c in cases} == yardsticks(specs, dtype)["cases"]
    lp = resolve_dtype(dtype)
    rng = np.random.default_rng(44)
    jobs, expected = [], []
    for spec in specs:
        out = np.asarray(spec.tensors["output"], dtype=np.float64)
        bound = compare({"output": out.astype(lp)}, spec, dtype=dtype)["output"].bound
        # candidates held as float32 values of the dtype (what the header's float overload
        # takes), written as float32 for both readers
        candidates = {
            f"golden in {dtype}": out.astype(lp),
            "noise at half the bound": (out + rng.uniform(-0.5, 0.5, out.shape) * bound
                                        ).astype(lp),
            "noise at twice the bound": (out + rng.choice([-2.0, 2.0], out.shape) * bound
                                         ).astype(lp),
            "scaled 1.01": (out * 1.01).astype(lp),
        }
        candidates = {k: v.astype(np.float32) for k, v in candidates.items()}
        for k, (label, cand) in enumerate(candidates.items()):
            path = tmp_path / f"{spec.case_id}.{k}.safetensors"
            path.write_bytes(save({"output": np.ascontiguousarray(cand)}))
            jobs.append(["compare", str(bundle), spec.case_id, "output", str(path), dtype,
                         str(yard)])
            expected.append((f"{spec.case_id} {label}",
                             compare({"output": cand}, spec, dtype=dtype)["output"]))
    if dtype == "float32":  # the yardsticks stored by `refattn golden --with-yardsticks`
        embedded = tmp_path / "embedded"
        done = _run([sys.executable, "-m", "refattn", "golden", "--suite", "conformance",
                     "--out", str(embedded), "--quiet", "--with-yardsticks", "float32"])
        assert done.returncode == 0, done.stderr
        manifest = check_schema(read_manifest(embedded / "manifest.json"))  # Python reads it
        for c in cases:  # the same case files, and the file's numbers for their output
            assert (embedded / "cases" / f"{c}.safetensors").read_bytes() == (
                bundle / "cases" / f"{c}.safetensors").read_bytes()
            assert manifest["cases"][c]["yardsticks"]["float32"]["output"] == written[c][
                "float32"]["output"]
        extra = [[*job[:1], str(embedded), *job[2:6], "-"] for job in jobs]
        jobs += extra
        expected += [(f"{label} (manifest yardsticks)", py) for label, py in expected]
    rows = _tool(gxx_build, jobs, tmp_path)
    diffs = [d for (label, py), cpp in zip(expected, rows, strict=True)
             for d in _same(py, cpp, label)]
    verdicts = [py.passed for _, py in expected]
    print(f"{dtype} cross-check: {len(jobs)} candidates ({verdicts.count(False)} failing), "
          f"{len(diffs)} disagreements")
    assert 0 < verdicts.count(False) < len(verdicts)
    assert not diffs, "\n".join(diffs[:20])


# -- the malformed-bundle corpus -----------------------------------------------------------------
def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict[str, Any] | str, body: bytes) -> bytes:
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def _last(header: dict[str, Any]) -> str:
    names = [n for n in header if n != "__metadata__"]
    return max(names, key=lambda n: header[n]["data_offsets"][0])


def _first(header: dict[str, Any]) -> str:
    names = [n for n in header if n != "__metadata__"]
    return min(names, key=lambda n: header[n]["data_offsets"][0])


def _attack(edit: Callable[[dict[str, Any], bytes], bytes]) -> Callable[[bytes], bytes]:
    def run(data: bytes) -> bytes:
        header, body = _split(data)
        return edit(copy.deepcopy(header), body)
    return run


def _offsets(name_of: Callable[[dict[str, Any]], str], da: int, db: int
             ) -> Callable[[dict[str, Any], bytes], bytes]:
    def edit(h: dict[str, Any], body: bytes) -> bytes:
        a, b = h[name_of(h)]["data_offsets"]
        h[name_of(h)]["data_offsets"] = [a + da, b + db]
        return _join(h, body)
    return edit


def _shape(h: dict[str, Any], body: bytes) -> bytes:
    h[_last(h)]["shape"][-1] += 1
    return _join(h, body)


def _dtype(h: dict[str, Any], body: bytes) -> bytes:
    h[_last(h)]["dtype"] = "F8_E4M3"
    return _join(h, body)


def _duplicate(h: dict[str, Any], body: bytes) -> bytes:
    name = _first(h)
    text = json.dumps(h, separators=(",", ":"))
    extra = json.dumps({name: h[name]}, separators=(",", ":"))[1:-1]
    return _join(text[:-1] + "," + extra + "}", body)


def _overlap(h: dict[str, Any], body: bytes) -> bytes:
    first, last = _first(h), _last(h)
    size = h[last]["data_offsets"][1] - h[last]["data_offsets"][0]
    start = h[first]["data_offsets"][0]
    h[last]["data_offsets"] = [start, start + size]
    return _join(h, body)


#: header attacks, re-sealed (the manifest's file sha256 updated) so that only the header's
#: bounds refuse them; each with the words the C++ refusal must hold (file, tensor, limit)
ATTACKS: dict[str, tuple[Callable[[bytes], bytes], tuple[str, ...]]] = {
    "header length over 100 MiB": (lambda d: (200 << 20).to_bytes(8, "little") + d[8:],
                                   ("209715200", "104857600")),
    "header length past the file": (lambda d: (len(d)).to_bytes(8, "little") + d[8:],
                                    ("truncated", "file has")),
    "offset past the file": (_attack(_offsets(_last, 16, 16)), ("past the end of the file",)),
    "shape needs more bytes": (_attack(_shape), ("needs",)),
    "unknown dtype": (_attack(_dtype), ("unsupported dtype 'F8_E4M3'",)),
    "duplicate key": (_attack(_duplicate), ("duplicate key",)),
    "overlapping tensors": (_attack(_overlap), ("gaps or overlaps",)),
    "negative offset": (_attack(_offsets(_first, -8, -8)), ("malformed data offsets",)),
    "trailing bytes": (lambda d: d + bytes(8), ("corrupt file", "end at byte")),
    "truncated data": (lambda d: d[:-8], ("past the end of the file",)),
    "header not an object": (lambda d: _join("[1,2]", _split(d)[1]), ("not a JSON object",)),
    "header not UTF-8": (lambda d: d[:9] + b"\xff" + d[10:], ("not UTF-8", "0xff")),
}


def _fuzzed(data: bytes, rng: random.Random) -> bytes:
    """One mutation of tests/bundle/test_fuzz_reader.py (flip, truncate, splice, random)."""
    b = bytearray(data)
    kind = rng.choice(["flip", "truncate", "splice", "random"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= rng.randint(1, 255)
    elif kind == "truncate":
        b = b[:rng.randrange(len(b))]
    elif kind == "splice":
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    else:
        b = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    return bytes(b)


def test_malformed_corpus_is_refused_by_both(gxx_build: Path, bundle: Path,
                                            tmp_path: Path) -> None:
    pristine = (bundle / "cases" / f"{LOOP7}.safetensors").read_bytes()
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["cases"] = {LOOP7: manifest["cases"][LOOP7]}
    rng = random.Random(16)
    corpus: list[tuple[str, bytes, tuple[str, ...], bool]] = [
        (name, attack(pristine), words, True) for name, (attack, words) in ATTACKS.items()]
    corpus += [(f"fuzzed {k}", _fuzzed(pristine, rng), (), False) for k in range(60)]
    jobs, dirs = [], []
    for k, (_, data, _, reseal) in enumerate(corpus):
        d = tmp_path / f"b{k}"
        (d / "cases").mkdir(parents=True)
        m = copy.deepcopy(manifest)
        if reseal:
            m["cases"][LOOP7]["sha256"] = hashlib.sha256(data).hexdigest()
        (d / "manifest.json").write_text(json.dumps(m))
        (d / "cases" / f"{LOOP7}.safetensors").write_bytes(data)
        jobs.append(["load", str(d), LOOP7])
        dirs.append(d)
    rows = _tool(gxx_build, jobs, tmp_path)
    problems = []
    for (name, data, words, _), d, row in zip(corpus, dirs, rows, strict=True):
        try:
            load(d / "cases" / f"{LOOP7}.safetensors")
            python_refuses = False
        except RefAttnError:
            python_refuses = True
        if data == pristine:
            continue  # a mutation that changed nothing (e.g. a splice of no bytes)
        if python_refuses and row["ok"]:
            problems.append(f"{name}: refused by Python, accepted by the header")
        if not python_refuses:
            problems.append(f"{name}: accepted by Python (not a malformed file)")
        if not row["ok"]:
            message = row["error"]
            for word in (f"{LOOP7}.safetensors", *words):
                if word not in message:
                    problems.append(f"{name}: the refusal lacks {word!r}: {message}")
        if words and "tensor '" not in row.get("error", "") and name not in (
                "header length over 100 MiB", "header length past the file", "trailing bytes",
                "header not an object", "header not UTF-8", "duplicate key"):
            problems.append(f"{name}: the refusal names no tensor: {row.get('error')}")
    print(f"malformed corpus: {len(corpus)} files, {len(problems)} problems")
    for (name, _, _, _), row in list(zip(corpus, rows, strict=True))[:len(ATTACKS)]:
        print(f"  {name}: {row.get('error')}")
    assert not problems, "\n".join(problems[:20])


#: a well-formed yardstick record (the malformed ones of _manifest_mutations change one part)
YARD = {"reference_error": {"hex": "0x1.0p-20", "decimal": "9.5367431640625e-07"},
        "natural_magnitude": {"hex": "0x1.0p+0", "decimal": "1.0"}}


def _manifest_mutations(manifest: dict[str, Any], rng: random.Random
                        ) -> list[tuple[str, bytes]]:
    """Manifests the Python reader refuses, in the fields the header checks (the schema name
    and version, the cases object, each entry's file, sha256s, tensor records), plus
    arbitrary bytes and JSON documents (tests/bundle/test_fuzz_reader.py's second test)."""
    entry = manifest["cases"][LOOP7]
    tensor = sorted(entry["tensors"])[0]
    edits: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("schema", lambda m: m.__setitem__("schema", "other")),
        ("schema_version 2.0", lambda m: m.__setitem__("schema_version", "2.0")),
        ("schema_version missing", lambda m: m.pop("schema_version")),
        ("cases a list", lambda m: m.__setitem__("cases", [])),
        ("file outside cases/", lambda m: m["cases"][LOOP7].__setitem__("file", "../x")),
        ("file absolute", lambda m: m["cases"][LOOP7].__setitem__("file", "/etc/passwd")),
        ("sha256 upper case", lambda m: m["cases"][LOOP7].__setitem__(
            "sha256", entry["sha256"].upper())),
        ("sha256 missing", lambda m: m["cases"][LOOP7].pop("sha256")),
        ("tensor dtype", lambda m: m["cases"][LOOP7]["tensors"][tensor].__setitem__(
            "dtype", "float32")),
        ("tensor shape negative", lambda m: m["cases"][LOOP7]["tensors"][tensor].__setitem__(
            "shape", [-1])),
        ("tensor shape of 9 axes", lambda m: m["cases"][LOOP7]["tensors"][tensor].__setitem__(
            "shape", [1] * 9)),
        ("tensor name", lambda m: m["cases"][LOOP7]["tensors"].__setitem__(
            "bad name", entry["tensors"][tensor])),
        ("case id", lambda m: m["cases"].__setitem__("bad/id", entry)),
        ("call missing", lambda m: m["cases"][LOOP7].pop("call")),
        ("flags an object", lambda m: m["cases"][LOOP7].__setitem__("flags", {})),
        # the yardsticks `refattn golden --with-yardsticks` stores (manifest-v1.json)
        ("yardsticks of float64", lambda m: m["cases"][LOOP7].__setitem__(
            "yardsticks", {"float64": {"output": YARD}})),
        ("yardstick negative", lambda m: m["cases"][LOOP7].__setitem__(
            "yardsticks", {"float32": {"output": {**YARD, "reference_error": {
                "hex": "-0x1.0p-20"}}}})),
        ("yardstick without natural_magnitude", lambda m: m["cases"][LOOP7].__setitem__(
            "yardsticks", {"float32": {"output": {"reference_error": {"hex": "0x1.0p-20"}}}})),
        ("yardstick of a bad tensor name", lambda m: m["cases"][LOOP7].__setitem__(
            "yardsticks", {"float32": {"out put": YARD}})),
    ]
    out = []
    for name, edit in edits:
        m = copy.deepcopy(manifest)
        edit(m)
        out.append((name, json.dumps(m).encode()))
    text = json.dumps(manifest).encode()
    out.append(("duplicate key", text[:-1] + b', "schema": "refattn_golden"}'))
    out.append(("NaN", text.replace(b'"schema_version"', b'"x": NaN, "schema_version"', 1)))
    out.append(("not UTF-8", b"\xff" + text))
    out.append(("nested 10000 deep", b"[" * 10000 + b"]" * 10000))
    for k in range(20):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
        out.append((f"random bytes {k}", raw))
    paths = sorted(_paths(manifest), key=repr)
    values: list[Any] = [None, True, -1, 2**70, 0.5, "", "x", "/etc/passwd", "2.0", [], {},
                         [1, 2], {"a": 1}, "0x1.0p+0"]
    for k in range(80):  # tests/bundle/test_fuzz_reader.py's first test, seeded
        m = copy.deepcopy(manifest)
        path = rng.choice(paths)
        if not path:
            continue
        node = m
        for key in path[:-1]:
            node = node[key]
        if rng.random() < 0.3:
            del node[path[-1]]
        else:
            node[path[-1]] = copy.deepcopy(rng.choice(values))
        out.append((f"mutated {k} at {'/'.join(map(str, path))[-60:]}", json.dumps(m).encode()))
    return out


def test_malformed_manifests_are_refused_by_both(gxx_build: Path, bundle: Path,
                                                 tmp_path: Path) -> None:
    pristine = json.loads((bundle / "manifest.json").read_text())
    pristine["cases"] = {LOOP7: pristine["cases"][LOOP7]}
    case_bytes = (bundle / "cases" / f"{LOOP7}.safetensors").read_bytes()
    corpus = _manifest_mutations(pristine, random.Random(44))
    jobs = []
    for k, (_, raw) in enumerate(corpus):
        d = tmp_path / f"m{k}"
        (d / "cases").mkdir(parents=True)
        (d / "manifest.json").write_bytes(raw)
        (d / "cases" / f"{LOOP7}.safetensors").write_bytes(case_bytes)
        jobs.append(["load", str(d), LOOP7])
    rows = _tool(gxx_build, jobs, tmp_path)
    problems, refused, stricter = [], 0, []
    for k, ((name, _), row) in enumerate(zip(corpus, rows, strict=True)):
        try:
            load(tmp_path / f"m{k}" / "cases" / f"{LOOP7}.safetensors")
        except RefAttnError:
            refused += 1
            if row["ok"]:
                problems.append(f"{name}: refused by Python, accepted by the header")
            elif "manifest.json" not in row["error"] and not (  # a record the file
                    f"{LOOP7}.safetensors" in row["error"]  # contradicts: both named
                    and "the manifest lists" in row["error"]):
                problems.append(f"{name}: the refusal does not name manifest.json: "
                                f"{row['error']}")
            continue
        if not name.startswith("mutated"):
            problems.append(f"{name}: accepted by Python (not a malformed manifest)")
        elif not row["ok"]:  # a field the Python reader does not read: the header may be
            stricter.append(f"{name}: {row['error'][-120:]}")  # stricter (a hex float)
    print(f"malformed manifests: {len(corpus)}, {refused} refused by Python, {len(problems)} "
          f"problems; refused by the header alone: {len(stricter)}")
    for line in stricter:
        print("  " + line)
    assert not problems, "\n".join(problems[:20])


def test_the_embedded_schema_is_the_packages() -> None:
    header = (include_dir() / "refattn.hpp").read_text()
    start = header.index('R"refattn_schema(') + len('R"refattn_schema(')
    embedded = header[start:header.index(')refattn_schema"')]
    packaged = (include_dir().parent / "bundle" / "schema" / "manifest-v1.json").read_text()
    assert embedded == packaged, "refattn.hpp's copy of manifest-v1.json is stale: paste it again"
