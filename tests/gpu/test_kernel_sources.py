"""The CUDA sources: the ABI tables agree with the host, the Philox header is bit-identical to
refattn.dropout in host C++, and every kernel compiles for sm_90 and sm_80 without spills or
warnings (nvcc, or NVRTC where nvcc is absent)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from gpu_backend import abi
from gpu_backend.compile_check import ARCHES, compile_report, toolchain
from gpu_backend.source import EXP_TABLE_DOUBLES, KERNEL_DIR, KERNELS
from refattn.dropout import Philox
from refattn.dropout.philox import philox4x32_10
from tests.dropout.test_philox import _kat_rows

COMMON = (KERNEL_DIR / "common.cuh").read_text()


def _enum(name: str, prefix: str) -> tuple[str, ...]:
    body = re.search(rf"enum {name} \{{(.*?)\}};", COMMON, flags=re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == f"{prefix}COUNT"
    return tuple(n.removeprefix(prefix) for n in names[:-1])


@pytest.mark.parametrize(("enum", "prefix", "table"), [
    ("RefattnPtr", "X_", abi.POINTERS), ("RefattnInt", "P_", abi.INT_PARAMS),
    ("RefattnReal", "R_", abi.REAL_PARAMS)])
def test_the_host_tables_match_the_kernel_enums(enum, prefix, table):
    assert _enum(enum, prefix) == table


def test_every_exported_kernel_is_known_to_the_launcher():
    src = (KERNEL_DIR / "attention.cu").read_text()
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', src))
    exported = set(re.findall(r"^REFATTN_EXPORT\((\w+)\)", src, flags=re.M))
    assert defined == exported == set(KERNELS)


HOST_PROGRAM = r"""
#include <cstdio>
#include "philox.cuh"
int main() {
    unsigned c0, c1, c2, c3, k0, k1;
    while (std::scanf("%u %u %u %u %u %u", &c0, &c1, &c2, &c3, &k0, &k1) == 6) {
        RefattnWords w{{c0, c1, c2, c3}};
        RefattnWords r = refattn_philox4x32_10(w, k0, k1);
        std::printf("%u %u %u %u\n", r.w[0], r.w[1], r.w[2], r.w[3]);
    }
    return 0;
}
"""

KEEP_PROGRAM = r"""
#include <cstdio>
#include "philox.cuh"
int main(int argc, char** argv) {
    long long B, H, Q, K; unsigned k0, k1, off; unsigned long long thr;
    std::sscanf(argv[1], "%lld", &B); std::sscanf(argv[2], "%lld", &H);
    std::sscanf(argv[3], "%lld", &Q); std::sscanf(argv[4], "%lld", &K);
    std::sscanf(argv[5], "%u", &k0); std::sscanf(argv[6], "%u", &k1);
    std::sscanf(argv[7], "%u", &off); std::sscanf(argv[8], "%llu", &thr);
    for (long long b = 0; b < B; ++b) for (long long h = 0; h < H; ++h)
        for (long long i = 0; i < Q; ++i) for (long long j = 0; j < K; ++j)
            std::putchar(refattn_dropout_keep(b, h, i, j, H, k0, k1, off, thr) ? '1' : '0');
    return 0;
}
"""


def _host_binary(tmp_path, name, source, *flags):
    if not shutil.which("g++"):
        pytest.skip("no g++ to build the host check")
    (tmp_path / f"{name}.cpp").write_text(source)
    exe = tmp_path / name
    subprocess.run(["g++", "-std=c++17", "-O1", *flags, "-Wall", "-Werror", f"-I{KERNEL_DIR}",
                    str(tmp_path / f"{name}.cpp"), "-o", str(exe)], check=True)
    return exe


def test_philox_header_in_host_cpp_matches_the_known_answers_and_numpy(tmp_path):
    exe = _host_binary(tmp_path, "philox", HOST_PROGRAM)
    rng = np.random.default_rng(5)
    rows = [(c, k) for c, k, _ in _kat_rows(10)]
    rows += [(list(rng.integers(0, 2**32, 4)), list(rng.integers(0, 2**32, 2)))
             for _ in range(200)]
    text = "\n".join(" ".join(str(int(x)) for x in (*c, *k)) for c, k in rows)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True)
    got = np.array([[int(x) for x in line.split()] for line in out.stdout.splitlines()],
                   dtype=np.uint32)
    counters = np.array([c for c, _ in rows], dtype=np.uint32)
    keys = np.array([k for _, k in rows], dtype=np.uint32)
    np.testing.assert_array_equal(got, philox4x32_10(counters, keys))
    for n, (_, _, expected) in enumerate(_kat_rows(10)):
        assert list(got[n]) == expected


@pytest.mark.parametrize(("p", "seed", "offset"), [(0.1, 7, 0), (0.5, 2**40 + 3, 9),
                                                   (0.9, 2**64 - 1, 2**32 - 1)])
def test_dropout_keep_mask_in_host_cpp_is_bit_identical_to_refattn(tmp_path, p, seed, offset):
    exe = _host_binary(tmp_path, "keep", KEEP_PROGRAM)
    stream = Philox(p, seed, offset=offset)
    shape = (2, 3, 5, 11)
    out = subprocess.run([str(exe), *map(str, shape), str(seed & 0xFFFFFFFF), str(seed >> 32),
                          str(offset), str(stream.threshold)], capture_output=True, text=True,
                         check=True).stdout
    got = np.frombuffer(out.encode(), dtype=np.uint8).reshape(shape) == ord("1")
    np.testing.assert_array_equal(got, stream.keep_mask(*shape))


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_compiles_without_spills_or_warnings(arch):
    if toolchain() is None:
        pytest.skip("neither nvcc nor NVRTC (nvidia-cuda-nvrtc) is installed here")
    report = compile_report(arch)
    assert set(report.kernels) == set(KERNELS)
    assert report.warnings == ()
    assert report.spills == 0, {k.kernel: (k.spill_stores, k.spill_loads)
                                for k in report.kernels.values()}
    for k in report.kernels.values():
        assert 0 < k.registers <= 255, k
        print(f"{arch} {k.kernel}: {k.registers} registers, {k.stack_bytes} B stack")
    # no stack frame in a tensor-core kernel (issue 43: refattn_mma_pb_shared's column offsets
    # indexed at run time kept a 16-byte frame, loaded and stored in the main loop, which
    # ptxas does not call a spill)
    frames = {k.kernel: k.stack_bytes for k in report.kernels.values()
              if re.match(r"attention_(forward|dq|dkdv)_", k.kernel) and k.stack_bytes}
    assert frames == {}, frames


#: common.cuh compiled as host C++ (the device intrinsics it uses, by memcpy)
COMMON_PRELUDE = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#define __device__
#define __constant__
#define __forceinline__ inline
#define REFATTN_EMULATOR  // common.cuh's CUDA macros are not needed here
static double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
static long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
using std::fabs;
using std::fma;
#include "common.cuh"
"""

