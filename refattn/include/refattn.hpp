// refattn.hpp: read a refattn golden bundle from C++17, verify it, and apply refattn's
// tolerance rule. Header-only; the C API of refattn.h is compiled into the one translation
// unit that defines REFATTN_IMPLEMENTATION before including this file.
//
// What it owns (the Python counterparts it mirrors, repository refattn, this tree):
//   refattn::sha256          SHA-256 per NIST FIPS 180-4 (tested against the CSRC example values)
//   refattn::json            a bounded JSON parser (size, depth, strict UTF-8, \uXXXX pairs,
//                            int64 where exact, duplicate keys refused) for the safetensors
//                            header and manifest.json (refattn/bundle/storage/manifest.py)
//   refattn::parse_header    the safetensors header with the bounds of
//                            refattn/bundle/storage/read.py (parse_header, _layout): header
//                            length <= 100 MiB, offsets inside the file, in order, no hole, no
//                            overlap, no duplicate key, known dtypes, shape * itemsize == span
//   refattn::Bundle / Case   open a bundle, list its cases, load one case with every sha256
//                            checked (file and tensors, against the manifest and the file's
//                            embedded hashes: read.py's load / load_bytes), the call as structs
//   refattn::compare         the rule of `refattn compare`
//                            (refattn/bundle/comparison/harness.py _numeric, tolerances.py):
//                            float64 |a-g| <= atol + rtol|g| per element; float32/float16/
//                            bfloat16 max|a-g| <= k * yardstick + floor, the yardstick (the
//                            naive algorithm's error in that dtype) read from the bundle
//
// Every error is a refattn::Error whose message names the file, the tensor and the limit.
// Nothing is allocated in proportion to a size a file claims before that size is checked
// against the file's real size. The host must be little-endian (as safetensors is).
#ifndef REFATTN_HPP
#define REFATTN_HPP

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <locale>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__has_include)
#if __has_include(<charconv>)
#include <charconv>
#endif
#endif

