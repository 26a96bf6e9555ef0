// A host attention forward in C++ (float64), the kind of reference a kernel's C++ test suite
// writes, driven by refattn::Case's call description; used by test_refattn.cpp with planted
// bugs (a wrong scale, the wrong causal triangle) that the comparison must catch.
#ifndef REFATTN_TESTS_HOST_KERNEL_HPP
#define REFATTN_TESTS_HOST_KERNEL_HPP

#include <cmath>
#include <string>
#include <vector>

#include "refattn.hpp"

namespace host {

struct Options {
  bool scale_bug = false;    ///< 1/Dk instead of the case's scale
  bool flip_causal = false;  ///< visibility of (j, i) instead of (i, j)
};

/// Why this kernel cannot run the case ("" when it can).
inline std::string unsupported(const refattn::Case& c) {
  const refattn::Call& k = c.call();
  const auto& a = k.axes;
  if (k.score_family != "dot") return "score family " + k.score_family;
  if (c.entry().find("quant")) return "a quantised case";
  if (!c.has("q") || !c.has("k") || !c.has("v") || !c.has("output")) return "no q, k, v or output";
  if (c.tensor("k").shape != std::vector<int64_t>({a.B, a.Hkv, a.K, a.Dk}) ||
      c.tensor("v").shape != std::vector<int64_t>({a.B, a.Hkv, a.K, a.Dv}) ||
      c.tensor("q").shape != std::vector<int64_t>({a.B, a.Hq, a.Q, a.Dk}))
    return "a layout other than BHSD";
  if (k.has_sink && c.tensor("sink").shape != std::vector<int64_t>({a.Hq})) return "a sink of another shape";
  return "";
}

/// output (B, Hq, Q, Dv) in C order.
inline std::vector<double> forward(const refattn::Case& c, const Options& o = Options()) {
  const refattn::Call& k = c.call();
  const auto& a = k.axes;
  const auto& q = c.tensor("q").values;
  const auto& kk = c.tensor("k").values;
  const auto& v = c.tensor("v").values;
  refattn::ScoreView bias = refattn::detail::score_view(c.find("bias"), "bias", a, 0.0, c.file());
  const refattn::Tensor* sank = c.find("sanitized_rows");
  const refattn::Tensor* qv = c.find("query_valid");
  const refattn::Tensor* sink = k.has_sink ? c.find("sink") : nullptr;
  double post = o.scale_bug ? 1.0 / double(a.Dk) : k.scale.post;
  double mq = o.scale_bug ? 1.0 : k.scale.query, mk = o.scale_bug ? 1.0 : k.scale.key;
  std::vector<double> out(size_t(a.B * a.Hq * a.Q * a.Dv), 0.0), s(size_t(a.K));
  std::vector<char> vis(size_t(a.K));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hq; ++h) {
      int64_t g = k.head_map.empty() ? h : k.head_map[size_t(h)];
      for (int64_t i = 0; i < a.Q; ++i) {
        double* o_row = &out[size_t(((b * a.Hq + h) * a.Q + i) * a.Dv)];
        if (qv && qv->values[size_t(b * a.Q + i)] == 0.0) continue;  // zeroed, invalid query
        double m = -INFINITY;
        for (int64_t j = 0; j < a.K; ++j) {
          int64_t ii = i, jj = j;
          if (o.flip_causal && a.Q == a.K) std::swap(ii, jj);
          vis[size_t(j)] = k.visible(b, h, ii, jj) != 0.0;
          if (j == 0 && sank && sank->values[size_t((b * a.Hq + h) * a.Q + i)] != 0.0) vis[0] = 1;
          if (!vis[size_t(j)]) continue;
          double u = 0.0;
          for (int64_t d = 0; d < a.Dk; ++d)
            u += (mq * q[size_t(((b * a.Hq + h) * a.Q + i) * a.Dk + d)]) *
                 (mk * kk[size_t(((b * a.Hkv + g) * a.K + j) * a.Dk + d)]);
          double x = post * u;
          if (k.softcap > 0) x = k.softcap * std::tanh(x / k.softcap);
          x += bias(b, h, i, j);
          s[size_t(j)] = x;
          m = std::max(m, x);
        }
        double sink_logit = sink ? sink->values[size_t(h)] : -INFINITY;
        m = std::max(m, sink_logit);
        if (m == -INFINITY) continue;  // no legal key and no sink: the row stays zero
        double z = std::exp(sink_logit - m);
        for (int64_t j = 0; j < a.K; ++j)
          if (vis[size_t(j)]) z += std::exp(s[size_t(j)] - m);
        double lse = m + std::log(z);
        for (int64_t j = 0; j < a.K; ++j) {
          if (!vis[size_t(j)]) continue;
          double p = std::exp(s[size_t(j)] - lse) * k.dropout_multiplier(b, h, i, j);
          for (int64_t d = 0; d < a.Dv; ++d) o_row[d] += p * v[size_t(((b * a.Hkv + g) * a.K + j) * a.Dv + d)];
        }
      }
    }
  return out;
}

}  // namespace host

#endif