DIV_PROGRAM = COMMON_PRELUDE + r"""
int main() {
    unsigned long long a, b;
    while (std::scanf("%llx %llx", &a, &b) == 2) {
        double x, y;
        std::memcpy(&x, &a, 8);
        std::memcpy(&y, &b, 8);
        const double q = refattn_div(x, y, 1.0 / y);
        unsigned long long out;
        std::memcpy(&out, &q, 8);
        std::printf("%llx\n", out);
    }
    return 0;
}
"""


def test_the_division_without_a_slow_path_is_the_correctly_rounded_quotient(tmp_path):
    """common.cuh's refattn_div(a, b, 1 / b) (the loops' division: softcap, O / l) returns
    the bits of IEEE a / b (NumPy's division) on random operands over a wide exponent range,
    on significands near all ones and on quotients near 1 (where a / (1 / b) alone is off by
    an ulp), and keeps a / b's signed zero, overflow and NaN."""
    exe = _host_binary(tmp_path, "div", DIV_PROGRAM, "-ffp-contract=off")
    rng = np.random.default_rng(24)
    n = 20000
    sig = rng.integers(0, 2**52, (4, n), dtype=np.uint64)
    sig[1] |= np.uint64(2**52 - 1) ^ (sig[1] & np.uint64(0xFF))  # near all ones
    sig[3] = sig[2] ^ (sig[3] & np.uint64(0xFFF))  # b's significand close to a's
    exp_a = rng.integers(1023 - 300, 1023 + 300, n).astype(np.uint64)
    exp_b = rng.integers(1023 - 300, 1023 + 300, n).astype(np.uint64)
    a = ((exp_a << np.uint64(52)) | sig[0]).view(np.float64)
    b = ((exp_b << np.uint64(52)) | sig[1]).view(np.float64)
    a2 = ((exp_a << np.uint64(52)) | sig[2]).view(np.float64)
    b2 = ((exp_a << np.uint64(52)) | sig[3]).view(np.float64)  # quotients near 1
    special_a = np.array([0.0, -0.0, 1e308, -1e308, np.inf, np.nan, 3.0, 1.0])
    special_b = np.array([3.0, 3.0, 1e-10, 1e-10, 2.0, 2.0, np.inf, 3.0])
    x = np.concatenate([a * np.sign(rng.standard_normal(n)), a2, special_a])
    y = np.concatenate([b, b2, special_b])
    text = "\n".join(f"{u:x} {v:x}" for u, v in zip(x.view(np.uint64), y.view(np.uint64),
                                                              strict=True))
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True)
    got = np.array([int(w, 16) for w in out.stdout.split()], dtype=np.uint64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x / y
    assert np.isnan(got.view(np.float64)).tolist() == np.isnan(want).tolist()
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok].view(np.uint64))
    # a / (1 / b) alone differs from a / b on some of these operands: the correction matters
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.count_nonzero((x * (1.0 / y))[ok] != want[ok]) > 100


