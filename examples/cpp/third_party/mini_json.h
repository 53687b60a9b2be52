// A small JSON reader (RFC 8259 values; \u escapes decoded to UTF-8): enough for
// an artifact's manifest.json, schema.json and preprocessor.json and for rows given as JSON.
// Header-only and dependency-free so the client builds anywhere libtorch does.
#pragma once

#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mini_json {

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::vector<Value> items;
  std::map<std::string, Value> fields;

  bool has(const std::string& key) const { return kind == Object && fields.count(key) > 0; }
  const Value& operator[](const std::string& key) const {
    auto it = fields.find(key);
    if (kind != Object || it == fields.end()) throw std::runtime_error("missing field " + key);
    return it->second;
  }
  const Value& operator[](size_t i) const { return items.at(i); }
  size_t size() const { return kind == Array ? items.size() : fields.size(); }
  bool is_null() const { return kind == Null; }
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  Value parse() {
    Value v = value();
    space();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;
  size_t depth_ = 0;
  // Arrays and objects nest at most this deep: each level is a stack frame of value(), and a
  // file of a million '[' would otherwise overflow the stack.
  static constexpr size_t kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& why) {
    throw std::runtime_error("JSON: " + why + " at offset " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  void literal(const char* word) {
    for (const char* p = word; *p; ++p, ++i_)
      if (i_ >= s_.size() || s_[i_] != *p) fail(std::string("expected ") + word);
  }
  Value value() {
    space();
    if (i_ >= s_.size()) fail("unexpected end");
    Value v;
    char c = s_[i_];
    if ((c == '{' || c == '[') && depth_ >= kMaxDepth)
      fail("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    struct Level {
      size_t& depth;
      ~Level() { --depth; }
    } level{++depth_};
    if (c == '{') {
      v.kind = Value::Object, ++i_;
      if (eat('}')) return v;
      do {
        space();
        std::string key = string();
        if (!eat(':')) fail("expected ':'");
        v.fields[key] = value();
      } while (eat(','));
      if (!eat('}')) fail("expected '}'");
    } else if (c == '[') {
      v.kind = Value::Array, ++i_;
      if (eat(']')) return v;
      do v.items.push_back(value()); while (eat(','));
      if (!eat(']')) fail("expected ']'");
    } else if (c == '"') {
      v.kind = Value::String, v.text = string();
    } else if (c == 't' || c == 'f') {
      v.kind = Value::Bool, v.boolean = c == 't';
      literal(c == 't' ? "true" : "false");
    } else if (c == 'n') {
      literal("null");
    } else {
      v.kind = Value::Number;
      const char* start = s_.c_str() + i_;
      char* end = nullptr;
      v.number = std::strtod(start, &end);
      if (end == start) fail("expected a value");
      i_ += static_cast<size_t>(end - start);
    }
    return v;
  }
  // The four hex digits after `\u` (i_ on the `u`; left on the last digit).
  unsigned long hex4() {
    if (i_ + 4 >= s_.size()) fail("bad \\u escape");
    unsigned long code = 0;
    for (int k = 1; k <= 4; ++k) {
      char c = s_[i_ + k];
      int digit = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
      if (digit < 0) fail("bad \\u escape");
      code = code * 16 + static_cast<unsigned long>(digit);
    }
    i_ += 4;
    return code;
  }
  static void utf8(unsigned long code, std::string& out) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }
  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string");
    std::string out;
    for (++i_; i_ < s_.size() && s_[i_] != '"'; ++i_) {
      if (s_[i_] != '\\') { out += s_[i_]; continue; }
      if (++i_ >= s_.size()) break;
      switch (s_[i_]) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          unsigned long code = hex4();
          if (code >= 0xD800 && code < 0xDC00) {  // a surrogate pair: one code point
            if (i_ + 2 >= s_.size() || s_[i_ + 1] != '\\' || s_[i_ + 2] != 'u') fail("lone surrogate");
            i_ += 2;
            unsigned long low = hex4();
            if (low < 0xDC00 || low >= 0xE000) fail("bad surrogate pair");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          }
          utf8(code, out);
          break;
        }
        default: out += s_[i_];
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mini_json
