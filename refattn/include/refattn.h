/* refattn.h: the C API over refattn.hpp (extern "C"), for C and for languages with a C FFI.
 *
 * The functions are implemented in refattn_capi.inl, compiled into the one C++ translation
 * unit that defines REFATTN_IMPLEMENTATION before including refattn.hpp:
 *
 *     // refattn_impl.cpp
 *     #define REFATTN_IMPLEMENTATION
 *     #include "refattn.hpp"
 *
 * Every function that can fail returns 0 on success and -1 on failure, with the message
 * (naming the file, the tensor and the limit) written to err (at most errlen bytes, NUL
 * terminated; err may be NULL). Pointers returned by a case stay valid until
 * refattn_case_free. See docs/reference/cpp.md. */
#ifndef REFATTN_H
#define REFATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct refattn_bundle refattn_bundle;
typedef struct refattn_case refattn_case;

/* One tensor of a case: C order, values widened to double (exact for every stored dtype). */
typedef struct refattn_tensor {
  const char* name;
  const char* dtype; /* float64, bool, int64, uint8, uint16, uint32 */
  int ndim;
  const int64_t* shape;
  const int64_t* strides; /* in elements */
  const double* data;
  size_t size;
} refattn_tensor;

/* The call description (see refattn::Call); head_map is the kv head of each query head
 * (length Hq). visible and dropout_multiplier are the tensors as stored (broadcastable to
 * (B, Hq, Q, K), numpy's rule; ndim 0 and data NULL: absent, all 1): the dense ones come from
 * refattn_call_dense into a buffer the caller allocates. */
typedef struct refattn_call {
  int64_t B, Hq, Hkv, Q, K, Dk, Dv;
  double scale, scale_query, scale_key, scale_post;
  double softcap; /* 0: none */
  double dropout_p; /* NaN when the case gives none */
  int dropout_training;
  int has_bias, has_sink, has_query_valid;
  const char* score_family;
  const char* dropout_mode;
  const int64_t* head_map;
  refattn_tensor visible;
  refattn_tensor dropout_multiplier;
} refattn_call;

/* The verdict on one tensor (see refattn::TensorReport). */
typedef struct refattn_report {
  int passed;
  char rule[24];
  int64_t compared, failing_count, nan_mismatches, nonfinite_mismatches;
  double max_abs_error, bound, margin, reference_error;
  int has_worst;
  int worst_ndim;
  int64_t worst_index[32];
  double worst_candidate, worst_golden;
  char reason[512];
} refattn_report;

int refattn_bundle_open(const char* dir, refattn_bundle** out, char* err, size_t errlen);
void refattn_bundle_close(refattn_bundle* bundle);
size_t refattn_bundle_case_count(const refattn_bundle* bundle);
/* The i-th case id in manifest order (NULL past the end). */
const char* refattn_bundle_case_id(const refattn_bundle* bundle, size_t i);

int refattn_case_load(const refattn_bundle* bundle, const char* case_id, refattn_case** out,
                      char* err, size_t errlen);
void refattn_case_free(refattn_case* c);
int refattn_case_tensor(const refattn_case* c, const char* name, refattn_tensor* out, char* err,
                        size_t errlen);
int refattn_case_call(const refattn_case* c, refattn_call* out);
/* The dense (B, Hq, Q, K) "visible" or "dropout_multiplier" of the case, C order, into out
 * (n = B*Hq*Q*K doubles, allocated by the caller). */
int refattn_call_dense(const refattn_case* c, const char* name, double* out, size_t n, char* err,
                       size_t errlen);
/* Read a yardstick file (docs/reference/cpp.md) into the case. */
int refattn_case_load_yardsticks(refattn_case* c, const char* path, char* err, size_t errlen);

/* refattn::compare: n candidate values of tensor name, computed in dtype (float64, float32,
 * float16, bfloat16). Returns 0 when the comparison ran (out->passed holds the verdict). */
int refattn_compare(const refattn_case* c, const char* name, const double* candidate, size_t n,
                    const char* dtype, refattn_report* out, char* err, size_t errlen);

/* SHA-256 (FIPS 180-4) of n bytes as 64 lower-case hex digits and a NUL in hex65. */
void refattn_sha256_hex(const void* data, size_t n, char hex65[65]);

#ifdef __cplusplus
}
#endif

#endif /* REFATTN_H */