namespace refattn {

/// Every refusal: the message names the file, the tensor and the limit or expectation.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------
// SHA-256 (NIST FIPS 180-4, section 6.2)
// ---------------------------------------------------------------------------------------
class Sha256 {
 public:
  Sha256() { reset(); }
  void reset() {
    static const uint32_t init[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                     0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    std::memcpy(h_, init, sizeof h_);
    bits_ = 0;
    fill_ = 0;
  }
  void update(const void* data, size_t n) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    bits_ += static_cast<uint64_t>(n) * 8u;
    while (n > 0) {
      size_t take = std::min(n, sizeof buf_ - fill_);
      std::memcpy(buf_ + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
      if (fill_ == sizeof buf_) {
        block(buf_);
        fill_ = 0;
      }
    }
  }
  std::array<unsigned char, 32> digest() {
    uint64_t bits = bits_;
    unsigned char pad = 0x80;
    update(&pad, 1);
    unsigned char zero = 0;
    while (fill_ != 56) update(&zero, 1);
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(len, 8);
    std::array<unsigned char, 32> out{};
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<unsigned char>(h_[i] >> (24 - 8 * j));
    reset();
    return out;
  }
  std::string hexdigest() {
    static const char* hex = "0123456789abcdef";
    std::string s;
    for (unsigned char c : digest()) {
      s += hex[c >> 4];
      s += hex[c & 15];
    }
    return s;
  }

 private:
  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void block(const unsigned char* b) {
    static const uint32_t K[64] = {
        0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
        0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
        0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
        0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
        0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
        0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
        0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
        0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
        0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
        0xc67178f2u};
    uint32_t w[64];
    for (int t = 0; t < 16; ++t)
      w[t] = (uint32_t(b[4 * t]) << 24) | (uint32_t(b[4 * t + 1]) << 16) |
             (uint32_t(b[4 * t + 2]) << 8) | uint32_t(b[4 * t + 3]);
    for (int t = 16; t < 64; ++t) {
      uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h_[0], bb = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
             h = h_[7];
    for (int t = 0; t < 64; ++t) {
      uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & bb) ^ (a & c) ^ (bb & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = bb;
      bb = a;
      a = t1 + t2;
    }
    h_[0] += a;
    h_[1] += bb;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
    h_[5] += f;
    h_[6] += g;
    h_[7] += h;
  }
  uint32_t h_[8];
  uint64_t bits_;
  unsigned char buf_[64];
  size_t fill_;
};

/// Lower-case hex SHA-256 of ``n`` bytes.
inline std::string sha256_hex(const void* data, size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.hexdigest();
}

// ---------------------------------------------------------------------------------------
// JSON (RFC 8259), bounded
// ---------------------------------------------------------------------------------------
namespace json {

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Null;
  bool boolean = false;
  double number = 0.0;
  bool is_int = false;  ///< an integer literal that int64 holds exactly
  int64_t integer = 0;
  std::string string;
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;  ///< in document order, keys unique

  const Value* find(const std::string& key) const {
    if (kind != Object) return nullptr;
    for (const auto& kv : object)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
  bool is_null() const { return kind == Null; }
  bool is_string() const { return kind == String; }
  bool is_object() const { return kind == Object; }
  bool is_array() const { return kind == Array; }
};

struct Limits {
  size_t max_bytes = 64u << 20;  ///< the manifest's limit (refattn/bundle/storage/fsio.py)
  int max_depth = 128;
  size_t max_int_digits = 4300;  ///< as refattn/bundle/storage/manifest.py MAX_INT_DIGITS
};

namespace detail {

inline std::string shorten(const std::string& s, size_t n = 60) {
  return s.size() <= n ? s : s.substr(0, n - 3) + "...";
}

/// Strict UTF-8 (no overlong forms, no encoded surrogates, nothing past U+10FFFF), as
/// Python's ``bytes.decode("utf-8")``; returns the offset of the first bad byte or npos.
inline size_t utf8_error(const unsigned char* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else return i;
    if (i + len > n) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string::npos;
}

inline void put_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) out += char(cp);
  else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {  // a lone surrogate is kept (WTF-8), as Python's json keeps it
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

inline double to_double(const char* b, const char* e) {
#if defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L
  double v = 0.0;
  auto r = std::from_chars(b, e, v);
  if (r.ec == std::errc::result_out_of_range) {  // as Python: 1e400 is inf, 1e-400 is 0
    bool neg = *b == '-';
    const char* x = b;
    while (x < e && *x != 'e' && *x != 'E') ++x;
    bool tiny = x < e && x + 1 < e && x[1] == '-';
    double mag = tiny ? 0.0 : std::numeric_limits<double>::infinity();
    return neg ? -mag : mag;
  }
  return v;
#else
  std::istringstream in(std::string(b, e));
  in.imbue(std::locale::classic());
  double v = 0.0;
  in >> v;
  return v;
#endif
}

class Parser {
 public:
  Parser(const char* p, size_t n, const std::string& shown, const Limits& lim)
      : p_(p), n_(n), shown_(shown), lim_(lim) {}

  Value parse() {
    if (n_ > lim_.max_bytes)
      fail("is " + std::to_string(n_) + " bytes, more than the " +
           std::to_string(lim_.max_bytes) + " a refattn JSON document may have");
    size_t bad = utf8_error(reinterpret_cast<const unsigned char*>(p_), n_);
    if (bad != std::string::npos) {
      char b[8];
      std::snprintf(b, sizeof b, "%02x", unsigned(static_cast<unsigned char>(p_[bad])));
      throw Error(shown_ + ": is not UTF-8 text (byte 0x" + b + " at offset " +
                  std::to_string(bad) + ")");
    }
    Value v;
    ws();
    value(v, 0);
    ws();
    if (i_ != n_) fail("extra data after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw Error(shown_ + ": not valid JSON (" + why + " at offset " + std::to_string(i_) + ")");
  }
  void ws() {
    while (i_ < n_ && (p_[i_] == ' ' || p_[i_] == '\t' || p_[i_] == '\n' || p_[i_] == '\r')) ++i_;
  }
  bool lit(const char* word) {
    size_t L = std::strlen(word);
    if (n_ - i_ >= L && std::memcmp(p_ + i_, word, L) == 0) {
      i_ += L;
      return true;
    }
    return false;
  }
  void value(Value& v, int depth) {
    if (depth > lim_.max_depth)
      fail("nested deeper than the " + std::to_string(lim_.max_depth) + " levels allowed");
    if (i_ >= n_) fail("unexpected end");
    char c = p_[i_];
    if (c == '{') object(v, depth);
    else if (c == '[') array(v, depth);
    else if (c == '"') {
      v.kind = Value::String;
      string(v.string);
    } else if (lit("true")) {
      v.kind = Value::Bool;
      v.boolean = true;
    } else if (lit("false")) {
      v.kind = Value::Bool;
    } else if (lit("null")) {
      v.kind = Value::Null;
    } else if (c == '-' || (c >= '0' && c <= '9')) number(v);
    else fail("unexpected character");
  }
  void object(Value& v, int depth) {
    v.kind = Value::Object;
    std::set<std::string> seen;  // O(n log n) for an object of n keys, whatever they are
    ++i_;
    ws();
    if (i_ < n_ && p_[i_] == '}') {
      ++i_;
      return;
    }
    for (;;) {
      ws();
      if (i_ >= n_ || p_[i_] != '"') fail("expected a string key");
      std::string key;
      string(key);
      if (!seen.insert(key).second) fail("duplicate key '" + shorten(key) + "' in one object");
      ws();
      if (i_ >= n_ || p_[i_] != ':') fail("expected ':'");
      ++i_;
      ws();
      v.object.emplace_back(std::move(key), Value());
      value(v.object.back().second, depth + 1);
      ws();
      if (i_ < n_ && p_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < n_ && p_[i_] == '}') {
        ++i_;
        return;
      }
      fail("expected ',' or '}'");
    }
  }
  void array(Value& v, int depth) {
    v.kind = Value::Array;
    ++i_;
    ws();
    if (i_ < n_ && p_[i_] == ']') {
      ++i_;
      return;
    }
    for (;;) {
      ws();
      v.array.emplace_back();
      value(v.array.back(), depth + 1);
      ws();
      if (i_ < n_ && p_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < n_ && p_[i_] == ']') {
        ++i_;
        return;
      }
      fail("expected ',' or ']'");
    }
  }
  uint32_t hex4() {
    if (n_ - i_ < 4) fail("truncated \\u escape");
    uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      char c = p_[i_++];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= uint32_t(c - 'A' + 10);
      else fail("bad \\u escape");
    }
    return cp;
  }
  void string(std::string& out) {
    ++i_;  // the opening quote
    for (;;) {
      if (i_ >= n_) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(p_[i_]);
      if (c == '"') {
        ++i_;
        return;
      }
      if (c < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += char(c);
        ++i_;
        continue;
      }
      ++i_;
      if (i_ >= n_) fail("unterminated escape");
      char e = p_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF && n_ - i_ >= 6 && p_[i_] == '\\' && p_[i_ + 1] == 'u') {
            size_t save = i_;
            i_ += 2;
            uint32_t lo = hex4();
            if (lo >= 0xDC00 && lo <= 0xDFFF) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            else i_ = save;  // a lone high surrogate, then another escape
          }
          put_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }
  void number(Value& v) {
    size_t b = i_;
    if (p_[i_] == '-') ++i_;
    if (i_ >= n_) fail("bad number");
    if (p_[i_] == '0') ++i_;
    else if (p_[i_] >= '1' && p_[i_] <= '9') {
      while (i_ < n_ && p_[i_] >= '0' && p_[i_] <= '9') ++i_;
    } else fail("bad number");
    bool integral = true;
    if (i_ < n_ && p_[i_] == '.') {
      integral = false;
      ++i_;
      if (i_ >= n_ || !(p_[i_] >= '0' && p_[i_] <= '9')) fail("bad number");
      while (i_ < n_ && p_[i_] >= '0' && p_[i_] <= '9') ++i_;
    }
    if (i_ < n_ && (p_[i_] == 'e' || p_[i_] == 'E')) {
      integral = false;
      ++i_;
      if (i_ < n_ && (p_[i_] == '+' || p_[i_] == '-')) ++i_;
      if (i_ >= n_ || !(p_[i_] >= '0' && p_[i_] <= '9')) fail("bad number");
      while (i_ < n_ && p_[i_] >= '0' && p_[i_] <= '9') ++i_;
    }
    v.kind = Value::Number;
    if (integral) {
      size_t digits = i_ - b - (p_[b] == '-' ? 1 : 0);
      if (digits > lim_.max_int_digits)
        fail("an integer literal of " + std::to_string(digits) + " digits, more than the " +
             std::to_string(lim_.max_int_digits) + " any field could use");
      bool neg = p_[b] == '-';
      uint64_t mag = 0;
      bool fits = true;
      for (size_t k = b + (neg ? 1 : 0); k < i_; ++k) {
        uint64_t d = uint64_t(p_[k] - '0');
        if (mag > (std::numeric_limits<uint64_t>::max() - d) / 10) {
          fits = false;
          break;
        }
        mag = mag * 10 + d;
      }
      uint64_t top = neg ? (uint64_t(1) << 63) : (uint64_t(1) << 63) - 1;
      if (fits && mag <= top) {
        v.is_int = true;
        v.integer = neg ? (mag == (uint64_t(1) << 63) ? std::numeric_limits<int64_t>::min()
                                                       : -int64_t(mag))
                        : int64_t(mag);
      }
    }
    v.number = to_double(p_ + b, p_ + i_);
  }

  const char* p_;
  size_t n_;
  size_t i_ = 0;
  const std::string& shown_;
  Limits lim_;
};

}  // namespace detail

/// Parse ``n`` bytes of JSON; ``shown`` names them in every message.
inline Value parse(const char* p, size_t n, const std::string& shown, const Limits& lim = Limits()) {
  return detail::Parser(p, n, shown, lim).parse();
}

}  // namespace json

// ---------------------------------------------------------------------------------------
// Tensors and the safetensors format
// ---------------------------------------------------------------------------------------

/// The largest safetensors JSON header read (refattn/bundle/storage/read.py MAX_HEADER_BYTES).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
/// The largest manifest.json (refattn/bundle/storage/fsio.py MAX_MANIFEST_BYTES).
constexpr uint64_t kMaxManifestBytes = 64ull << 20;
/// The largest case file (fsio.py MAX_CASE_BYTES).
constexpr uint64_t kMaxCaseBytes = 4ull << 30;
/// Room for the header beyond the tensors (read.py _HEADER_SLACK).
constexpr uint64_t kHeaderSlack = 1ull << 20;

/// A safetensors dtype code's name in refattn's manifest and its item size (0: unknown).
inline std::pair<std::string, size_t> st_dtype(const std::string& code) {
  static const std::map<std::string, std::pair<std::string, size_t>> table = {
      {"F64", {"float64", 8}}, {"F32", {"float32", 4}}, {"F16", {"float16", 2}},
      {"BF16", {"bfloat16", 2}}, {"I64", {"int64", 8}}, {"I32", {"int32", 4}},
      {"I16", {"int16", 2}}, {"I8", {"int8", 1}}, {"U8", {"uint8", 1}},
      {"U16", {"uint16", 2}}, {"U32", {"uint32", 4}}, {"BOOL", {"bool", 1}}};
  auto it = table.find(code);
  return it == table.end() ? std::make_pair(std::string(), size_t(0)) : it->second;
}

/// The dtype codes a golden case file may hold: float64 and the manifest's other dtypes
/// (manifest-v1.json tensor_record: float64, bool, int64, uint8, uint16, uint32).
inline const std::vector<std::string>& golden_dtype_codes() {
  static const std::vector<std::string> codes = {"F64", "BOOL", "I64", "U8", "U16", "U32"};
  return codes;
}

/// One tensor's place in a safetensors file (offsets from the start of the file).
struct TensorEntry {
  std::string name;
  std::string dtype;  ///< refattn's name: float64, bool, int64, ...
  size_t itemsize = 0;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

/// A checked safetensors header: the tensors in file order and ``__metadata__``.
struct SafetensorsHeader {
  uint64_t length = 0;  ///< the JSON header's byte count n (tensor data starts at 8 + n)
  std::vector<TensorEntry> tensors;
  json::Value metadata;
  std::map<std::string, size_t> index;  ///< name -> position in ``tensors``
  const TensorEntry* find(const std::string& name) const {
    auto it = index.find(name);
    return it == index.end() ? nullptr : &tensors[it->second];
  }
};

namespace detail {
inline std::string quoted(const std::string& s) { return "'" + json::detail::shorten(s) + "'"; }

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// ``prod(shape) * itemsize`` or false when it overflows 64 bits.
inline bool span_bytes(const std::vector<int64_t>& shape, size_t itemsize, uint64_t& out) {
  uint64_t n = itemsize;
  for (int64_t d : shape) {
    uint64_t u = uint64_t(d);
    if (u != 0 && n > std::numeric_limits<uint64_t>::max() / u) return false;
    n *= u;
  }
  out = n;
  return true;
}
}  // namespace detail

/// Parse and check the header at the start of a safetensors file of ``file_size`` bytes;
/// ``head`` holds its first ``avail`` bytes (at least 8 + n for a well-formed file). The
/// rules of refattn/bundle/storage/read.py (parse_header, _layout): n <= 100 MiB, the header
/// inside the file, one JSON object without duplicate keys, each tensor's dtype among
/// ``codes``, a shape of <= 32 non-negative integers, data offsets [a, b] with 0 <= a <= b and
/// b - a == itemsize * prod(shape), the data covering the rest of the file exactly once.
inline SafetensorsHeader parse_header(const unsigned char* head, uint64_t avail, uint64_t file_size,
                                      const std::string& shown,
                                      const std::vector<std::string>& codes) {
  if (file_size < 8 || avail < 8)
    throw Error(shown + ": truncated file: " + std::to_string(file_size) + " bytes, no header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | head[i];
  if (n > kMaxHeaderBytes)
    throw Error(shown + ": corrupt safetensors header (it claims " + std::to_string(n) +
                " bytes, more than the " + std::to_string(kMaxHeaderBytes) +
                " a header may have)");
  if (8 + n > file_size || 8 + n > avail)
    throw Error(shown + ": truncated file: header needs " + std::to_string(8 + n) +
                " bytes, file has " + std::to_string(file_size));
  json::Limits lim;
  lim.max_bytes = size_t(kMaxHeaderBytes);
  json::Value doc;
  try {
    doc = json::parse(reinterpret_cast<const char*>(head + 8), size_t(n), shown + ": header", lim);
  } catch (const Error& e) {
    throw Error(shown + ": corrupt safetensors header (" +
                std::string(e.what()).substr(shown.size() + 10) + ")");
  }
  if (!doc.is_object())
    throw Error(shown + ": corrupt safetensors header (the header is not a JSON object)");
  SafetensorsHeader out;
  out.length = n;
  const uint64_t base = 8 + n;
  for (auto& kv : doc.object) {
    const std::string& name = kv.first;
    const json::Value& rec = kv.second;
    if (name == "__metadata__") {
      if (rec.is_object()) out.metadata = rec;
      else if (!(rec.is_null() || (rec.kind == json::Value::Bool && !rec.boolean)))
        throw Error(shown + ": corrupt safetensors header (__metadata__ is not an object)");
      continue;
    }
    std::string where = shown + ": tensor " + detail::quoted(name);
    const json::Value* dt = rec.find("dtype");
    bool known = dt && dt->is_string() &&
                 std::find(codes.begin(), codes.end(), dt->string) != codes.end();
    if (!known)
      throw Error(where + ": unsupported dtype " +
                  (dt && dt->is_string() ? detail::quoted(dt->string) : std::string("(none)")) +
                  " (this reader takes float64 and the bundle's declared dtypes)");
    TensorEntry t;
    t.name = name;
    auto info = st_dtype(dt->string);
    t.dtype = info.first;
    t.itemsize = info.second;
    const json::Value* shape = rec.find("shape");
    const json::Value* offs = rec.find("data_offsets");
    if (!shape || !shape->is_array() || shape->array.size() > 32)
      throw Error(where + ": malformed shape (a list of at most 32 non-negative integers)");
    for (const auto& d : shape->array) {
      if (d.kind != json::Value::Number || !d.is_int || d.integer < 0)
        throw Error(where + ": malformed shape (a list of at most 32 non-negative integers)");
      t.shape.push_back(d.integer);
    }
    if (!offs || !offs->is_array() || offs->array.size() != 2 ||
        offs->array[0].kind != json::Value::Number || !offs->array[0].is_int ||
        offs->array[1].kind != json::Value::Number || !offs->array[1].is_int ||
        offs->array[0].integer < 0 || offs->array[0].integer > offs->array[1].integer)
      throw Error(where + ": malformed data offsets (two integers 0 <= begin <= end)");
    uint64_t a = uint64_t(offs->array[0].integer), b = uint64_t(offs->array[1].integer);
    uint64_t need = 0;
    if (!detail::span_bytes(t.shape, t.itemsize, need) || b - a != need)
      throw Error(where + ": data offsets hold " + std::to_string(b - a) + " bytes, its shape " +
                  detail::shape_text(t.shape) + " " + dt->string + " needs " +
                  (need || t.shape.empty() ? std::to_string(need) : std::string("more")));
    if (b > file_size - base)
      throw Error(where + ": data offsets end at byte " + std::to_string(base + b) +
                  ", past the end of the file (" + std::to_string(file_size) + " bytes)");
    t.begin = base + a;
    t.end = base + b;
    out.tensors.push_back(std::move(t));
  }
  std::stable_sort(out.tensors.begin(), out.tensors.end(), [](const TensorEntry& x, const TensorEntry& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t end = base;
  for (const auto& t : out.tensors) {
    if (t.begin != end)
      throw Error(shown + ": tensor " + detail::quoted(t.name) + " starts at byte " +
                  std::to_string(t.begin) + ", expected " + std::to_string(end) +
                  " (tensor data must follow the header without gaps or overlaps)");
    end = t.end;
  }
  if (end != file_size)
    throw Error(shown + ": " + (end > file_size ? "truncated file" : "corrupt file") +
                ": its tensors end at byte " + std::to_string(end) + ", the file has " +
                std::to_string(file_size) + " bytes");
  for (size_t i = 0; i < out.tensors.size(); ++i) out.index[out.tensors[i].name] = i;
  return out;
}

/// One tensor of a case: C-order, its values widened to double (exact for every stored
/// dtype: float64 itself, bool, and integers below 2**53), and its raw little-endian bytes.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  ///< in elements, C order
  std::vector<double> values;
  std::vector<unsigned char> bytes;
  size_t size() const { return values.size(); }
  /// The element at a multi-index (bounds checked).
  double at(const std::vector<int64_t>& index) const {
    if (index.size() != shape.size())
      throw Error("tensor " + detail::quoted(name) + ": index of " + std::to_string(index.size()) +
                  " axes for a tensor of " + std::to_string(shape.size()));
    int64_t flat = 0;
    for (size_t i = 0; i < index.size(); ++i) {
      if (index[i] < 0 || index[i] >= shape[i])
        throw Error("tensor " + detail::quoted(name) + ": index " + std::to_string(index[i]) +
                    " outside axis " + std::to_string(i) + " of length " + std::to_string(shape[i]));
      flat += index[i] * strides[i];
    }
    return values[size_t(flat)];
  }
};

namespace detail {
inline std::vector<int64_t> c_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) s[i - 1] = s[i] * shape[i];
  return s;
}

inline double element(const unsigned char* p, const std::string& dtype) {
  if (dtype == "float64") {
    double v;
    std::memcpy(&v, p, 8);
    return v;
  }
  if (dtype == "float32") {
    float v;
    std::memcpy(&v, p, 4);
    return double(v);
  }
  if (dtype == "bool" || dtype == "uint8") return double(p[0]);
  if (dtype == "int8") return double(static_cast<signed char>(p[0]));
  if (dtype == "uint16" || dtype == "float16" || dtype == "bfloat16") {
    uint16_t v;
    std::memcpy(&v, p, 2);
    if (dtype == "uint16") return double(v);
    if (dtype == "bfloat16") {
      uint32_t b = uint32_t(v) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return double(f);
    }
    int e = (v >> 10) & 31, m = v & 1023;  // IEEE binary16
    double mag = e == 0 ? std::ldexp(double(m), -24)
                 : e == 31 ? (m ? std::numeric_limits<double>::quiet_NaN()
                                : std::numeric_limits<double>::infinity())
                           : std::ldexp(double(m + 1024), e - 25);
    return (v & 0x8000) ? -mag : mag;
  }
  if (dtype == "int16") {
    int16_t v;
    std::memcpy(&v, p, 2);
    return double(v);
  }
  if (dtype == "uint32") {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return double(v);
  }
  if (dtype == "int32") {
    int32_t v;
    std::memcpy(&v, p, 4);
    return double(v);
  }
  int64_t v;  // int64
  std::memcpy(&v, p, 8);
  return double(v);
}

inline Tensor make_tensor(const TensorEntry& e, const unsigned char* file) {
  Tensor t;
  t.name = e.name;
  t.dtype = e.dtype;
  t.shape = e.shape;
  t.strides = c_strides(e.shape);
  t.bytes.assign(file + e.begin, file + e.end);
  size_t n = e.itemsize ? size_t((e.end - e.begin) / e.itemsize) : 0;
  t.values.resize(n);
  for (size_t i = 0; i < n; ++i) t.values[i] = element(file + e.begin + i * e.itemsize, e.dtype);
  return t;
}

/// A regular file (no link followed) of at most ``limit`` bytes, read whole.
inline std::vector<unsigned char> read_file(const std::filesystem::path& path, uint64_t limit,
                                            const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::file_status st = fs::symlink_status(path, ec);
  if (ec || !fs::exists(st)) throw Error(path.string() + ": " + what + " not found");
  if (fs::is_symlink(st)) throw Error(path.string() + ": " + what + " is a link (not followed)");
  if (!fs::is_regular_file(st)) throw Error(path.string() + ": " + what + " is not a regular file");
  uint64_t size = fs::file_size(path, ec);
  if (ec) throw Error(path.string() + ": cannot read the " + what);
  if (size > limit)
    throw Error(path.string() + ": " + what + " of " + std::to_string(size) +
                " bytes exceeds the limit of " + std::to_string(limit) + " bytes");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path.string() + ": cannot open the " + what);
  std::vector<unsigned char> data(size_t(size), 0);  // the file's real size, checked above
  if (size && !in.read(reinterpret_cast<char*>(data.data()), std::streamsize(size)))
    throw Error(path.string() + ": " + what + " changed while it was read (shorter than " +
                std::to_string(size) + " bytes)");
  if (in.peek() != std::char_traits<char>::eof())
    throw Error(path.string() + ": " + what + " changed while it was read (longer than " +
                std::to_string(size) + " bytes)");
  return data;
}

/// A hex float of the manifest (``-?0x[01].[0-9a-f]+p[+-][0-9]+``), exactly.
inline double hex_float(const std::string& s, const std::string& where) {
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && s[i] == '-') {
    neg = true;
    ++i;
  }
  auto bad = [&]() -> double { throw Error(where + ": " + detail::quoted(s) + " is not a hex float like 0x1.8p-1"); };
  if (s.compare(i, 2, "0x") != 0) return bad();
  i += 2;
  if (i >= s.size() || (s[i] != '0' && s[i] != '1')) return bad();
  uint64_t mant = uint64_t(s[i] - '0');
  ++i;
  if (i >= s.size() || s[i] != '.') return bad();
  ++i;
  int frac_bits = 0;
  size_t start = i;
  while (i < s.size() && std::isxdigit(static_cast<unsigned char>(s[i])) && s[i] != 'p') {
    char c = s[i];
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0 || frac_bits >= 60) return bad();
    mant = (mant << 4) | uint64_t(d);
    frac_bits += 4;
    ++i;
  }
  if (i == start || i >= s.size() || s[i] != 'p') return bad();
  ++i;
  bool eneg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) {
    eneg = s[i] == '-';
    ++i;
  } else return bad();
  if (i >= s.size() || s.size() - i > 5) return bad();
  int e = 0;
  for (; i < s.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return bad();
    e = e * 10 + (s[i] - '0');
  }
  if (frac_bits > 52) return bad();  // more than a double holds: not refattn's
  double v = std::ldexp(double(mant), (eneg ? -e : e) - frac_bits);
  return neg ? -v : v;
}

inline bool matches_id(const std::string& s, size_t max_len, bool allow_dot_dash) {
  if (s.empty() || s.size() > max_len) return false;
  for (unsigned char c : s)
    if (!(std::isalnum(c) || c == '_' || (allow_dot_dash && (c == '.' || c == '-')))) return false;
  return true;
}

inline bool is_sha256(const json::Value* v) {
  if (!v || !v->is_string() || v->string.size() != 64) return false;
  for (char c : v->string)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}
}  // namespace detail