#: common.cuh's two softmax exps as host C++: refattn_exp(x), or (argv[1] = "table")
#: refattn_exp_table(x, tab) from a block's copy filled as the forward fills it (128 threads),
#: each x read by lane n % 32's copy
EXP_PROGRAM = COMMON_PRELUDE + r"""
#include <cstring>
int main(int argc, char** argv) {
    const bool table = argc > 1 && std::strcmp(argv[1], "table") == 0;
    alignas(16) static double tab[REFATTN_EXP_TABLE_DOUBLES];
    for (int tid = 0; tid < 128; ++tid) refattn_exp_table_fill(tab + 0, tid, 128);
    unsigned long long a;
    for (int n = 0; std::scanf("%llx", &a) == 1; ++n) {
        double x;
        std::memcpy(&x, &a, 8);
        const double e = table ? refattn_exp_table(x, tab + 2 * (n % 32 & 7)) : refattn_exp(x);
        unsigned long long out;
        std::memcpy(&out, &e, 8);
        std::printf("%llx\n", out);
    }
    return 0;
}
"""


def _exp_bits(exe, x: np.ndarray, *args: str) -> np.ndarray:
    text = "\n".join(f"{u:x}" for u in x.view(np.uint64))
    out = subprocess.run([str(exe), *args], input=text, capture_output=True, text=True,
                         check=True)
    return np.array([int(w, 16) for w in out.stdout.split()], dtype=np.uint64).view(np.float64)


def _exp_arguments() -> np.ndarray:
    rng = np.random.default_rng(24)
    return np.concatenate([
        -rng.exponential(30.0, 40000), rng.uniform(-1e-6, 0.0, 5000),
        rng.uniform(-760.0, -700.0, 20000), rng.uniform(0.0, 709.0, 5000),
        [0.0, -0.0, -np.inf, -745.0, -745.1332191019411, -745.14, -708.39599609375,
         np.nextafter(-708.39599609375, 0.0), -707.0, np.nextafter(-707.0, 0.0), -1000.0,
         -1000.5, -1e300, 709.0]])


def _exp_ulps(exe, *args: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = _exp_arguments()
    got = _exp_bits(exe, x, *args)
    want = np.exp(x)
    return x, got, np.abs(got - want) / np.spacing(np.maximum(want, 5e-324))


@pytest.mark.parametrize("which", ["polynomial", "table"])
def test_the_branch_free_exps_are_within_one_ulp_of_numpy(tmp_path, which):
    """common.cuh's refattn_exp (CUDA's polynomial without its slow-path branch) and
    refattn_exp_table (Tang's table of 2^(j/32), the forward's exp up to D = 64 and on warp
    pairs) are within 1 ulp of NumPy's exp for x <= 709, the softmax's range (x = s - m <= 0)
    included: the subnormal results (scaled in two exact steps) and the underflow to 0
    (x < -745.13, -inf) too; most results are NumPy's bits; NaN stays NaN (a score read before
    its tile landed must show)."""
    exe = _host_binary(tmp_path, "exp", EXP_PROGRAM, "-ffp-contract=off")
    x, got, ulps = _exp_ulps(exe, which)
    want = np.exp(x)
    assert ulps.max() <= 1.0, x[np.argmax(ulps)]
    assert np.mean(got == want) > 0.9
    sub = (want > 0) & (want < 2.2250738585072014e-308)
    assert sub.sum() > 1000 and np.all(got[sub] > 0) == np.all(want[sub] > 0)
    assert np.array_equal(got[want == 0], want[want == 0])  # 0 below -745.13 and at -inf
    nan = _exp_bits(exe, np.array([np.nan]), which)
    assert np.isnan(nan[0])


def _planted_binary(tmp_path, name, program, common_text):
    """``program`` built as _host_binary does, against ``common_text`` as common.cuh."""
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "common.cuh").write_text(common_text)
    (tmp_path / "k" / "philox.cuh").write_text((KERNEL_DIR / "philox.cuh").read_text())
    if not shutil.which("g++"):
        pytest.skip("no g++ to build the host check")
    (tmp_path / f"{name}.cpp").write_text(program)
    subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Werror",
                    f"-I{tmp_path / 'k'}", str(tmp_path / f"{name}.cpp"), "-o",
                    str(tmp_path / name)], check=True)
    return tmp_path / name


