// The C++ tests of refattn.hpp (run by tests/cpp/test_cpp.py): SHA-256 against NIST's
// example values, the bounded JSON parser, the safetensors header's bounds, and a host
// attention kernel checked against a conformance bundle with planted bugs that must fail.
//
// usage: refattn_tests BUNDLE SCRATCH_DIR   (BUNDLE: `refattn golden --suite conformance`)
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "host_kernel.hpp"
#include "refattn.hpp"

namespace {

int failures = 0;
int checks = 0;

void check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::cout << "FAIL " << what << "\n";
  }
}

/// ``f()`` must throw refattn::Error whose message holds every one of ``parts``.
template <class F>
void refuses(F f, const std::vector<std::string>& parts, const std::string& what) {
  try {
    f();
  } catch (const refattn::Error& e) {
    std::string msg = e.what();
    for (const auto& p : parts)
      check(msg.find(p) != std::string::npos, what + ": message lacks '" + p + "': " + msg);
    std::cout << "refused " << what << ": " << msg << "\n";
    return;
  } catch (const std::exception& e) {
    check(false, what + ": threw another exception: " + e.what());
    return;
  }
  check(false, what + ": was accepted");
}

// -- 1. SHA-256: NIST FIPS 180-4 example values (CSRC "Examples with Intermediate Values",
// SHA256.pdf, SHA2_Additional.pdf) ------------------------------------------------------
void test_sha256() {
  check(refattn::sha256_hex("abc", 3) ==
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        "sha256 'abc'");
  const char* m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  check(refattn::sha256_hex(m448, std::strlen(m448)) ==
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        "sha256 448-bit message");
  const char* m896 =
      "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
  check(refattn::sha256_hex(m896, std::strlen(m896)) ==
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
        "sha256 896-bit message");
  refattn::Sha256 h;
  std::string a(1000, 'a');
  for (int i = 0; i < 1000; ++i) h.update(a.data(), a.size());  // one million 'a', in pieces
  check(h.hexdigest() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0",
        "sha256 one million 'a'");
  check(refattn::sha256_hex("", 0) ==
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "sha256 empty message");
}

// -- 2. JSON ------------------------------------------------------------------------------
void test_json() {
  using refattn::json::parse;
  auto p = [](const std::string& s) { return parse(s.data(), s.size(), "doc"); };
  auto v = p(R"({"a": [1, -2, 1.5, 9007199254740993, 1e400, "x\u00e9\ud83d\ude00"], "b": null})");
  check(v.find("a")->array[0].is_int && v.find("a")->array[0].integer == 1, "json int");
  check(v.find("a")->array[1].integer == -2, "json negative int");
  check(!v.find("a")->array[2].is_int && v.find("a")->array[2].number == 1.5, "json double");
  check(v.find("a")->array[3].integer == 9007199254740993LL, "json int64 exact past 2**53");
  check(std::isinf(v.find("a")->array[4].number), "json 1e400 is inf, as in Python");
  check(v.find("a")->array[5].string == "x\xc3\xa9\xf0\x9f\x98\x80", "json \\u escapes and a surrogate pair");
  check(v.find("b")->is_null(), "json null");
  refuses([&] { p(R"({"a": 1, "a": 2})"); }, {"doc", "duplicate key 'a'"}, "json duplicate key");
  refuses([&] { p(std::string(200, '[') + std::string(200, ']')); }, {"doc", "nested deeper than the 128"},
          "json depth limit");
  refuses([&] { p("[NaN]"); }, {"doc", "not valid JSON"}, "json NaN");
  refuses([&] { p("[1] x"); }, {"doc", "extra data"}, "json trailing data");
  refuses([&] { p("\"\xff\""); }, {"doc", "not UTF-8", "0xff"}, "json bad UTF-8");
  refuses([&] { p("\"\xed\xa0\x80\""); }, {"doc", "not UTF-8"}, "json encoded surrogate");
  refuses([&] { p("[01]"); }, {"doc", "not valid JSON"}, "json leading zero");
  refuses([&] { p("\"a\tb\""); }, {"doc", "control character"}, "json raw control character");
  refuses([&] { p("[" + std::string(5000, '7') + "]"); }, {"doc", "5000 digits", "4300"}, "json huge integer");
  refattn::json::Limits small;
  small.max_bytes = 4;
  refuses([&] { parse("[1, 2]", 6, "doc", small); }, {"doc", "6 bytes", "the 4"}, "json size limit");
}