// ---------------------------------------------------------------------------------------
// The call description
// ---------------------------------------------------------------------------------------

/// The axes of the call (manifest ``call.axes``).
struct Axes {
  int64_t B = 0, Hq = 0, Hkv = 0, Q = 0, K = 0, Dk = 0, Dv = 0;
};

/// The scale (manifest ``call.scale``): scores = post * ((query * q) . (key * k)).
struct Scale {
  double value = 1.0;          ///< the effective logit multiplier
  double query = 1.0;          ///< operand multiplier of q
  double key = 1.0;            ///< operand multiplier of k
  double post = 1.0;           ///< multiplier of the q.k product
  std::string placement;       ///< post_qk_product, ...
  std::string source;          ///< default_dk_inverse_sqrt, explicit, ...
};

/// Dropout (manifest ``call.dropout``); the multiplier itself is the tensor
/// ``dropout_multiplier`` (B, Hq, Q, K), all ones without dropout.
struct Dropout {
  std::string mode = "none";   ///< none, stream, explicit_multiplier
  bool training = false;
  double p = 0.0;              ///< NaN when the manifest gives none (explicit multiplier)
};

/// What a kernel needs to reproduce the case: plain values and the dense tensors.
/// A tensor stored with broadcast axes (numpy's rule: its shape aligned to the right, size-1
/// axes repeated), read as the (B, Hq, Q, K) tensor it stands for; nothing is copied. An
/// absent tensor stands for ``fill`` everywhere.
struct ScoreView {
  std::string name;
  int64_t shape[4] = {0, 0, 0, 0};     ///< (B, Hq, Q, K)
  int64_t stride[4] = {0, 0, 0, 0};    ///< 0 on a broadcast axis
  std::shared_ptr<const Tensor> stored;  ///< the stored tensor (shared, immutable) or null
  double fill = 1.0;
  /// The element (b, h, i, j) (indices unchecked: loop within ``shape``).
  double operator()(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!stored) return fill;
    return stored->values[size_t(b * stride[0] + h * stride[1] + i * stride[2] + j * stride[3])];
  }
  int64_t size() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  /// Write the dense (B, Hq, Q, K) tensor, C order, into ``out`` (``n`` == size()): the caller
  /// owns the memory.
  void fill_dense(double* out, size_t n) const;
  /// The dense tensor, refused above ``max_bytes`` (default 1 GiB) before allocating.
  Tensor dense(uint64_t max_bytes = uint64_t(1) << 30) const;
};

/// What a kernel needs to reproduce the case: plain values and (B, Hq, Q, K) views.
struct Call {
  Axes axes;
  Scale scale;
  Dropout dropout;
  std::string score_family;    ///< dot, bilinear, additive, cosine
  std::string gqa_mapping;     ///< grouped, ...; head_map gives the kv head of each query head
  std::string causal_alignment;
  std::string all_masked_rows;
  double softcap = 0.0;        ///< 0: none
  bool has_bias = false, has_sink = false, has_query_valid = false;
  std::vector<int64_t> head_map;   ///< kv head of each query head (length Hq)
  ScoreView visible;           ///< visibility, 1 = legal (the stored ``visible``; all legal without)
  ScoreView dropout_multiplier;  ///< the multiplier Z (``dropout_multiplier``; 1 without)
};

// ---------------------------------------------------------------------------------------
// Cases and bundles
// ---------------------------------------------------------------------------------------

/// The yardstick of one tensor in one dtype: the naive algorithm's error in that dtype
/// (the largest over its saved-state routes) and the tensor's natural magnitude (0: none).
struct Yardstick {
  double reference_error = std::numeric_limits<double>::quiet_NaN();
  double natural_magnitude = 0.0;
  bool found() const { return !std::isnan(reference_error); }
};

class Bundle;

/// One case read from a bundle with every checksum verified.
class Case {
 public:
  const std::string& id() const { return id_; }
  const std::string& file() const { return file_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  bool has(const std::string& name) const { return find(name) != nullptr; }
  const Tensor* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }
  /// The tensor of a canonical name (q, k, v, output, lse, grad_q, ...).
  const Tensor& tensor(const std::string& name) const {
    const Tensor* t = find(name);
    if (!t) throw Error(file_ + ": tensor " + detail::quoted(name) + " is not in case " + detail::quoted(id_));
    return *t;
  }
  const json::Value& entry() const { return entry_; }
  const Call& call() const { return call_; }
  /// The yardstick of ``name`` in ``dtype`` (float32, float16, bfloat16) or one not found.
  Yardstick yardstick(const std::string& dtype, const std::string& name) const {
    auto it = yardsticks_.find(dtype + "/" + name);
    return it == yardsticks_.end() ? Yardstick() : it->second;
  }
  /// Set (or replace) a yardstick, e.g. one computed by ``refattn yardstick``.
  void set_yardstick(const std::string& dtype, const std::string& name, Yardstick y) {
    yardsticks_[dtype + "/" + name] = y;
  }