@pytest.mark.parametrize(("which", "planted", "replacement"), [
    ("table", "p = fma(r, p, 1.0 / 6.0);", "p = fma(r, p, 1.0 / 6.5);"),  # a wrong coefficient
    ("table", "const double e0 = hi + fma(hi, q, lo);",
     "const double e0 = hi + fma(hi, q, 0.0 * lo);"),  # the table's low parts dropped
    ("table", "r = fma(k, -7.247021293269686e-19, r);", ""),  # ln2 / 32 without its low part
    ("table", "const bool tiny = x < -707.0;", "const bool tiny = x < -708.5;"),  # too late
    ("polynomial", "p = fma(r, p, 0.5000000000000012);", "p = fma(r, p, 0.5000000000012);"),
])
def test_a_planted_bug_in_an_exp_fails_its_check(tmp_path, which, planted, replacement):
    """What the ulp check above catches: each planted bug puts an exp more than 1 ulp from
    NumPy's or makes fewer than 90% of its results NumPy's bits."""
    assert COMMON.count(planted) == 1
    exe = _planted_binary(tmp_path, "exp", EXP_PROGRAM, COMMON.replace(planted, replacement))
    x, got, ulps = _exp_ulps(exe, which)
    assert ulps.max() > 1.0 or np.mean(got == np.exp(x)) <= 0.9


#: common.cuh's branch-free tanh as host C++: refattn_tanh_table(u, tab) from the global table
#: (refattn_exp2_32), or (argv[1] = "table") from a block's copy as the kernels fill it
TANH_PROGRAM = EXP_PROGRAM.replace(
    "const double e = table ? refattn_exp_table(x, tab + 2 * (n % 32 & 7)) : refattn_exp(x);",
    "const double e = table ? refattn_tanh_table<REFATTN_EXP_TABLE_SHARED>("
    "x, tab + 2 * (n % 32 & 7)) : refattn_tanh_table<REFATTN_EXP_TABLE_GLOBAL>(x, "
    "refattn_exp2_32);")


def _tanh_arguments() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = np.concatenate([
        rng.standard_normal(20000), rng.uniform(-25.0, 25.0, 20000),
        10.0 ** rng.uniform(-320, 0, 5000), np.linspace(0.0, 1.0, 4001),
        np.arange(1, 200) * np.log(2.0) / 64,  # reduction boundaries: j and m change
        [0.0, 1e-300, 5e-324, 19.0, 19.06, 20.0, 20.5, 709.0, 1e300, np.inf]])
    return np.concatenate([x, -x])


def test_the_branch_free_tanh_is_within_three_ulp_of_numpy_from_either_table(tmp_path):
    """common.cuh's refattn_tanh_table (the softcap's tanh in every kernel: one path for every
    lane, where CUDA's tanh branches) gives the same bits from a block's copy of the exp table
    (any lane's copy) and from the global table, so the backward recomputes the forward's
    scores exactly; it is within 3 ulp of NumPy's tanh over normal, uniform, tiny (subnormal
    included) and saturated arguments, keeps the sign and -0.0, never passes +-1 (within an ulp
    of it from |u| = 19.1 on, inf included), and gives NaN for NaN; most results are NumPy's
    bits."""
    exe = _host_binary(tmp_path, "tanh", TANH_PROGRAM, "-ffp-contract=off")
    u = _tanh_arguments()
    got = _exp_bits(exe, u, "table")
    np.testing.assert_array_equal(got.view(np.uint64), _exp_bits(exe, u).view(np.uint64))
    want = np.tanh(u)
    ulps = np.abs(got - want) / np.spacing(np.maximum(np.abs(want), 5e-324))
    assert ulps.max() <= 3.0, (u[np.argmax(ulps)], ulps.max())
    assert np.mean(got == want) > 0.6
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 included
    big = np.abs(u) >= 19.1  # tanh rounds to +-1: within an ulp below it, never past it
    assert np.all(np.abs(got) <= 1.0) and np.all(np.abs(got[big] - np.sign(u[big])) <= 2**-53)
    assert np.isnan(_exp_bits(exe, np.array([np.nan]))[0])