// -- 3. safetensors header ------------------------------------------------------------------
std::vector<unsigned char> st_file(const std::string& header, size_t data_bytes, uint64_t claimed = 0) {
  std::vector<unsigned char> f(8 + header.size() + data_bytes, 0);
  uint64_t n = claimed ? claimed : header.size();
  for (int i = 0; i < 8; ++i) f[size_t(i)] = static_cast<unsigned char>(n >> (8 * i));
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

void test_header() {
  const auto& codes = refattn::golden_dtype_codes();
  auto parse = [&](const std::vector<unsigned char>& f) {
    return refattn::parse_header(f.data(), f.size(), f.size(), "x.safetensors", codes);
  };
  auto ok = st_file(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},"__metadata__":{"k":"v"}})", 16);
  auto h = parse(ok);
  check(h.tensors.size() == 1 && h.tensors[0].end == ok.size(), "header: a well-formed file");
  refuses([&] { parse(st_file("{}", 0, 200ull << 20)); }, {"x.safetensors", "209715200", "104857600"},
          "header length over the limit");
  refuses([&] { parse(st_file("{}", 0, 1000)); }, {"x.safetensors", "truncated", "1008"}, "header past the file");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},"a":{"dtype":"F64","shape":[2],"data_offsets":[16,32]}})", 32)); },
          {"x.safetensors", "duplicate key 'a'"}, "header duplicate key");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 8)); },
          {"x.safetensors", "tensor 'a'", "past the end", "71 bytes"}, "header offset past the file");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[3],"data_offsets":[0,16]}})", 16)); },
          {"x.safetensors", "tensor 'a'", "hold 16 bytes", "needs 24"}, "header shape times itemsize");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16)); },
          {"x.safetensors", "tensor 'a'", "unsupported dtype 'F32'"}, "header dtype not the bundle's");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},"b":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})", 16)); },
          {"x.safetensors", "tensor 'b'", "starts at byte", "gaps or overlaps"}, "header overlapping tensors");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})", 16)); },
          {"x.safetensors", "tensor 'a'", "starts at byte"}, "header hole before a tensor");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 16)); },
          {"x.safetensors", "corrupt file", "end at byte"}, "header trailing bytes");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8)); },
          {"x.safetensors", "tensor 'a'", "hold 8 bytes"}, "header shape product overflow");
  refuses([&] { parse(st_file(R"({"a":{"dtype":"F64","shape":[-1],"data_offsets":[0,8]}})", 8)); },
          {"x.safetensors", "tensor 'a'", "malformed shape"}, "header negative shape");
  refuses([&] { parse(st_file("[1,2]", 0)); }, {"x.safetensors", "not a JSON object"}, "header not an object");
  refuses([&] { parse(std::vector<unsigned char>(5, 0)); }, {"x.safetensors", "truncated", "5 bytes"}, "file shorter than 8 bytes");
  // many keys: each name looked up in a map, duplicates found in a set (no quadratic pass)
  std::string many = "{";
  for (int i = 0; i < 50000; ++i) many += "\"t" + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},";
  auto big = st_file(many.substr(0, many.size() - 1) + "}", 0);
  auto t0 = std::chrono::steady_clock::now();
  auto hb = parse(big);
  check(hb.tensors.size() == 50000 && hb.find("t49999") != nullptr, "header of 50000 empty tensors");
  refuses([&] { parse(st_file(many + "\"t7\":{}}", 0)); }, {"x.safetensors", "duplicate key 't7'"},
          "a duplicate after 50000 keys");
  std::printf("timing: a header of 50000 tensors parsed and checked twice in %.3f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// -- 4-6. the conformance bundle, the host kernel and planted bugs ---------------------------
std::string g_bundle, g_scratch;

void test_host_kernel_against_bundle() {
  auto t0 = std::chrono::steady_clock::now();
  refattn::Bundle b = refattn::Bundle::open(g_bundle);
  int run = 0, skipped = 0;
  for (const auto& id : b.cases()) {
    refattn::Case c = b.load(id);
    std::string why = host::unsupported(c);
    if (!why.empty()) {
      ++skipped;
      std::cout << "skip " << id << ": " << why << "\n";
      continue;
    }
    ++run;
    std::vector<double> out = host::forward(c);
    refattn::TensorReport r = refattn::compare(c, "output", out, "float64");
    check(r.passed, "host kernel on " + id + ": " + r.line());
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "host kernel: " << run << " cases checked, " << skipped << " outside its support\n";
  check(run >= 40, "host kernel covers at least 40 conformance cases");
  // reading and verifying every case (sha256 of files and tensors) and checking every output
  auto t1 = std::chrono::steady_clock::now();
  for (const auto& id : b.cases()) {
    refattn::Case c = b.load(id);
    refattn::compare(c, "output", c.tensor("output").values, "float64");
  }
  double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  std::printf("timing: read, verified and checked %zu cases in %.3f s (host kernel pass: %.3f s)\n",
              b.cases().size(), all, secs);
}

void test_planted_bugs() {
  refattn::Bundle b = refattn::Bundle::open(g_bundle);
  {  // a wrong scale: 1/Dk instead of 1/sqrt(Dk)
    refattn::Case c = b.load("self_attention_basic");
    host::Options o;
    o.scale_bug = true;
    auto r = refattn::compare(c, "output", host::forward(c, o), "float64");
    check(!r.passed && r.reason.find("exceed atol") != std::string::npos &&
              r.reason.find("self_attention_basic") != std::string::npos,
          "planted wrong scale fails: " + r.line());
    std::cout << "planted wrong scale: " << r.line() << "\n";
  }
  {  // the wrong causal triangle (key j visible to query i when j >= i)
    refattn::Case c = b.load("causal_square");
    host::Options o;
    o.flip_causal = true;
    auto r = refattn::compare(c, "output", host::forward(c, o), "float64");
    check(!r.passed && r.has_worst && r.reason.find("exceed") != std::string::npos,
          "planted causal triangle fails: " + r.line());
    std::cout << "planted causal triangle: " << r.line() << "\n";
  }
  namespace fs = std::filesystem;
  auto copy_bundle = [&](const std::string& name, const std::string& id) {
    fs::path dir = fs::path(g_scratch) / name;
    fs::remove_all(dir);
    fs::create_directories(dir / "cases");
    fs::copy_file(fs::path(g_bundle) / "manifest.json", dir / "manifest.json");
    fs::copy_file(fs::path(g_bundle) / "cases" / (id + ".safetensors"), dir / "cases" / (id + ".safetensors"));
    return dir;
  };
  auto read = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  auto write = [](const fs::path& p, const std::vector<char>& d) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(d.data(), std::streamsize(d.size()));
  };
  {  // a flipped byte inside tensor q
    fs::path dir = copy_bundle("flipped", "causal_square");
    fs::path f = dir / "cases" / "causal_square.safetensors";
    std::vector<char> d = read(f);
    refattn::SafetensorsHeader h = refattn::parse_header(reinterpret_cast<const unsigned char*>(d.data()), d.size(),
                                                         d.size(), "f", refattn::golden_dtype_codes());
    d[size_t(h.find("q")->begin + 3)] ^= 0x10;
    write(f, d);
    refattn::Bundle fb = refattn::Bundle::open(dir.string());
    refuses([&] { fb.load("causal_square"); }, {"causal_square.safetensors", "tensor 'q'", "sha256"},
            "planted flipped tensor byte");
  }
  {  // a header offset past the file: the last tensor's data_offsets moved 16 bytes on
    fs::path dir = copy_bundle("offset", "causal_square");
    fs::path f = dir / "cases" / "causal_square.safetensors";
    std::vector<char> d = read(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(d[size_t(i)]);
    std::string header(d.data() + 8, size_t(n));
    refattn::SafetensorsHeader h = refattn::parse_header(reinterpret_cast<const unsigned char*>(d.data()), d.size(),
                                                         d.size(), "f", refattn::golden_dtype_codes());
    const refattn::TensorEntry& last = h.tensors.back();
    uint64_t a = last.begin - 8 - n, e = last.end - 8 - n;
    std::string from = "\"data_offsets\":[" + std::to_string(a) + "," + std::to_string(e) + "]";
    std::string to = "\"data_offsets\":[" + std::to_string(a + 16) + "," + std::to_string(e + 16) + "]";
    size_t at = header.find(from);
    check(at != std::string::npos, "planted offset: found the last tensor's offsets");
    if (at == std::string::npos) return;
    header.replace(at, from.size(), to);
    std::vector<char> out(8, 0);
    for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xFF);
    out.insert(out.end(), header.begin(), header.end());
    out.insert(out.end(), d.begin() + 8 + long(n), d.end());
    write(f, out);
    refattn::Bundle fb = refattn::Bundle::open(dir.string());
    refuses([&] { fb.load("causal_square"); },
            {"causal_square.safetensors", "tensor '" + last.name + "'", "past the end of the file"},
            "planted header offset past the file");
  }
  {  // a case the manifest does not list, and a candidate of the wrong size
    refattn::Case c = b.load("causal_square");
    refuses([&] { b.load("no_such_case"); }, {"manifest.json", "'no_such_case'"}, "unknown case id");
    auto r = refattn::compare(c, "output", std::vector<double>(3, 0.0), "float64");
    check(!r.passed && r.rule == "structure", "candidate of the wrong size fails");
    refuses([&] { c.tensor("nope"); }, {"causal_square.safetensors", "'nope'"}, "unknown tensor name");
    auto r32 = refattn::compare(c, "output", c.tensor("output").values, "float32");
    check(!r32.passed && r32.reason.find("no naive float32 reference") != std::string::npos,
          "float32 without a yardstick fails with its reason");
  }
}

void test_call_description() {
  refattn::Bundle b = refattn::Bundle::open(g_bundle);
  refattn::Case c = b.load("alibi_causal");
  const refattn::Call& k = c.call();
  check(k.axes.B == 1 && k.axes.Hq == 4 && k.axes.Q == 6 && k.axes.K == 6 && k.axes.Dk == 4, "axes");
  check(k.scale.value == 0.5 && k.scale.post == 0.5 && k.scale.query == 1.0, "scale 1/sqrt(4) from the hex record");
  check(k.has_bias && k.score_family == "dot" && k.head_map.size() == 4, "bias, family, head map");
  refattn::Tensor vis = k.visible.dense();
  check(vis.shape == std::vector<int64_t>({1, 4, 6, 6}) && vis.at({0, 2, 1, 0}) == 1.0 &&
            vis.at({0, 2, 1, 2}) == 0.0 && k.visible(0, 3, 1, 2) == 0.0,
        "dense causal visibility");
  refuses([&] { k.visible.dense(100); }, {"'visible'", "1152 bytes", "limit of 100"},
          "a dense copy above its byte limit");
  refattn::Case copy = [&] {  // a copy outlives its source: the views share their tensors
    refattn::Case tmp = b.load("alibi_causal");
    return refattn::Case(tmp);
  }();
  check(copy.call().visible(0, 1, 0, 0) == 1.0 && copy.call().visible(0, 1, 0, 1) == 0.0,
        "a copied case keeps its views");
  refattn::Case d = b.load("dropout_philox");
  check(d.call().dropout.mode == "stream" && d.call().dropout.p == 0.2 && d.call().dropout.training, "dropout record");
  double zmax = 0.0;
  for (double z : d.call().dropout_multiplier.dense().values) zmax = std::max(zmax, z);
  check(zmax == 1.25, "dropout multiplier 1/(1-p)");
  refattn::Case s = b.load("softcap_5");
  check(s.call().softcap == 5.0, "softcap");
  check(s.tensor("q").strides == std::vector<int64_t>({s.tensor("q").shape[1] * s.tensor("q").shape[2] * s.tensor("q").shape[3],
                                                       s.tensor("q").shape[2] * s.tensor("q").shape[3], s.tensor("q").shape[3], 1}),
        "C-order strides");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: refattn_tests BUNDLE SCRATCH_DIR\n";
    return 2;
  }
  g_bundle = argv[1];
  g_scratch = argv[2];
  test_sha256();
  test_json();
  test_header();
  try {
    test_call_description();
    test_host_kernel_against_bundle();
    test_planted_bugs();
  } catch (const std::exception& e) {
    check(false, std::string("unexpected exception: ") + e.what());
  }
  std::cout << (failures ? "FAILED: " : "PASS: ") << failures << " of " << checks << " checks failed\n";
  return failures ? 1 : 0;
}