 private:
  friend class Bundle;
  std::string id_, file_;
  std::vector<Tensor> tensors_;
  json::Value entry_;
  Call call_;
  std::map<std::string, Yardstick> yardsticks_;
};

// ---------------------------------------------------------------------------------------
// The manifest's JSON Schema (refattn/bundle/schema/manifest-v1.json, embedded verbatim;
// tests/cpp/test_cpp.py checks the copy against the package's file) and a validator of the
// keywords it uses (JSON Schema 2020-12: type, $ref, properties, required,
// additionalProperties, propertyNames, items, minItems, maxItems, uniqueItems, enum, const,
// minimum, maximum, pattern, maxLength, oneOf, allOf, if/then), as refattn/bundle/storage/
// manifest.py's check_schema applies it with the jsonschema package
// ---------------------------------------------------------------------------------------
namespace schema {

inline const std::string& manifest_v1() {
  static const std::string text = R"refattn_schema({
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "$id": "https://refattn.invalid/schema/manifest-v1.json",
  "title": "refattn golden bundle manifest, schema version 1.x",
  "description": "DIR/manifest.json of a bundle written by `refattn golden`. Every 1.x minor version only adds fields, so unknown properties are allowed; every field refattn reads is described here and checked before it is used.",
  "type": "object",
  "required": ["schema", "schema_version", "cases"],
  "properties": {
    "schema": {"const": "refattn_golden"},
    "schema_version": {"type": "string", "pattern": "^1\\.[0-9]+$"},
    "suite": {"type": "string", "maxLength": 200},
    "generator": {
      "type": "object",
      "properties": {
        "refattn": {"type": "string"},
        "backend": {"type": "string"},
        "numpy": {"type": "string"},
        "blas": {"type": "array", "items": {"type": "object"}},
        "arithmetic": {"type": "object", "properties": {"mode": {"type": "string"}}}
      }
    },
    "sweep": {
      "description": "written by `refattn sweep`: the sweep this bundle holds (a directory holding another sweep is refused)",
      "type": "object",
      "required": ["id"],
      "properties": {
        "id": {"type": "string", "pattern": "^[0-9a-f]{1,64}$"},
        "name": {"type": "string", "maxLength": 200},
        "cases": {"$ref": "#/$defs/nonneg_int"}
      }
    },
    "cases": {
      "type": "object",
      "propertyNames": {"$ref": "#/$defs/case_id"},
      "additionalProperties": {"$ref": "#/$defs/case"}
    }
  },
  "$defs": {
    "case_id": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,200}$"},
    "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    "hex_float": {"type": "string", "pattern": "^-?0x[01]\\.[0-9a-f]+p[+-][0-9]+$"},
    "float_record": {
      "type": "object",
      "required": ["hex"],
      "properties": {"hex": {"$ref": "#/$defs/hex_float"}, "decimal": {"type": "string"}}
    },
    "nonneg_int": {"type": "integer", "minimum": 0, "maximum": 9007199254740992},
    "pos_int": {"type": "integer", "minimum": 1, "maximum": 9007199254740992},
    "shape": {"type": "array", "maxItems": 8, "items": {"$ref": "#/$defs/nonneg_int"}},
    "stride": {"type": "array", "maxItems": 8,
               "items": {"type": "integer", "minimum": -9007199254740992,
                         "maximum": 9007199254740992}},
    "layout": {
      "type": "object",
      "required": ["shape", "stride"],
      "properties": {"shape": {"$ref": "#/$defs/shape"}, "stride": {"$ref": "#/$defs/stride"},
                     "dtype": {"type": "string"}, "contiguous": {"type": "boolean"}}
    },
    "tensor_record": {
      "type": "object",
      "required": ["sha256", "dtype", "shape"],
      "properties": {
        "sha256": {"$ref": "#/$defs/sha256"},
        "dtype": {"enum": ["float64", "bool", "int64", "uint8", "uint16", "uint32"]},
        "shape": {"$ref": "#/$defs/shape"}
      }
    },
    "case": {
      "type": "object",
      "required": ["file", "sha256", "tensors", "call", "conventions", "flags"],
      "properties": {
        "file": {"type": "string", "pattern": "^cases/[A-Za-z0-9_.-]{1,200}\\.safetensors$"},
        "sha256": {"$ref": "#/$defs/sha256"},
        "comment": {"type": "string"},
        "flags": {"type": "array", "items": {"type": "string", "maxLength": 100},
                  "uniqueItems": true},
        "conventions": {"$ref": "#/$defs/conventions"},
        "tensors": {
          "type": "object",
          "propertyNames": {"type": "string", "pattern": "^[A-Za-z0-9_]{1,100}$"},
          "additionalProperties": {"$ref": "#/$defs/tensor_record"}
        },
        "call": {"$ref": "#/$defs/call"},
        "reference_error": {"type": "object"},
        "guarantee": {"$ref": "#/$defs/guarantee"},
        "quant": {"$ref": "#/$defs/quant"},
        "yardsticks": {"$ref": "#/$defs/yardsticks"}
      }
    },
    "yardsticks": {
      "description": "written by `refattn golden --with-yardsticks DTYPES` (schema 1.0 minor addition): per lower precision and tensor, the yardstick of the float32/float16/bfloat16 rule that the C++ header's refattn::compare multiplies by k: reference_error, the largest max|naive - golden| over the naive algorithm's saved-state routes run in that dtype, and natural_magnitude (0: none). The sha256s cover the case files, not this field: refattn verify recomputes every stored number and fails the case when one differs; Python's compare never reads them (docs/how-to/tolerances.md)",
      "type": "object",
      "propertyNames": {"enum": ["float32", "float16", "bfloat16"]},
      "additionalProperties": {
        "type": "object",
        "propertyNames": {"type": "string", "pattern": "^[A-Za-z0-9_]{1,100}$"},
        "additionalProperties": {
          "type": "object",
          "required": ["reference_error", "natural_magnitude"],
          "properties": {"reference_error": {"$ref": "#/$defs/nonneg_float_record"},
                         "natural_magnitude": {"$ref": "#/$defs/nonneg_float_record"}}
        }
      }
    },
    "nonneg_float_record": {
      "description": "a float record of a finite non-negative number (no sign, no inf or nan)",
      "type": "object",
      "required": ["hex"],
      "properties": {"hex": {"type": "string", "pattern": "^0x[01]\\.[0-9a-f]+p[+-][0-9]+$"},
                     "decimal": {"type": "string"}}
    },
    "guarantee": {
      "description": "a float64-generated case (generator numpy or numba; schema 1.0 minor addition): per computed tensor, the bound it is within of the correctly rounded result, as refattn verify applies it (docs/verify.md). elementwise: the largest |stored - correctly rounded| at any element (1e-12 x kappa x the tensor's natural magnitude); normwise_relative: the largest ||stored - ref|| / ||ref||; equal: integer and boolean tensors. Verify computes its own bound from its recomputation and refuses a record that names another generator or rule or allows any tensor more than its own",
      "type": "object",
      "required": ["generator", "rule", "forward_bound", "gradient_bound", "kappa", "tensors"],
      "properties": {
        "generator": {"enum": ["numpy", "numba"]},
        "rule": {"const": "float64_backend_bound"},
        "reference": {"type": "string", "maxLength": 200},
        "forward_bound": {"type": "number", "minimum": 0},
        "gradient_bound": {"type": "number", "minimum": 0},
        "kappa": {"type": "number", "minimum": 1},
        "tensors": {
          "type": "object",
          "propertyNames": {"type": "string", "pattern": "^[A-Za-z0-9_]{1,100}$"},
          "additionalProperties": {
            "type": "object",
            "additionalProperties": false,
            "properties": {
              "elementwise": {"type": "number", "minimum": 0},
              "normwise_relative": {"type": "number", "minimum": 0},
              "equal": {"const": true}
            }
          }
        }
      }
    },
    "quant": {
      "description": "a quantised case (refattn.quant, docs/quant.md): the QuantSpec as QuantSpec.to_manifest() writes it (read back with QuantSpec.from_manifest, which checks every field). The case file then also stores quant_<q|k|v>_codes (uint8 codes of the inputs the kernel reads as codes), quant_<q|k|v>_scale (float64 scales) and quant_<name>_mid / quant_<name>_rad (the emulated pipeline's intervals: output, lse, scores, row_max, probs_q, row_sum); verify recomputes every one of them",
      "type": "object",
      "required": ["spec"],
      "additionalProperties": false,
      "properties": {
        "spec": {"type": "object", "required": ["name"],
                 "properties": {"name": {"type": "string", "maxLength": 200}}}
      }
    },
    "conventions": {
      "type": "object",
      "properties": {
        "polarity": {"const": "true_means_legal"},
        "gqa_mapping": {"enum": ["grouped", "explicit"]},
        "all_masked_rows": {"$ref": "#/$defs/policy"},
        "returned_weights": {"$ref": "#/$defs/returned_weights"},
        "scale": {"$ref": "#/$defs/float_record"},
        "scale_placement": {"$ref": "#/$defs/placement"},
        "causal_alignment": {"type": "string"},
        "window_convention": {"type": "string"}
      }
    },
    "policy": {"enum": ["reject", "sanitize_then_zero_invalid_query"]},
    "returned_weights": {"enum": ["none", "pre_dropout", "post_dropout"]},
    "placement": {"enum": ["post", "q", "k", "split"]},
    "call": {
      "type": "object",
      "required": ["schema", "axes", "tensors", "visibility", "scale", "dropout", "backend"],
      "properties": {
        "schema": {"const": "attention_call_v1"},
        "axes": {
          "type": "object",
          "required": ["B", "Hq", "Hkv", "Q", "K", "Dk", "Dv"],
          "additionalProperties": {"$ref": "#/$defs/pos_int"}
        },
        "tensors": {
          "type": "object",
          "required": ["query", "key_physical", "value_physical", "head_map"],
          "properties": {
            "query": {"$ref": "#/$defs/layout"},
            "key_physical": {"$ref": "#/$defs/layout"},
            "value_physical": {"$ref": "#/$defs/layout"},
            "head_map": {
              "type": "object",
              "properties": {"mode": {"enum": ["grouped", "explicit"]}}
            }
          }
        },
        "visibility": {
          "type": "object",
          "required": ["all_masked_row_policy"],
          "properties": {
            "all_masked_row_policy": {"$ref": "#/$defs/policy"},
            "relation": {"oneOf": [{"type": "null"}, {"$ref": "#/$defs/relation"},
                                   {"$ref": "#/$defs/composition"}]}
          }
        },
        "bias": {
          "oneOf": [
            {"type": "null"},
            {"type": "object", "properties": {"stride": {"$ref": "#/$defs/stride"}}}
          ]
        },
        "scale": {
          "type": "object",
          "required": ["value", "source"],
          "properties": {
            "value": {"$ref": "#/$defs/float_record"},
            "source": {"enum": ["default_dk_inverse_sqrt", "explicit"]},
            "requested_placement": {"$ref": "#/$defs/placement"}
          }
        },
        "score": {
          "type": "object",
          "required": ["family"],
          "properties": {
            "family": {"enum": ["dot", "bilinear", "additive", "cosine"]},
            "eps": {"$ref": "#/$defs/float_record"},
            "max_workspace_elements": {"$ref": "#/$defs/pos_int"}
          },
          "allOf": [
            {"if": {"properties": {"family": {"const": "cosine"}}},
             "then": {"required": ["eps"]}},
            {"if": {"properties": {"family": {"const": "additive"}}},
             "then": {"required": ["max_workspace_elements"]}}
          ]
        },
        "score_modifiers": {
          "type": "object",
          "properties": {
            "softcap": {"oneOf": [{"type": "null"}, {"$ref": "#/$defs/float_record"}]}
          }
        },
        "dropout": {
          "type": "object",
          "required": ["mode"],
          "properties": {
            "mode": {"enum": ["none", "explicit_multiplier", "stream"]},
            "returned_weights": {"$ref": "#/$defs/returned_weights"}
          }
        },
        "backend": {
          "type": "object",
          "required": ["selected_backend"],
          "properties": {"selected_backend": {"type": "string"}}
        }
      }
    },
    "int_grid": {
      "type": "array",
      "maxItems": 1048576,
      "items": {"type": "array", "items": {"type": "integer", "minimum": -4611686018427387904,
                                           "maximum": 4611686018427387904}}
    },
    "composition": {
      "description": "a union (or) / intersection (and) of relations: refattn.masks.ComposedRelation",
      "type": "object",
      "required": ["schema", "op", "terms"],
      "properties": {
        "schema": {"const": "visibility_composition_v1"},
        "op": {"enum": ["or", "and"]},
        "terms": {"type": "array", "minItems": 2, "maxItems": 64,
                  "items": {"oneOf": [{"$ref": "#/$defs/relation"},
                                      {"$ref": "#/$defs/composition"}]}}
      }
    },
    "relation": {
      "type": "object",
      "required": ["schema", "q_positions", "k_positions", "key_valid", "causal", "window",
                   "segments", "prefix_length", "layout", "alignment", "window_convention"],
      "properties": {
        "schema": {"const": "visibility_relation_v1"},
        "q_positions": {"$ref": "#/$defs/int_grid"},
        "k_positions": {"$ref": "#/$defs/int_grid"},
        "key_valid": {
          "type": "object",
          "required": ["values"],
          "properties": {"values": {"type": "array",
                                    "items": {"type": "array", "items": {"type": "boolean"}}}}
        },
        "causal": {"type": "boolean"},
        "window": {
          "oneOf": [
            {"type": "null"},
            {"type": "object", "required": ["left", "right"]}
          ]
        },
        "segments": {
          "oneOf": [
            {"type": "null"},
            {"type": "object", "required": ["q", "k"],
             "properties": {"q": {"$ref": "#/$defs/int_grid"},
                            "k": {"$ref": "#/$defs/int_grid"}}}
          ]
        },
        "layout": {"type": "string"},
        "alignment": {"type": ["string", "null"]},
        "window_convention": {"type": ["string", "null"]}
      }
    }
  }
}
)refattn_schema";
  return text;
}

