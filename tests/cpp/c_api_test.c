/* The C API of refattn.h from C (C99): open the bundle, load a case, read a tensor and the
 * call, compare the golden output with itself (passes) and with one element changed (fails,
 * naming the element), and a SHA-256 of NIST's "abc". usage: c_api_test BUNDLE */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "refattn.h"

static int failures = 0;
#define CHECK(cond, what)                    \
  do {                                       \
    if (!(cond)) {                           \
      printf("FAIL %s\n", what);             \
      ++failures;                            \
    }                                        \
  } while (0)

int main(int argc, char** argv) {
  char err[1024];
  char hex[65];
  refattn_bundle* b = NULL;
  refattn_case* c = NULL;
  refattn_tensor out;
  refattn_call call;
  refattn_report rep;
  double* bad;
  double* dense;
  if (argc != 2) return 2;
  refattn_sha256_hex("abc", 3, hex);
  CHECK(strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0, "sha256 abc");
  CHECK(refattn_bundle_open("/nonexistent-refattn-bundle", &b, err, sizeof err) == -1 && b == NULL,
        "a missing bundle is refused");
  CHECK(strstr(err, "manifest.json") != NULL, "the refusal names manifest.json");
  if (refattn_bundle_open(argv[1], &b, err, sizeof err) != 0) {
    printf("FAIL open: %s\n", err);
    return 1;
  }
  CHECK(refattn_bundle_case_count(b) >= 1, "cases listed");
  CHECK(refattn_bundle_case_id(b, refattn_bundle_case_count(b)) == NULL, "past the last case: NULL");
  if (refattn_case_load(b, "causal_square", &c, err, sizeof err) != 0) {
    printf("FAIL load: %s\n", err);
    return 1;
  }
  CHECK(refattn_case_tensor(c, "output", &out, err, sizeof err) == 0, "output tensor");
  CHECK(out.ndim == 4 && out.strides[3] == 1 && strcmp(out.dtype, "float64") == 0, "output layout");
  CHECK(refattn_case_tensor(c, "nope", &out, err, sizeof err) == -1 && strstr(err, "'nope'") != NULL,
        "an unknown tensor is refused by name");
  refattn_case_tensor(c, "output", &out, err, sizeof err);
  CHECK(refattn_case_call(c, &call) == 0 && call.Q == call.K && call.visible.ndim >= 2,
        "call description");
  dense = (double*)malloc((size_t)(call.B * call.Hq * call.Q * call.K) * sizeof(double));
  CHECK(refattn_call_dense(c, "visible", dense, (size_t)(call.B * call.Hq * call.Q * call.K), err,
                           sizeof err) == 0, "dense visibility");
  CHECK(dense[1] == 0.0 && dense[0] == 1.0 && dense[call.K + 1] == 1.0, "causal visibility, rows 0 and 1");
  CHECK(refattn_call_dense(c, "visible", dense, 3, err, sizeof err) == -1 && strstr(err, "3 elements") != NULL,
        "a buffer of the wrong size is refused");
  free(dense);
  CHECK(refattn_compare(c, "output", out.data, out.size, "float64", &rep, err, sizeof err) == 0 && rep.passed,
        "the golden output passes");
  bad = (double*)malloc(out.size * sizeof(double));
  memcpy(bad, out.data, out.size * sizeof(double));
  bad[5] += 1e-6;
  CHECK(refattn_compare(c, "output", bad, out.size, "float64", &rep, err, sizeof err) == 0 && !rep.passed,
        "a changed element fails");
  CHECK(rep.has_worst && rep.worst_ndim == 4 && rep.worst_index[3] == 1 && rep.worst_index[2] == 1 &&
            rep.worst_candidate == bad[5] && strstr(rep.reason, "exceed") != NULL,
        "the report names the worst element");
  CHECK(refattn_compare(c, "output", bad, out.size, "float8", &rep, err, sizeof err) == -1 &&
            strstr(err, "float8") != NULL, "an unknown dtype is refused");
  printf("c api: worst (%lld, %lld, %lld, %lld): %s\n", (long long)rep.worst_index[0],
         (long long)rep.worst_index[1], (long long)rep.worst_index[2], (long long)rep.worst_index[3], rep.reason);
  free(bad);
  refattn_case_free(c);
  refattn_bundle_close(b);
  printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASS", failures);
  return failures ? 1 : 0;
}
