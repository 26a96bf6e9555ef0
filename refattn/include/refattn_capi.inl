// refattn_capi.inl: the C API of refattn.h, implemented over refattn.hpp. Included by
// refattn.hpp when REFATTN_IMPLEMENTATION is defined (in exactly one translation unit).

struct refattn_bundle {
  refattn::Bundle bundle;
};
struct refattn_case {
  refattn::Case c;
};

namespace refattn {
namespace capi {
inline void put(char* err, size_t errlen, const char* msg) {
  if (!err || errlen == 0) return;
  std::snprintf(err, errlen, "%s", msg);
}
inline void view(const Tensor& t, refattn_tensor* out) {
  out->name = t.name.c_str();
  out->dtype = t.dtype.c_str();
  out->ndim = int(t.shape.size());
  out->shape = t.shape.data();
  out->strides = t.strides.data();
  out->data = t.values.data();
  out->size = t.values.size();
}
inline void stored(const ScoreView& v, refattn_tensor* out) {
  if (v.stored) {
    view(*v.stored, out);
    return;
  }
  out->name = v.name.c_str();
  out->dtype = "float64";
  out->ndim = 0;
  out->shape = nullptr;
  out->strides = nullptr;
  out->data = nullptr;
  out->size = 0;
}
template <class F>
int guarded(char* err, size_t errlen, F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    put(err, errlen, e.what());
  } catch (...) {
    put(err, errlen, "refattn: unknown error");
  }
  return -1;
}
}  // namespace capi
}  // namespace refattn

extern "C" {

int refattn_bundle_open(const char* dir, refattn_bundle** out, char* err, size_t errlen) {
  *out = nullptr;
  return refattn::capi::guarded(err, errlen, [&] {
    if (!dir) throw refattn::Error("bundle: dir is NULL");
    *out = new refattn_bundle{refattn::Bundle::open(dir)};
  });
}
void refattn_bundle_close(refattn_bundle* bundle) { delete bundle; }
size_t refattn_bundle_case_count(const refattn_bundle* bundle) {
  return bundle ? bundle->bundle.cases().size() : 0;
}
const char* refattn_bundle_case_id(const refattn_bundle* bundle, size_t i) {
  if (!bundle || i >= bundle->bundle.cases().size()) return nullptr;
  return bundle->bundle.cases()[i].c_str();
}
int refattn_case_load(const refattn_bundle* bundle, const char* case_id, refattn_case** out,
                      char* err, size_t errlen) {
  *out = nullptr;
  return refattn::capi::guarded(err, errlen, [&] {
    if (!bundle || !case_id) throw refattn::Error("case: bundle or case_id is NULL");
    *out = new refattn_case{bundle->bundle.load(case_id)};
  });
}
void refattn_case_free(refattn_case* c) { delete c; }
int refattn_case_tensor(const refattn_case* c, const char* name, refattn_tensor* out, char* err,
                        size_t errlen) {
  return refattn::capi::guarded(err, errlen, [&] {
    if (!c || !name) throw refattn::Error("tensor: case or name is NULL");
    refattn::capi::view(c->c.tensor(name), out);
  });
}
int refattn_case_call(const refattn_case* c, refattn_call* out) {
  if (!c || !out) return -1;
  const refattn::Call& k = c->c.call();
  out->B = k.axes.B;
  out->Hq = k.axes.Hq;
  out->Hkv = k.axes.Hkv;
  out->Q = k.axes.Q;
  out->K = k.axes.K;
  out->Dk = k.axes.Dk;
  out->Dv = k.axes.Dv;
  out->scale = k.scale.value;
  out->scale_query = k.scale.query;
  out->scale_key = k.scale.key;
  out->scale_post = k.scale.post;
  out->softcap = k.softcap;
  out->dropout_p = k.dropout.p;
  out->dropout_training = k.dropout.training;
  out->has_bias = k.has_bias;
  out->has_sink = k.has_sink;
  out->has_query_valid = k.has_query_valid;
  out->score_family = k.score_family.c_str();
  out->dropout_mode = k.dropout.mode.c_str();
  out->head_map = k.head_map.data();
  refattn::capi::stored(k.visible, &out->visible);
  refattn::capi::stored(k.dropout_multiplier, &out->dropout_multiplier);
  return 0;
}
int refattn_call_dense(const refattn_case* c, const char* name, double* out, size_t n, char* err,
                       size_t errlen) {
  return refattn::capi::guarded(err, errlen, [&] {
    if (!c || !name || !out) throw refattn::Error("dense: a NULL argument");
    std::string which = name;
    const refattn::Call& k = c->c.call();
    if (which == "visible") k.visible.fill_dense(out, n);
    else if (which == "dropout_multiplier") k.dropout_multiplier.fill_dense(out, n);
    else throw refattn::Error("dense: expected 'visible' or 'dropout_multiplier', got '" + which + "'");
  });
}
int refattn_case_load_yardsticks(refattn_case* c, const char* path, char* err, size_t errlen) {
  return refattn::capi::guarded(err, errlen, [&] {
    if (!c || !path) throw refattn::Error("yardsticks: case or path is NULL");
    refattn::Bundle::load_yardsticks(c->c, path);
  });
}
int refattn_compare(const refattn_case* c, const char* name, const double* candidate, size_t n,
                    const char* dtype, refattn_report* out, char* err, size_t errlen) {
  return refattn::capi::guarded(err, errlen, [&] {
    if (!c || !name || (!candidate && n) || !dtype || !out)
      throw refattn::Error("compare: a NULL argument");
    refattn::TensorReport r = refattn::compare(c->c, name, candidate, n, dtype);
    std::memset(out, 0, sizeof *out);
    out->passed = r.passed;
    std::snprintf(out->rule, sizeof out->rule, "%s", r.rule.c_str());
    out->compared = r.compared;
    out->failing_count = r.failing_count;
    out->nan_mismatches = r.nan_mismatches;
    out->nonfinite_mismatches = r.nonfinite_mismatches;
    out->max_abs_error = r.max_abs_error;
    out->bound = r.bound;
    out->margin = r.margin;
    out->reference_error = r.reference_error;
    out->has_worst = r.has_worst;
    out->worst_ndim = int(r.worst_index.size());
    for (size_t i = 0; i < r.worst_index.size() && i < 32; ++i) out->worst_index[i] = r.worst_index[i];
    out->worst_candidate = r.worst_candidate;
    out->worst_golden = r.worst_golden;
    std::snprintf(out->reason, sizeof out->reason, "%s", r.reason.c_str());
  });
}
void refattn_sha256_hex(const void* data, size_t n, char hex65[65]) {
  std::string h = refattn::sha256_hex(data, n);
  std::memcpy(hex65, h.c_str(), 65);
}

}  // extern "C"