namespace detail {
inline bool equal(const json::Value& a, const json::Value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case json::Value::Null: return true;
    case json::Value::Bool: return a.boolean == b.boolean;
    case json::Value::Number:
      return (a.is_int && b.is_int) ? a.integer == b.integer : a.number == b.number;
    case json::Value::String: return a.string == b.string;
    case json::Value::Array:
      if (a.array.size() != b.array.size()) return false;
      for (size_t i = 0; i < a.array.size(); ++i)
        if (!equal(a.array[i], b.array[i])) return false;
      return true;
    case json::Value::Object:
      if (a.object.size() != b.object.size()) return false;
      for (const auto& kv : a.object) {
        const json::Value* o = b.find(kv.first);
        if (!o || !equal(kv.second, *o)) return false;
      }
      return true;
  }
  return false;
}
inline bool is_type(const json::Value& v, const std::string& t) {
  if (t == "object") return v.kind == json::Value::Object;
  if (t == "array") return v.kind == json::Value::Array;
  if (t == "string") return v.kind == json::Value::String;
  if (t == "boolean") return v.kind == json::Value::Bool;
  if (t == "null") return v.kind == json::Value::Null;
  if (t == "number") return v.kind == json::Value::Number;
  if (t == "integer")  // as jsonschema: an integral float (1.0) is an integer
    return v.kind == json::Value::Number && (v.is_int || (std::isfinite(v.number) && std::floor(v.number) == v.number));
  return false;
}
inline size_t codepoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}
/// a <= b for JSON numbers (exact for two int64 literals).
inline bool less_equal(const json::Value& a, const json::Value& b) {
  if (a.is_int && b.is_int) return a.integer <= b.integer;
  return a.number <= b.number;
}
}  // namespace detail

class Validator {
 public:
  explicit Validator(const json::Value& root) : root_(root) {}
  /// "" when ``v`` is valid, else the first violation found, with its JSON path.
  std::string check(const json::Value& v) { return run(v, root_, "", 0); }

 private:
  std::string run(const json::Value& v, const json::Value& s, const std::string& path, int depth) {
    if (depth > 256) return at(path) + "nested too deeply";
    if (s.kind == json::Value::Bool) return s.boolean ? "" : at(path) + "no value is allowed here";
    if (!s.is_object()) return "";
    std::string e;
    if (const json::Value* ref = s.find("$ref")) {
      const std::string pre = "#/$defs/";
      const json::Value* defs = root_.find("$defs");
      const json::Value* target = (ref->is_string() && ref->string.compare(0, pre.size(), pre) == 0 && defs)
                                      ? defs->find(ref->string.substr(pre.size()))
                                      : nullptr;
      if (!target) return at(path) + "unresolvable $ref in the schema";
      if (!(e = run(v, *target, path, depth + 1)).empty()) return e;
    }
    if (const json::Value* t = s.find("type")) {
      bool ok = false;
      if (t->is_string()) ok = detail::is_type(v, t->string);
      for (const auto& x : t->array) ok = ok || (x.is_string() && detail::is_type(v, x.string));
      if (!ok) return at(path) + "is not of type " + describe(*t);
    }
    if (const json::Value* c = s.find("const"))
      if (!detail::equal(v, *c)) return at(path) + "is not the constant the schema requires";
    if (const json::Value* en = s.find("enum")) {
      bool ok = false;
      for (const auto& x : en->array) ok = ok || detail::equal(v, x);
      if (!ok) return at(path) + "is not one of the schema's enum values";
    }
    if (v.kind == json::Value::Number) {
      if (const json::Value* mn = s.find("minimum"))
        if (mn->kind == json::Value::Number && !detail::less_equal(*mn, v)) return at(path) + "is less than the minimum";
      if (const json::Value* mx = s.find("maximum"))
        if (mx->kind == json::Value::Number && !detail::less_equal(v, *mx)) return at(path) + "is greater than the maximum";
    }
    if (v.is_string()) {
      if (const json::Value* ml = s.find("maxLength"))
        if (ml->is_int && int64_t(detail::codepoints(v.string)) > ml->integer)
          return at(path) + "is longer than " + std::to_string(ml->integer) + " characters";
      if (const json::Value* pat = s.find("pattern"))
        if (pat->is_string() && !std::regex_search(v.string, regex(pat->string)))
          return at(path) + "does not match " + pat->string;
    }
    if (v.is_array()) {
      if (const json::Value* mi = s.find("minItems"))
        if (mi->is_int && int64_t(v.array.size()) < mi->integer) return at(path) + "has too few items";
      if (const json::Value* mx = s.find("maxItems"))
        if (mx->is_int && int64_t(v.array.size()) > mx->integer)
          return at(path) + "has more than " + std::to_string(mx->integer) + " items";
      if (const json::Value* u = s.find("uniqueItems"))
        if (u->kind == json::Value::Bool && u->boolean && v.array.size() <= 4096)
          for (size_t i = 0; i < v.array.size(); ++i)
            for (size_t j = i + 1; j < v.array.size(); ++j)
              if (detail::equal(v.array[i], v.array[j])) return at(path) + "has non-unique items";
      if (const json::Value* it = s.find("items"))
        for (size_t i = 0; i < v.array.size(); ++i)
          if (!(e = run(v.array[i], *it, path + "/" + std::to_string(i), depth + 1)).empty()) return e;
    }
    if (v.is_object()) {
      const json::Value* props = s.find("properties");
      if (const json::Value* req = s.find("required"))
        for (const auto& r : req->array)
          if (r.is_string() && !v.find(r.string)) return at(path) + "'" + r.string + "' is a required property";
      const json::Value* addl = s.find("additionalProperties");
      const json::Value* names = s.find("propertyNames");
      for (const auto& kv : v.object) {
        std::string sub = path + "/" + json::detail::shorten(kv.first);
        if (names) {
          json::Value key;
          key.kind = json::Value::String;
          key.string = kv.first;
          if (!(e = run(key, *names, sub, depth + 1)).empty()) return e;
        }
        const json::Value* ps = props ? props->find(kv.first) : nullptr;
        if (ps) {
          if (!(e = run(kv.second, *ps, sub, depth + 1)).empty()) return e;
        } else if (addl) {
          if (!(e = run(kv.second, *addl, sub, depth + 1)).empty()) return e;
        }
      }
    }
    if (const json::Value* all = s.find("allOf"))
      for (const auto& x : all->array)
        if (!(e = run(v, x, path, depth + 1)).empty()) return e;
    if (const json::Value* one = s.find("oneOf")) {
      int n = 0;
      std::string first;
      for (const auto& x : one->array) {
        std::string r = run(v, x, path, depth + 1);
        if (r.empty()) ++n;
        else if (first.empty()) first = r;
      }
      if (n != 1) return at(path) + (n == 0 ? "matches none of oneOf (" + first + ")" : "matches more than one of oneOf");
    }
    if (const json::Value* cond = s.find("if")) {
      if (run(v, *cond, path, depth + 1).empty()) {
        if (const json::Value* then = s.find("then"))
          if (!(e = run(v, *then, path, depth + 1)).empty()) return e;
      } else if (const json::Value* other = s.find("else")) {
        if (!(e = run(v, *other, path, depth + 1)).empty()) return e;
      }
    }
    return "";
  }
  static std::string at(const std::string& path) { return (path.empty() ? "(top level)" : path.substr(1)) + ": "; }
  static std::string describe(const json::Value& t) {
    if (t.is_string()) return t.string;
    std::string s;
    for (const auto& x : t.array) s += (s.empty() ? "" : " or ") + x.string;
    return s;
  }
  const std::regex& regex(const std::string& pattern) {
    auto it = regexes_.find(pattern);
    if (it == regexes_.end()) it = regexes_.emplace(pattern, std::regex(pattern, std::regex::ECMAScript)).first;
    return it->second;
  }
  const json::Value& root_;
  std::map<std::string, std::regex> regexes_;
};