@pytest.mark.parametrize(("planted", "replacement"), [
    ("h = fma(r, h, 4.0 / 3.0);", "h = fma(r, h, 1.3);"),  # a wrong coefficient
    ("err = fma(err, err, err);", ""),  # one refinement short: about 2^-40
    ("const double e = fma(fma(hi, q, lo), two_m, fma(hi, two_m, -1.0));",
     "const double e = fma(fma(hi, q, 0.0 * lo), two_m, fma(hi, two_m, -1.0));"),
    ("a = a > 20.0 ? 20.0 : a;", "a = a > 2000.0 ? 2000.0 : a;"),  # 2^m overflows
    ("const double e = fma(fma(hi, q, lo), two_m, fma(hi, two_m, -1.0));",
     "const double e = two_m * (hi + fma(hi, q, lo)) - 1.0;"),  # cancels for small |u|
])
def test_a_planted_bug_in_the_tanh_fails_its_check(tmp_path, planted, replacement):
    """What the tanh check above catches: each planted bug puts the tanh more than 3 ulp from
    NumPy's (or NaN where it is finite)."""
    start = COMMON.index("double refattn_tanh_table(double u")
    end = COMMON.index("\n}\n", start)
    assert COMMON[start:end].count(planted) == 1
    exe = _planted_binary(tmp_path, "tanh", TANH_PROGRAM, COMMON[:start] + COMMON[
        start:end].replace(planted, replacement) + COMMON[end:])
    u = _tanh_arguments()
    got = _exp_bits(exe, u)
    want = np.tanh(u)
    with np.errstate(invalid="ignore"):
        ulps = np.abs(got - want) / np.spacing(np.maximum(np.abs(want), 5e-324))
    assert not np.all(ulps <= 3.0)  # (a NaN compares false)


def test_the_exp_table_is_two_to_the_j_over_32_and_its_copies_are_conflict_free(tmp_path):
    """refattn_exp2_32's pairs: hi the double nearest hi + lo, and (hi + lo)^32 within
    2^-100 of 2^j (exact rationals); the block's copy puts pair j at 16-byte slot 8 j + l for
    every copy l, so the 8 lanes of a quarter warp (lane l reading copy l % 8) hit the 8
    different 16-byte bank groups whatever their j."""
    from fractions import Fraction

    body = re.search(r"refattn_exp2_32\[64\] = \{(.*?)\};", COMMON, flags=re.S).group(1)
    values = [float.fromhex(v) for v in re.findall(r"-?0x[0-9a-fp.+-]+", body)]
    assert len(values) == 64
    for j in range(32):
        hi, lo = values[2 * j], values[2 * j + 1]
        assert 1.0 <= hi < 2.0 and abs(lo) <= np.spacing(hi) / 2, j
        err = (Fraction(hi) + Fraction(lo)) ** 32 / 2**j - 1
        assert abs(err) < Fraction(1, 2**100), (j, float(err))
    program = COMMON_PRELUDE + r"""
int main() {
    alignas(16) static double tab[REFATTN_EXP_TABLE_DOUBLES];
    for (int tid = 0; tid < 128; ++tid) refattn_exp_table_fill(tab + 0, tid, 128);
    for (int k = 0; k < REFATTN_EXP_TABLE_DOUBLES; ++k) std::printf("%a\n", tab[k]);
    return 0;
}
"""
    exe = _host_binary(tmp_path, "table", program)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    tab = np.array([float.fromhex(v) for v in out]).reshape(32, 8, 2)  # j, copy, (hi, lo)
    np.testing.assert_array_equal(tab, np.broadcast_to(
        np.array(values).reshape(32, 1, 2), (32, 8, 2)))
    assert EXP_TABLE_DOUBLES == tab.size
    slots = (np.arange(32)[:, None] * 8 + np.arange(8)[None, :]) % 8  # 16-byte slot's group
    assert all(len(set(slots[j_of_lane, np.arange(8)])) == 8
               for j_of_lane in np.random.default_rng(3).integers(0, 32, (100, 8)))


