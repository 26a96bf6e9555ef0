// The cross-check tool of tests/cpp/test_cpp.py: runs refattn.hpp on a list of jobs and
// prints one JSON line per job, which the driver compares with refattn's Python answers.
//
// usage: refattn_tool JOBS_FILE
//   each line, tab-separated:
//     load     BUNDLE CASE                              -> {"ok": true} or {"ok": false, "error": ...}
//     compare  BUNDLE CASE NAME CANDIDATE DTYPE YARD    -> the TensorReport as JSON
//   CANDIDATE is a safetensors file holding NAME (F64 or F32); YARD a yardstick file or "-".
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "refattn.hpp"

namespace {

std::string esc(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += char(c);
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", unsigned(c));
      o += b;
    } else {
      o += char(c);
    }
  }
  return o + "\"";
}

std::string num(double x) {
  if (std::isnan(x)) return "\"nan\"";
  if (std::isinf(x)) return x > 0 ? "\"inf\"" : "\"-inf\"";
  return refattn::detail::plain(x);
}

std::vector<double> read_candidate(const std::string& path, const std::string& name) {
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> d((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  static const std::vector<std::string> codes = {"F64", "F32"};
  refattn::SafetensorsHeader h = refattn::parse_header(d.data(), d.size(), d.size(), path, codes);
  const refattn::TensorEntry* e = h.find(name);
  if (!e) throw refattn::Error(path + ": candidate has no tensor '" + name + "'");
  return refattn::detail::make_tensor(*e, d.data()).values;
}

std::string report_json(const refattn::TensorReport& r) {
  std::ostringstream o;
  o << "{\"ok\": true, \"passed\": " << (r.passed ? "true" : "false") << ", \"rule\": " << esc(r.rule)
    << ", \"compared\": " << r.compared << ", \"failing_count\": " << r.failing_count
    << ", \"nonfinite_mismatches\": " << r.nonfinite_mismatches << ", \"nan_mismatches\": " << r.nan_mismatches
    << ", \"max_abs_error\": " << num(r.max_abs_error) << ", \"bound\": " << num(r.bound)
    << ", \"margin\": " << num(r.margin) << ", \"worst_index\": ";
  if (r.has_worst) {
    o << "[";
    for (size_t i = 0; i < r.worst_index.size(); ++i) o << (i ? ", " : "") << r.worst_index[i];
    o << "]";
  } else {
    o << "null";
  }
  o << ", \"worst_candidate\": " << num(r.worst_candidate) << ", \"worst_golden\": " << num(r.worst_golden)
    << ", \"reference_error\": " << num(r.reference_error) << ", \"reason\": " << esc(r.reason) << "}";
  return o.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: refattn_tool JOBS_FILE\n";
    return 2;
  }
  std::ifstream jobs(argv[1]);
  std::string line;
  std::map<std::string, refattn::Bundle> bundles;  // each bundle's manifest read once
  auto bundle = [&](const std::string& dir) -> const refattn::Bundle& {
    auto it = bundles.find(dir);
    if (it == bundles.end()) it = bundles.emplace(dir, refattn::Bundle::open(dir)).first;
    return it->second;
  };
  while (std::getline(jobs, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string part;
    while (std::getline(ss, part, '\t')) f.push_back(part);
    try {
      if (f.size() == 3 && f[0] == "load") {
        refattn::Bundle::open(f[1]).load(f[2]);  // a fresh read: each corpus bundle differs
        std::cout << "{\"ok\": true}\n";
      } else if (f.size() == 7 && f[0] == "compare") {
        refattn::Case c = bundle(f[1]).load(f[2]);
        if (f[6] != "-") refattn::Bundle::load_yardsticks(c, f[6]);
        std::vector<double> cand = read_candidate(f[4], f[3]);
        std::cout << report_json(refattn::compare(c, f[3], cand, f[5])) << "\n";
      } else {
        std::cout << "{\"ok\": false, \"error\": \"bad job line\"}\n";
      }
    } catch (const refattn::Error& e) {
      std::cout << "{\"ok\": false, \"error\": " << esc(e.what()) << "}\n";
    }
  }
  return 0;
}