/// The first violation of manifest-v1.json in ``manifest`` ("" when it is valid).
inline std::string check_manifest(const json::Value& manifest) {
  static const json::Value root = json::parse(manifest_v1().data(), manifest_v1().size(), "manifest-v1.json");
  return Validator(root).check(manifest);
}

}  // namespace schema

namespace detail {
inline const json::Value& need(const json::Value& v, const std::string& key, const std::string& where) {
  const json::Value* x = v.find(key);
  if (!x) throw Error(where + ": " + quoted(key) + " is missing");
  return *x;
}
inline int64_t need_int(const json::Value& v, const std::string& key, const std::string& where,
                        int64_t lo, int64_t hi) {
  const json::Value& x = need(v, key, where);
  if (x.kind != json::Value::Number || !x.is_int || x.integer < lo || x.integer > hi)
    throw Error(where + "/" + key + ": expected an integer in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  return x.integer;
}
inline std::string opt_string(const json::Value& v, const std::string& key) {
  const json::Value* x = v.find(key);
  return x && x->is_string() ? x->string : std::string();
}
inline double float_record(const json::Value* rec, const std::string& where, double missing) {
  if (!rec || rec->is_null()) return missing;
  const json::Value* hex = rec->find("hex");
  if (!hex || !hex->is_string()) throw Error(where + ": expected a float record {hex, decimal}");
  return hex_float(hex->string, where);
}

/// The case entry's bounded fields, as manifest-v1.json describes them.
inline void check_entry(const std::string& id, const json::Value& e, const std::string& shown) {
  std::string where = shown + ": cases/" + json::detail::shorten(id);
  if (!matches_id(id, 200, true)) throw Error(where + ": case id does not match ^[A-Za-z0-9_.-]{1,200}$");
  if (!e.is_object()) throw Error(where + ": expected an object");
  const json::Value& file = need(e, "file", where);
  bool ok = file.is_string() && file.string.size() > 18 && file.string.compare(0, 6, "cases/") == 0 &&
            file.string.size() >= 12 &&
            file.string.compare(file.string.size() - 12, 12, ".safetensors") == 0 &&
            matches_id(file.string.substr(6, file.string.size() - 18), 200, true);
  if (!ok) throw Error(where + "/file: does not match ^cases/[A-Za-z0-9_.-]{1,200}\\.safetensors$");
  if (!is_sha256(e.find("sha256"))) throw Error(where + "/sha256: not 64 lower-case hex digits");
  const json::Value& tensors = need(e, "tensors", where);
  if (!tensors.is_object()) throw Error(where + "/tensors: expected an object");
  static const char* dtypes[] = {"float64", "bool", "int64", "uint8", "uint16", "uint32"};
  for (const auto& kv : tensors.object) {
    std::string tw = where + "/tensors/" + json::detail::shorten(kv.first);
    if (!matches_id(kv.first, 100, false)) throw Error(tw + ": tensor name does not match ^[A-Za-z0-9_]{1,100}$");
    if (!is_sha256(kv.second.find("sha256"))) throw Error(tw + "/sha256: not 64 lower-case hex digits");
    const json::Value* dt = kv.second.find("dtype");
    bool known = false;
    for (const char* d : dtypes) known = known || (dt && dt->is_string() && dt->string == d);
    if (!known) throw Error(tw + "/dtype: not one of float64, bool, int64, uint8, uint16, uint32");
    const json::Value* shape = kv.second.find("shape");
    if (!shape || !shape->is_array() || shape->array.size() > 8)
      throw Error(tw + "/shape: expected at most 8 integers in [0, 2**53]");
    for (const auto& d : shape->array)
      if (d.kind != json::Value::Number || !d.is_int || d.integer < 0 || d.integer > (int64_t(1) << 53))
        throw Error(tw + "/shape: expected at most 8 integers in [0, 2**53]");
  }
  for (const char* key : {"call", "conventions"})
    if (!need(e, key, where).is_object()) throw Error(where + "/" + key + ": expected an object");
  if (!need(e, "flags", where).is_array()) throw Error(where + "/flags: expected an array");
}

/// read.py case_size_limit: the tensors' bytes as the manifest lists them plus 1 MiB.
inline uint64_t case_size_limit(const json::Value& entry) {
  uint64_t total = kHeaderSlack;
  const json::Value* tensors = entry.find("tensors");
  if (!tensors) return kMaxCaseBytes;
  for (const auto& kv : tensors->object) {
    const json::Value* dt = kv.second.find("dtype");
    size_t item = 8;
    if (dt && dt->is_string() && (dt->string == "bool" || dt->string == "uint8")) item = 1;
    else if (dt && dt->is_string() && dt->string == "uint16") item = 2;
    else if (dt && dt->is_string() && dt->string == "uint32") item = 4;
    std::vector<int64_t> shape;
    for (const auto& d : kv.second.find("shape")->array) shape.push_back(d.integer);
    uint64_t n = 0;
    if (!span_bytes(shape, item, n) || n > kMaxCaseBytes || total + n > kMaxCaseBytes) return kMaxCaseBytes;
    total += n;
  }
  return total;
}

/// The (B, Hq, Q, K) view of a stored tensor (numpy broadcasting) or of ``fill``.
inline ScoreView score_view(const Tensor* src, const std::string& name, const Axes& a, double fill,
                            const std::string& shown) {
  ScoreView v;
  v.name = name;
  v.fill = fill;
  int64_t full[4] = {a.B, a.Hq, a.Q, a.K};
  for (int k = 0; k < 4; ++k) v.shape[k] = full[k];
  if (!src) return v;
  if (src->shape.size() > 4)
    throw Error(shown + ": tensor " + quoted(name) + ": " + std::to_string(src->shape.size()) +
                " axes, at most 4 broadcast to (B, Hq, Q, K)");
  size_t pad = 4 - src->shape.size();
  for (size_t k = 0; k < src->shape.size(); ++k) {
    int64_t n = src->shape[k];
    if (n != 1 && n != full[pad + k])
      throw Error(shown + ": tensor " + quoted(name) + ": shape " + shape_text(src->shape) +
                  " does not broadcast to (B, Hq, Q, K) = " +
                  shape_text({a.B, a.Hq, a.Q, a.K}));
    v.stride[pad + k] = n == 1 ? 0 : src->strides[k];
  }
  v.stored = std::make_shared<const Tensor>(*src);  // copies of the Case share it
  return v;
}
}  // namespace detail

inline void ScoreView::fill_dense(double* out, size_t n) const {
  if (n != size_t(size()))
    throw Error("tensor " + detail::quoted(name) + ": a buffer of " + std::to_string(n) +
                " elements for the " + std::to_string(size()) + " of (B, Hq, Q, K)");
  size_t f = 0;
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t i = 0; i < shape[2]; ++i)
        for (int64_t j = 0; j < shape[3]; ++j) out[f++] = (*this)(b, h, i, j);
}

inline Tensor ScoreView::dense(uint64_t max_bytes) const {
  double bytes = 8.0 * double(shape[0]) * double(shape[1]) * double(shape[2]) * double(shape[3]);
  if (bytes > double(max_bytes))
    throw Error("tensor " + detail::quoted(name) + ": the dense (B, Hq, Q, K) copy needs " +
                std::to_string(uint64_t(bytes)) + " bytes, more than the limit of " +
                std::to_string(max_bytes) + " (read it through the view instead)");
  Tensor t;
  t.name = name;
  t.dtype = stored ? stored->dtype : (name == "visible" ? "bool" : "float64");
  t.shape = {shape[0], shape[1], shape[2], shape[3]};
  t.strides = detail::c_strides(t.shape);
  t.values.resize(size_t(size()));
  fill_dense(t.values.data(), t.values.size());
  return t;
}

/// A golden bundle: DIR/manifest.json and DIR/cases/<case>.safetensors.
class Bundle {
 public:
  /// Read and check ``dir/manifest.json`` (a regular file of at most 64 MiB, strict JSON,
  /// schema refattn_golden 1.x, each case entry's fields bounded).
  static Bundle open(const std::string& dir) {
    Bundle b;
    b.dir_ = dir;
    std::filesystem::path mpath = std::filesystem::path(dir) / "manifest.json";
    std::string shown = mpath.string();
    std::vector<unsigned char> raw = detail::read_file(mpath, kMaxManifestBytes, "bundle manifest");
    json::Limits lim;
    lim.max_bytes = size_t(kMaxManifestBytes);
    b.manifest_ = json::parse(reinterpret_cast<const char*>(raw.data()), raw.size(), shown, lim);
    const json::Value& m = b.manifest_;
    if (!m.is_object()) throw Error(shown + ": expected a JSON object");
    const json::Value* schema = m.find("schema");
    if (!schema || !schema->is_string() || schema->string != "refattn_golden")
      throw Error(shown + ": schema is not 'refattn_golden'");
    const json::Value* version = m.find("schema_version");
    bool v1 = version && version->is_string() && version->string.size() >= 3 &&
              version->string.compare(0, 2, "1.") == 0 &&
              std::all_of(version->string.begin() + 2, version->string.end(),
                          [](char c) { return c >= '0' && c <= '9'; });
    if (!v1) throw Error(shown + ": schema_version is not 1.MINOR (this reader reads major 1)");
    std::string violation = schema::check_manifest(m);  // the published JSON Schema
    if (!violation.empty()) throw Error(shown + ": " + violation + " (schema manifest-v1.json)");
    const json::Value* cases = m.find("cases");
    if (!cases || !cases->is_object()) throw Error(shown + ": cases: expected an object");
    for (const auto& kv : cases->object) {
      detail::check_entry(kv.first, kv.second, shown);
      b.ids_.push_back(kv.first);
    }
    return b;
  }

  const std::string& dir() const { return dir_; }
  /// The case ids in manifest order.
  const std::vector<std::string>& cases() const { return ids_; }
  const json::Value& manifest() const { return manifest_; }