#: tile.cuh's refattn_load_tile_async compiled as host C++: every thread of a 128-thread block
#: issues its copies into a recording stub, which prints (thread, shared offset, source offset,
#: valid) per 16-byte copy
TILE_PROGRAM = COMMON_PRELUDE.replace('#include "common.cuh"', "") + r"""
#include <vector>
#define REFATTN_UNROLL
#define REFATTN_NO_UNROLL
namespace emu {
static int tid_now = 0;
static const double* tile0 = nullptr;
static const double* src0 = nullptr;
inline void cp_async16(double& d0, double& d1, const double* src, bool valid) {
    if (&d1 != &d0 + 1) std::printf("split\n");
    std::printf("%d %ld %ld %d\n", tid_now, static_cast<long>(&d0 - tile0),
                static_cast<long>(src - src0), valid ? 1 : 0);
}
inline void cp_async_commit() {}
inline void cp_async_wait(int) {}
inline void mma_f64(int, int, const double*, const double*, double*) {}
}  // namespace emu
#include "tile.cuh"
#include <cstdlib>
template <int R, int D>
void run(int row0, int rows) {
    std::vector<double> tile(R * D), matrix(1);
    emu::tile0 = tile.data();
    emu::src0 = matrix.data();
    for (int tid = 0; tid < 128; ++tid) {
        emu::tid_now = tid;
        refattn_load_tile_async<R, D, 128>(tile.data(), matrix.data(), row0, rows, tid);
    }
}
int main(int argc, char** argv) {
    const int which = std::atoi(argv[1]), row0 = std::atoi(argv[2]), rows = std::atoi(argv[3]);
    switch (which) {
        case 0: run<8, 32>(row0, rows); break;
        case 1: run<24, 32>(row0, rows); break;
        case 2: run<16, 64>(row0, rows); break;
        case 3: run<32, 64>(row0, rows); break;
        case 4: run<8, 128>(row0, rows); break;
        case 5: run<16, 128>(row0, rows); break;
        case 6: run<64, 128>(row0, rows); break;
        case 7: run<8, 256>(row0, rows); break;
        case 8: run<16, 256>(row0, rows); break;
    }
    return 0;
}
"""
TILE_SHAPES = ((8, 32), (24, 32), (16, 64), (32, 64), (8, 128), (16, 128), (64, 128),
               (8, 256), (16, 256))


def test_the_tile_copies_cover_each_chunk_once_swizzled_with_zeros_past_the_rows(tmp_path):
    """refattn_load_tile_async (its copy addresses hoisted out of the loop, issue 43): for
    tile shapes of the instances, the block's 128 threads copy every 16-byte chunk (r, c) of
    the R x D tile exactly once, from element (row0 + r) D + c of the matrix, to the swizzled
    offset r D + (c ^ 4 f(r)), f(r) = (r ^ (r >> 1)) & 3 (written here from tile.cuh's comment,
    not from its code), valid exactly for the rows before `rows` (the others zero-filled, their
    source ignored); and each thread issues the same number of copies."""
    import collections
    import itertools

    exe = _host_binary(tmp_path, "tile", TILE_PROGRAM, "-Wno-unused-function")
    for which, (R, D) in enumerate(TILE_SHAPES):
        for row0, rows in ((0, 10**6), (2 * R, 2 * R + R // 2), (R, R + 1), (0, 0)):
            out = subprocess.run([str(exe), str(which), str(row0), str(rows)],
                                 capture_output=True, text=True, check=True).stdout.split("\n")
            copies = [tuple(map(int, line.split())) for line in out if line]
            assert len(copies) == R * D // 2, (R, D)
            per_thread = collections.Counter(tid for tid, *_ in copies)
            assert set(per_thread.values()) == {R * D // 2 // 128}, (R, D)
            seen = {}
            for _, dst, src, valid in copies:
                r = dst // D  # the swizzle moves columns within a row
                c = dst % D ^ (((r ^ (r >> 1)) & 3) << 2)
                assert 0 <= r < R and c % 2 == 0, (R, D, dst)
                assert valid == (row0 + r < rows), (R, D, r, rows)
                assert src == (row0 + r) * D + c, (R, D, r, c, src)  # (ignored when not valid)
                assert (r, c) not in seen, (R, D, r, c)
                seen[(r, c)] = dst
            assert set(seen) == set(itertools.product(range(R), range(0, D, 2)))