  /// Read one case: the file (a regular file inside the bundle, at most its manifest
  /// entry's size limit), its header and layout, every tensor's sha256 against the file's
  /// embedded hashes and the manifest, the file's sha256, then the call description.
  Case load(const std::string& case_id) const {
    const json::Value* entry = manifest_.find("cases")->find(case_id);
    if (!entry)
      throw Error(dir_ + "/manifest.json: case " + detail::quoted(case_id) + " is not in the bundle");
    const std::string file = entry->find("file")->string;
    std::filesystem::path path = std::filesystem::path(dir_) / file;
    std::string shown = path.string();
    uint64_t limit = detail::case_size_limit(*entry);
    std::vector<unsigned char> data = detail::read_file(path, limit, "case file");
    SafetensorsHeader header;
    try {
      header = parse_header(data.data(), data.size(), data.size(), shown, golden_dtype_codes());
    } catch (const Error& e) {
      std::string msg = e.what();
      if (msg.compare(0, shown.size() + 2, shown + ": ") == 0) msg = msg.substr(shown.size() + 2);
      throw Error(shown + ": not a readable refattn safetensors file (" + msg + ")");
    }
    // the file's own record of its tensors (__metadata__["refattn"], a JSON string)
    const json::Value* metastr = header.metadata.find("refattn");
    if (!metastr || !metastr->is_string())
      throw Error(shown + ": not a readable refattn safetensors file (no refattn metadata)");
    json::Value meta = json::parse(metastr->string.data(), metastr->string.size(), shown + ": refattn metadata");
    const json::Value* cid = meta.find("case_id");
    const json::Value* hashes = meta.find("tensors");
    bool meta_ok = cid && cid->is_string() && hashes && hashes->is_object();
    if (meta_ok)
      for (const auto& kv : hashes->object) meta_ok = meta_ok && kv.second.is_string();
    if (!meta_ok) throw Error(shown + ": refattn metadata lacks a case_id or its tensor hashes");
    std::map<std::string, std::string> embedded;  // sorted, as read.py checks them
    for (const auto& kv : hashes->object) embedded[kv.first] = kv.second.string;
    for (const auto& kv : embedded) {
      const TensorEntry* t = header.find(kv.first);
      if (!t) throw Error(shown + ": tensor " + detail::quoted(kv.first) + " is missing");
      if (sha256_hex(data.data() + t->begin, size_t(t->end - t->begin)) != kv.second)
        throw Error(shown + ": tensor " + detail::quoted(kv.first) + " fails its sha256 check");
    }
    for (const auto& t : header.tensors)
      if (!embedded.count(t.name))
        throw Error(shown + ": tensor " + detail::quoted(t.name) + " is not listed in the file's metadata");
    if (cid->string != case_id)
      throw Error(shown + ": the file holds case " + detail::quoted(cid->string) + ", the manifest entry is " +
                  detail::quoted(case_id));
    if (sha256_hex(data.data(), data.size()) != entry->find("sha256")->string)
      throw Error(shown + ": file sha256 differs from the bundle manifest");
    const json::Value* listed = entry->find("tensors");
    for (const auto& kv : listed->object) {
      const TensorEntry* t = header.find(kv.first);
      if (!t) throw Error(shown + ": tensor " + detail::quoted(kv.first) + " listed in the manifest is missing");
      if (kv.second.find("sha256")->string != embedded[kv.first])
        throw Error(shown + ": tensor " + detail::quoted(kv.first) + " sha256 differs from the manifest");
      std::vector<int64_t> mshape;
      for (const auto& d : kv.second.find("shape")->array) mshape.push_back(d.integer);
      if (mshape != t->shape || kv.second.find("dtype")->string != t->dtype)
        throw Error(shown + ": tensor " + detail::quoted(kv.first) + " is " + t->dtype + " " +
                    detail::shape_text(t->shape) + ", the manifest lists " +
                    kv.second.find("dtype")->string + " " + detail::shape_text(mshape));
    }
    std::set<std::string> in_manifest;
    for (const auto& kv : listed->object) in_manifest.insert(kv.first);
    for (const auto& t : header.tensors)
      if (!in_manifest.count(t.name))
        throw Error(shown + ": tensor " + detail::quoted(t.name) + " is not listed in the manifest");

    Case c;
    c.id_ = case_id;
    c.file_ = shown;
    c.entry_ = *entry;
    for (const auto& t : header.tensors) c.tensors_.push_back(detail::make_tensor(t, data.data()));
    c.call_ = describe(c, shown);
    read_yardsticks(c, *entry, shown);
    return c;
  }

  /// Read yardsticks from a JSON file ``{"cases": {CASE: {DTYPE: {TENSOR:
  /// {"reference_error": hex, "natural_magnitude": hex}}}}}`` (as ``refattn yardstick``
  /// would write, see docs/reference/cpp.md) into ``c``.
  static void load_yardsticks(Case& c, const std::string& path) {
    std::vector<unsigned char> raw = detail::read_file(path, kMaxManifestBytes, "yardstick file");
    json::Value doc = json::parse(reinterpret_cast<const char*>(raw.data()), raw.size(), path);
    const json::Value* cases = doc.find("cases");
    const json::Value* mine = cases ? cases->find(c.id()) : nullptr;
    if (mine) read_yardstick_table(c, *mine, path);
  }

 private:
  static void read_yardstick_table(Case& c, const json::Value& table, const std::string& where) {
    if (!table.is_object()) throw Error(where + ": yardsticks of case " + detail::quoted(c.id()) + ": expected an object");
    for (const auto& d : table.object) {
      if (d.first != "float32" && d.first != "float16" && d.first != "bfloat16")
        throw Error(where + ": yardstick dtype " + detail::quoted(d.first) + " is not float32, float16 or bfloat16");
      for (const auto& t : d.second.object) {
        std::string w = where + ": yardstick " + d.first + "/" + json::detail::shorten(t.first);
        Yardstick y;
        y.reference_error = detail::float_record(t.second.find("reference_error"), w, std::nan(""));
        y.natural_magnitude = detail::float_record(t.second.find("natural_magnitude"), w, 0.0);
        if (!(y.reference_error >= 0) || !std::isfinite(y.reference_error) || !(y.natural_magnitude >= 0) ||
            !std::isfinite(y.natural_magnitude))
          throw Error(w + ": expected finite non-negative reference_error and natural_magnitude");
        c.set_yardstick(d.first, t.first, y);
      }
    }
  }
  static void read_yardsticks(Case& c, const json::Value& entry, const std::string& where) {
    const json::Value* y = entry.find("yardsticks");
    if (y) read_yardstick_table(c, *y, where + " (manifest entry)");
  }

  static Call describe(const Case& c, const std::string& shown) {
    std::string where = shown + ": call";
    const json::Value& call = *c.entry_.find("call");
    Call out;
    const json::Value& axes = detail::need(call, "axes", where);
    const int64_t big = int64_t(1) << 40;
    out.axes.B = detail::need_int(axes, "B", where + "/axes", 0, big);
    out.axes.Hq = detail::need_int(axes, "Hq", where + "/axes", 0, big);
    out.axes.Hkv = detail::need_int(axes, "Hkv", where + "/axes", 0, big);
    out.axes.Q = detail::need_int(axes, "Q", where + "/axes", 0, big);
    out.axes.K = detail::need_int(axes, "K", where + "/axes", 0, big);
    out.axes.Dk = detail::need_int(axes, "Dk", where + "/axes", 0, big);
    out.axes.Dv = detail::need_int(axes, "Dv", where + "/axes", 0, big);
    const json::Value& scale = detail::need(call, "scale", where);
    out.scale.value = detail::float_record(scale.find("value"), where + "/scale/value", 1.0);
    if (const json::Value* om = scale.find("operand_multipliers")) {
      out.scale.query = detail::float_record(om->find("query"), where + "/scale/operand_multipliers", 1.0);
      out.scale.key = detail::float_record(om->find("key"), where + "/scale/operand_multipliers", 1.0);
      out.scale.post = detail::float_record(om->find("post"), where + "/scale/operand_multipliers", 1.0);
    } else {
      out.scale.post = out.scale.value;
    }
    out.scale.placement = detail::opt_string(scale, "placement");
    out.scale.source = detail::opt_string(scale, "source");
    if (const json::Value* dr = call.find("dropout")) {
      out.dropout.mode = detail::opt_string(*dr, "mode");
      const json::Value* tr = dr->find("training");
      out.dropout.training = tr && tr->kind == json::Value::Bool && tr->boolean;
      const json::Value* p = dr->find("p");
      out.dropout.p = p && p->kind == json::Value::Number ? p->number : std::nan("");
    }
    if (const json::Value* score = call.find("score")) out.score_family = detail::opt_string(*score, "family");
    if (const json::Value* mods = call.find("score_modifiers")) {
      out.softcap = detail::float_record(mods->find("softcap"), where + "/score_modifiers/softcap", 0.0);
      const json::Value* sink = mods->find("sink");
      out.has_sink = sink && !sink->is_null();
    }
    const json::Value& conv = *c.entry_.find("conventions");
    out.gqa_mapping = detail::opt_string(conv, "gqa_mapping");
    out.causal_alignment = detail::opt_string(conv, "causal_alignment");
    out.all_masked_rows = detail::opt_string(conv, "all_masked_rows");
    out.has_bias = c.has("bias");
    out.has_query_valid = c.has("query_valid");
    if (const Tensor* hm = c.find("head_map")) {
      for (double v : hm->values) {
        if (!(v >= 0 && v < double(out.axes.Hkv)))
          throw Error(shown + ": tensor 'head_map': value " + std::to_string(v) + " outside [0, Hkv=" +
                      std::to_string(out.axes.Hkv) + ")");
        out.head_map.push_back(int64_t(v));
      }
    }
    // views, not copies: the stored tensors are checked to broadcast to (B, Hq, Q, K); a
    // dense copy is made only on request (ScoreView::dense, under a byte limit)
    out.visible = detail::score_view(c.find("visible"), "visible", out.axes, 1.0, shown);
    out.dropout_multiplier =
        detail::score_view(c.find("dropout_multiplier"), "dropout_multiplier", out.axes, 1.0, shown);
    return out;
  }

  std::string dir_;
  json::Value manifest_;
  std::vector<std::string> ids_;
};

// ---------------------------------------------------------------------------------------
// The tolerance rule (refattn/bundle/comparison/harness.py _numeric, tolerances.py)
// ---------------------------------------------------------------------------------------

/// The settings of both rules, with `refattn compare`'s defaults (tolerances.Tolerances).
struct Tolerances {
  double atol = 1e-12, rtol = 1e-10;       ///< float64: |a-g| <= atol + rtol*|g| per element
  double k_forward = 2.0, k_gradient = 3.0;  ///< lower precision: k * yardstick + floor
  double floor_factor = 2.0, floor_shift = 0.3;
  double natural_floor = 8.0;
  double k_for(const std::string& name) const {
    bool grad = name.compare(0, 5, "grad_") == 0 || name.compare(0, 7, "row_dot") == 0;
    return grad ? k_gradient : k_forward;
  }
};

/// The verdict on one tensor, as a row of the Python report (harness.TensorReport).
struct TensorReport {
  std::string name;
  std::string rule;        ///< float64, reference_relative, exact, structure
  std::string precision;   ///< float64, float32, float16, bfloat16
  bool passed = false;
  std::string reason;      ///< why it failed (empty when it passed)
  std::vector<int64_t> shape;
  int64_t compared = 0;
  double max_abs_error = 0.0;
  double bound = 0.0;      ///< at the worst element (float64) or for the tensor
  double margin = 0.0;     ///< error - bound at the worst element (> 0 fails)
  bool has_worst = false;
  std::vector<int64_t> worst_index;
  double worst_candidate = std::numeric_limits<double>::quiet_NaN();
  double worst_golden = std::numeric_limits<double>::quiet_NaN();
  int64_t failing_count = 0;
  int64_t nan_mismatches = 0, nonfinite_mismatches = 0;
  double reference_error = std::numeric_limits<double>::quiet_NaN();  ///< lower precision only
  /// One line: ``FAIL output float64 max_err ... bound ... worst (0, 0, 1, 0) a vs g``.
  std::string line() const;
};

namespace detail {
/// Python's repr(float): the shortest text that reads back exactly.
inline std::string plain(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}
inline std::string index_text(const std::vector<int64_t>& idx) {
  std::string s = "(";
  for (size_t i = 0; i < idx.size(); ++i) s += (i ? ", " : "") + std::to_string(idx[i]);
  return s + (idx.size() == 1 ? ",)" : ")");
}
inline std::string sci(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.3e", x);
  return buf;
}
inline std::vector<int64_t> unravel(size_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] > 0) {
      idx[i] = int64_t(flat % size_t(shape[i]));
      flat /= size_t(shape[i]);
    }
  }
  return idx;
}
inline int cls(double x) { return std::isnan(x) ? 1 : std::isinf(x) ? (x > 0 ? 2 : 3) : 0; }

/// Round a double to the nearest float16 (ties to even; beyond the range: inf), as numpy's
/// ``astype(float16)``.
inline double round_f16(double x) {
  if (!std::isfinite(x)) return x;
  double a = std::fabs(x);
  if (a >= 65520.0) return std::copysign(std::numeric_limits<double>::infinity(), x);
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int q = std::max(e - 11, -24);  // the quantum's exponent: 11 significant bits, subnormals 2^-24
  double r = std::nearbyint(std::ldexp(a, -q));  // default rounding mode: ties to even
  return std::copysign(std::ldexp(r, q), x);
}
/// Round a float32 to the nearest bfloat16 (ties to even), as ml_dtypes does.
inline float round_bf16(float f) {
  if (std::isnan(f)) return f;
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7FFFu + ((b >> 16) & 1u);
  b &= 0xFFFF0000u;
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}
/// ``x`` (a double) stored in ``dtype`` and read back as double (tolerances.round_to).
inline double to_dtype(double x, const std::string& dtype) {
  if (dtype == "float64") return x;
  if (dtype == "float32") return double(float(x));
  if (dtype == "float16") return round_f16(x);
  return double(round_bf16(float(x)));  // ml_dtypes: double -> float -> bfloat16
}
/// One operation of ``dtype`` on values of ``dtype``: float32 arithmetic, rounded to dtype
/// (numpy's float16 and ml_dtypes' bfloat16 evaluate each op in float32).
inline double op_in(double r32, const std::string& dtype) {
  if (dtype == "float32") return double(float(r32));
  if (dtype == "float16") return round_f16(double(float(r32)));
  return double(round_bf16(float(r32)));
}
struct FloatInfo {
  int minexp, nmant;
};
inline FloatInfo info(const std::string& dtype) {
  if (dtype == "float32") return {-126, 23};
  if (dtype == "float16") return {-14, 10};
  if (dtype == "bfloat16") return {-126, 7};
  return {-1022, 52};
}
/// tolerances.ulp: spacing of dtype's numbers at |x|.
inline double ulp(double x, const std::string& dtype) {
  FloatInfo fi = info(dtype);
  x = std::fabs(x);
  int e = x > 0 ? std::max(int(std::floor(std::log2(x))), fi.minexp) : fi.minexp;
  return std::ldexp(1.0, e - fi.nmant);
}
/// tolerances.rounding_floor (mode "bound"): factor * max(max|fl(g + s - s) - g|, ulp(max|g| + s)).
inline double rounding_floor(const std::vector<double>& g, const std::string& dtype, double shift,
                             double factor) {
  double s = to_dtype(shift, dtype);
  double realized = 0.0, top = 0.0;
  bool any = false;
  for (double v : g) {
    if (!std::isfinite(v)) continue;
    double x = to_dtype(v, dtype);
    if (!std::isfinite(x)) continue;
    any = true;
    double t = op_in(double(float(x) + float(s)), dtype);  // fl(x + s) in dtype
    double y = op_in(double(float(t) - float(s)), dtype);  // fl(t - s) in dtype
    realized = std::max(realized, std::fabs(y - v));
    top = std::max(top, std::fabs(v));
  }
  if (!any) return 0.0;
  return factor * std::max(realized, ulp(top + shift, dtype));
}
}  // namespace detail

inline std::string TensorReport::line() const {
  std::string s = std::string(passed ? "ok   " : "FAIL ") + name + " " + rule + " max_err " +
                  detail::sci(max_abs_error) + " bound " + detail::sci(bound) + " margin " +
                  detail::sci(margin);
  if (has_worst)
    s += " worst " + detail::index_text(worst_index) + " " + detail::plain(worst_candidate) + " vs " +
         detail::plain(worst_golden);
  if (!passed) s += ": " + reason;
  return s;
}

/// Compare ``n`` candidate values (C order, widened to double) of tensor ``name`` with case
/// ``c`` under the rule of ``dtype``, the precision the candidate was computed in: float64
/// per element; float32, float16 or bfloat16 against the case's yardstick for that dtype.
inline TensorReport compare(const Case& c, const std::string& name, const double* candidate, size_t n,
                            const std::string& dtype, const Tolerances& tol = Tolerances()) {
  if (dtype != "float64" && dtype != "float32" && dtype != "float16" && dtype != "bfloat16")
    throw Error("dtype: expected one of float64, float32, float16, bfloat16, got " + detail::quoted(dtype));
  TensorReport r;
  r.name = name;
  r.precision = dtype;
  const Tensor* gt = c.find(name);
  if (!gt) {
    r.rule = "structure";
    r.reason = "unexpected tensor: the golden case has no such name";
    return r;
  }
  const Tensor& g = *gt;
  r.shape = g.shape;
  if (n != g.size()) {
    r.rule = "structure";
    r.reason = "candidate of " + std::to_string(n) + " elements where the golden has " +
               std::to_string(g.size()) + " (shape " + detail::shape_text(g.shape) + ")";
    return r;
  }
  if (g.dtype != "float64") {  // booleans and integers must match exactly
    r.rule = "exact";
    r.compared = int64_t(n);
    size_t first = n;
    for (size_t i = 0; i < n; ++i)
      if (!(candidate[i] == g.values[i])) {
        if (first == n) first = i;
        ++r.failing_count;
      }
    r.passed = r.failing_count == 0;
    if (!r.passed) {
      r.has_worst = true;
      r.worst_index = detail::unravel(first, g.shape);
      r.worst_candidate = candidate[first];
      r.worst_golden = g.values[first];
      r.max_abs_error = r.margin = std::numeric_limits<double>::infinity();
      r.reason = std::to_string(r.failing_count) + " element(s) differ; first at " +
                 detail::index_text(r.worst_index);
    }
    return r;
  }
  bool low = dtype != "float64";
  std::vector<std::string> reasons;
  size_t first_class = n, wflat = n;
  double best = -std::numeric_limits<double>::infinity(), max_err = 0.0, wbound = 0.0;
  Yardstick y;
  double bound = 0.0;
  if (low) {
    r.rule = "reference_relative";
    y = c.yardstick(dtype, name);
    if (!y.found()) {
      r.reason = "no naive " + dtype + " reference for " + detail::quoted(name) +
                 "; cannot apply the reference-relative rule (write the bundle with "
                 "--with-yardsticks or load a yardstick file)";
      return r;
    }
    double floor = detail::rounding_floor(g.values, dtype, tol.floor_shift, tol.floor_factor);
    if (tol.natural_floor > 0 && y.natural_magnitude > 0)
      floor = std::max(floor, tol.natural_floor * detail::ulp(1.0, dtype) / 2 * y.natural_magnitude);
    bound = tol.k_for(name) * y.reference_error + floor;
    r.reference_error = y.reference_error;
  } else {
    r.rule = "float64";
  }
  for (size_t i = 0; i < n; ++i) {
    double cv = candidate[i], gv = g.values[i];
    double expected = low ? detail::to_dtype(gv, dtype) : gv;
    int cc = detail::cls(cv), cg = detail::cls(expected);
    if (std::isnan(cv) != std::isnan(gv)) ++r.nan_mismatches;
    if (cc != cg) {
      ++r.nonfinite_mismatches;
      if (first_class == n) first_class = i;
    }
    if (cc != 0 || cg != 0) continue;
    ++r.compared;
    double err = std::fabs(cv - gv);
    max_err = std::max(max_err, err);
    if (!low) {
      double allowed = tol.atol + tol.rtol * std::fabs(gv);
      double viol = err - allowed;
      if (viol > 0) ++r.failing_count;
      if (viol > best) {  // the first maximum, as numpy's argmax
        best = viol;
        wflat = i;
        wbound = allowed;
      }
    } else {
      if (err > bound) ++r.failing_count;
      if (wflat == n || err > best) {
        best = err;
        wflat = i;
      }
    }
  }
  if (r.nonfinite_mismatches)
    reasons.push_back("non-finite positions differ at " + std::to_string(r.nonfinite_mismatches) +
                      " element(s), first " + detail::index_text(detail::unravel(first_class, g.shape)) + ": " +
                      detail::plain(candidate[first_class]) + " vs " + detail::plain(g.values[first_class]));
  r.max_abs_error = max_err;
  if (!low) {
    r.bound = r.compared ? wbound : 0.0;
    r.margin = r.compared ? best : 0.0;
  } else {
    r.bound = bound;
    r.margin = r.compared ? max_err - bound : -bound;
  }
  if (r.failing_count) {
    std::string limit = low ? detail::plain(tol.k_for(name)) + " * naive " + dtype + " error " +
                                  detail::sci(y.reference_error) + " + floor"
                            : "atol " + detail::plain(tol.atol) + " + rtol " + detail::plain(tol.rtol) + "*|g|";
    reasons.push_back(std::to_string(r.failing_count) + " of " + std::to_string(r.compared) +
                      " element(s) exceed " + limit + "; worst error " + detail::sci(max_err) +
                      " over bound " + detail::sci(r.bound) + " by " + detail::sci(r.margin));
  }
  if (low && r.compared && max_err == 0.0) wflat = 0;  // numpy's argmax of an all-zero error
  if (wflat != n) {
    r.has_worst = true;
    r.worst_index = detail::unravel(wflat, g.shape);
    r.worst_candidate = candidate[wflat];
    r.worst_golden = g.values[wflat];
  }
  r.passed = reasons.empty();
  for (size_t i = 0; i < reasons.size(); ++i) r.reason += (i ? "; " : "") + reasons[i];
  if (!r.passed) r.reason = c.file() + ": tensor " + detail::quoted(name) + ": " + r.reason;
  return r;
}

/// :func:`compare` for a candidate held in a std::vector of double.
inline TensorReport compare(const Case& c, const std::string& name, const std::vector<double>& candidate,
                            const std::string& dtype, const Tolerances& tol = Tolerances()) {
  return compare(c, name, candidate.data(), candidate.size(), dtype, tol);
}

/// :func:`compare` for a float32 candidate (widened exactly); ``dtype`` float32, float16 or
/// bfloat16 (the values of a float16/bfloat16 kernel held in float).
inline TensorReport compare(const Case& c, const std::string& name, const std::vector<float>& candidate,
                            const std::string& dtype, const Tolerances& tol = Tolerances()) {
  std::vector<double> wide(candidate.begin(), candidate.end());
  return compare(c, name, wide.data(), wide.size(), dtype, tol);
}

}  // namespace refattn

#ifdef REFATTN_IMPLEMENTATION
#include "refattn.h"
#include "refattn_capi.inl"
#endif

#endif  // REFATTN_HPP
