// raytorch_client: a classifier artifact's AOTInductor program (model.pt2) run from C++.
//
//   raytorch_client <artifact folder or its latest pointer> <rows.csv | rows.json>
//
// Checks every file against the manifest's sha256, refuses a model.pt2 built by another torch
// or for a machine or CPU this one cannot run, preprocesses each row as the served endpoint
// does (tabular: standardised columns; images: pixels scaled by the fitted mean and std), and
// prints one JSON line a row: {"label": ..., "probabilities": [...]}. Text models are out of scope (their
// tokenizer lives in Python). CSV: a header naming the columns (tabular) or pixel values a
// line (images), RFC 4180 quoting; JSON: an array of rows, each an array of numbers or an
// object of columns. Exit 3 and one line on a refusal, 1 on any other error.

#include <ATen/Version.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <sys/utsname.h>
#include <torch/headeronly/version.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "third_party/mini_json.h"
#include "third_party/sha256.h"

namespace {

using mini_json::Value;
using Rows = std::vector<std::vector<float>>;

struct Refusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Refusal(path + ": cannot be read");
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

Value read_json(const std::string& path) {
  try {
    return mini_json::parse(read_file(path));
  } catch (const Refusal&) {
    throw;
  } catch (const std::exception& e) {
    throw Refusal(path + ": " + e.what());
  }
}

// Every file the manifest lists, checked before any is parsed; the ones read here must be listed.
void verify_files(const std::string& folder, const Value& manifest) {
  for (const char* needed : {"model.pt2", "schema.json", "preprocessor.json"})
    if (!manifest["files"].has(needed))
      throw Refusal(std::string(needed) + ": not listed (hashed) in the manifest's files");
  for (const auto& [name, entry] : manifest["files"].fields) {
    std::string data = read_file(folder + "/" + name);
    if (static_cast<double>(data.size()) != entry["size"].number)
      throw Refusal(name + ": size " + std::to_string(data.size()) + " differs from the manifest");
    if (sha256::hex(data) != entry["sha256"].text) throw Refusal(name + ": sha256 mismatch (altered)");
  }
}

std::string release(const std::string& version) { return version.substr(0, version.find('+')); }

int capability_rank(const std::string& name) {
  const char* order[] = {"DEFAULT", "AVX2", "AVX512"};
  for (int i = 0; i < 3; ++i)
    if (name == order[i]) return i;
  return -1;
}

// The manifest's word on model.pt2 against this process: same torch, a CPU that runs its code.
void check_program(const Value& manifest) {
  if (!manifest.has("programs") || !manifest["programs"].has("model.pt2"))
    throw Refusal("model.pt2: not in this artifact (export with export.formats=[onnx,aoti])");
  const Value& info = manifest["programs"]["model.pt2"];
  if (release(info["torch"].text) != release(TORCH_VERSION))
    throw Refusal("model.pt2: built by torch " + info["torch"].text + ", this client links libtorch " +
                  TORCH_VERSION);
  struct utsname host;
  if (info.has("machine") && !info["machine"].is_null() && uname(&host) == 0 &&
      info["machine"].text != host.machine)
    throw Refusal("model.pt2: compiled for " + info["machine"].text + ", this machine is " +
                  host.machine);
  if (info.has("cpu_capability") && !info["cpu_capability"].is_null()) {
    std::string built = info["cpu_capability"].text, here = at::get_cpu_capability();
    int b = capability_rank(built), h = capability_rank(here);
    if (built != here && (b < 0 || h < 0 || h < b))
      throw Refusal("model.pt2: compiled for CPU capability " + built + ", this CPU has " + here);
  }
}

// What the served endpoint does to a row before the model: (value - mean) / std.
struct Preprocessing {
  std::vector<std::string> columns;  // tabular: the feature columns, in the model's order
  std::vector<int64_t> shape;        // one row's tensor shape
  std::vector<float> mean, std;      // per feature (tabular) or per channel / one (images)
  size_t width = 1;

  static Preprocessing from(const Value& schema, const Value& state) {
    Preprocessing p;
    std::string kind = schema["kind"].text;
    auto numbers = [](const Value& v) {
      std::vector<float> out;
      if (v.kind == Value::Number) out.push_back(static_cast<float>(v.number));
      for (const auto& x : v.items) out.push_back(static_cast<float>(x.number));
      return out;
    };
    if (kind == "tabular") {
      for (const auto& c : schema["feature_columns"].items) p.columns.push_back(c.text);
      p.shape = {static_cast<int64_t>(p.columns.size())};
    } else if (kind == "image" && !state.has("image_processor")) {
      for (const auto& d : state["image_shape"].items) p.shape.push_back(static_cast<int64_t>(d.number));
    } else {
      throw Refusal("preprocessor.json: kind " + kind +
                    (kind == "image" ? " with a pretrained image processor" : "") +
                    " is not supported by the C++ client (tabular and plain images are)");
    }
    p.mean = state.has("mean") ? numbers(state["mean"]) : std::vector<float>{0.f};
    p.std = state.has("std") ? numbers(state["std"]) : std::vector<float>{1.f};
    for (auto d : p.shape) p.width *= static_cast<size_t>(d);
    for (const auto* stats : {&p.mean, &p.std})  // one value, one per channel, or one per value
      if (stats->empty() || stats->size() != p.mean.size() || p.width % stats->size() != 0)
        throw Refusal("preprocessor.json: mean and std must have one value or one per channel or feature");
    return p;
  }

  // Index of the mean/std that applies to position i of a row.
  size_t stat(size_t i) const {
    if (mean.size() == 1) return 0;
    if (mean.size() == width) return i;
    return i / (width / mean.size());  // per channel: channels first
  }

  at::Tensor features(Rows& rows) const {
    for (auto& row : rows)
      for (size_t i = 0; i < row.size(); ++i) row[i] = (row[i] - mean[stat(i)]) / std[stat(i)];
    std::vector<float> flat;
    for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
    std::vector<int64_t> sizes{static_cast<int64_t>(rows.size())};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    return at::from_blob(flat.data(), sizes, at::kFloat).clone();
  }
};

float number(const std::string& cell, size_t line, const std::string& column) {
  char* end = nullptr;
  float v = std::strtof(cell.c_str(), &end);
  if (cell.empty() || *end != '\0' || !std::isfinite(v))
    throw Refusal("row " + std::to_string(line) + ", column " + column + ": " + cell +
                  " is not a finite number");
  return v;
}

// One CSV line's cells (RFC 4180: a quoted cell may hold commas and doubled quotes).
std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted && c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
      out.back() += '"', ++i;
    } else if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      out.emplace_back();
    } else if (c != '\r' || quoted) {
      out.back() += c;
    }
  }
  for (auto& cell : out) {
    cell.erase(0, cell.find_first_not_of(" \t"));
    cell.erase(cell.find_last_not_of(" \t") + 1);
  }
  return out;
}

Rows read_csv(const std::string& path, const Preprocessing& p) {
  std::ifstream in(path);
  if (!in) throw Refusal(path + ": cannot be read");
  std::string line;
  std::vector<size_t> order;  // tabular: position of each feature column in a line
  size_t header = 0;          // tabular: the header's cell count, once read
  Rows rows;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (n == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 BOM
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto cells = split(line);
    if (header == 0 && !p.columns.empty()) {
      header = cells.size();
      for (const auto& c : p.columns) {
        size_t at = 0;
        while (at < cells.size() && cells[at] != c) ++at;
        if (at == cells.size()) throw Refusal(path + ": no column " + c + " in the header");
        order.push_back(at);
      }
      continue;
    }
    if (header != 0 && cells.size() != header)
      throw Refusal(path + ": row " + std::to_string(n) + " has " + std::to_string(cells.size()) +
                    " cells, the header " + std::to_string(header));
    std::vector<float> row;
    if (!order.empty()) {
      for (size_t j = 0; j < order.size(); ++j) row.push_back(number(cells[order[j]], n, p.columns[j]));
    } else {
      for (size_t j = 0; j < cells.size(); ++j) row.push_back(number(cells[j], n, std::to_string(j)));
    }
    if (row.size() != p.width)
      throw Refusal(path + ": row " + std::to_string(n) + " has " + std::to_string(row.size()) +
                    " values, the model takes " + std::to_string(p.width));
    rows.push_back(std::move(row));
  }
  return rows;
}

Rows read_json_rows(const std::string& path, const Preprocessing& p) {
  Value doc = read_json(path);
  Rows rows;
  for (size_t r = 0; r < doc.items.size(); ++r) {
    const Value& item = doc.items[r];
    std::vector<float> row;
    auto value = [&](const Value& v, const std::string& field) {
      if (v.kind != Value::Number || !std::isfinite(v.number))
        throw Refusal(path + ": row " + std::to_string(r) + ", " + field + ": not a finite number");
      return static_cast<float>(v.number);
    };
    if (item.kind == Value::Object) {
      for (const auto& c : p.columns) {
        if (!item.has(c)) throw Refusal(path + ": row " + std::to_string(r) + " has no " + c);
        row.push_back(value(item[c], c));
      }
    } else if (item.kind == Value::Array) {
      for (size_t j = 0; j < item.items.size(); ++j) row.push_back(value(item.items[j], std::to_string(j)));
    } else {
      throw Refusal(path + ": row " + std::to_string(r) + " is neither an array nor an object");
    }
    if (row.size() != p.width)
      throw Refusal(path + ": row " + std::to_string(r) + " has " + std::to_string(row.size()) +
                    " values, the model takes " + std::to_string(p.width));
    rows.push_back(std::move(row));
  }
  return rows;
}

// A version folder as given, or `<registry>/<name>/latest` (a file naming the version).
std::string artifact_folder(const std::string& path) {
  if (std::ifstream(path + "/manifest.json")) return path;
  std::string version = read_file(path);
  version.erase(version.find_last_not_of(" \n\r\t") + 1);
  if (version.empty() || version.find_first_not_of("0123456789") != std::string::npos)
    throw Refusal(path + ": neither an artifact folder nor a `latest` pointer");
  return path.substr(0, path.find_last_of('/') + 1) + version;
}

// A JSON string literal of `text` (UTF-8 passes through; quotes and controls escaped).
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\', out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

void print(const at::Tensor& logits, const Value& labels) {
  at::Tensor out = logits.contiguous();
  const float* z = out.data_ptr<float>();
  int64_t n = out.size(0), k = out.size(1);
  std::cout.precision(9);
  for (int64_t i = 0; i < n; ++i, z += k) {
    float top = z[0];
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j)
      if (z[j] > top) top = z[j], best = j;
    double total = 0;
    std::vector<double> e(k);
    for (int64_t j = 0; j < k; ++j) total += e[j] = std::exp(static_cast<double>(z[j] - top));
    std::cout << "{\"label\": " << quoted(labels[best].text) << ", \"probabilities\": [";
    for (int64_t j = 0; j < k; ++j) std::cout << (j ? ", " : "") << e[j] / total;
    std::cout << "]}\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " <artifact folder> <rows.csv | rows.json>\n";
    return 2;
  }
  std::string input = argv[2];
  try {
    std::string folder = artifact_folder(argv[1]);
    Value manifest = read_json(folder + "/manifest.json");
    verify_files(folder, manifest);
    check_program(manifest);
    Value schema = read_json(folder + "/schema.json");
    auto pre = Preprocessing::from(schema, read_json(folder + "/preprocessor.json"));
    bool json = input.size() >= 5 && input.substr(input.size() - 5) == ".json";
    Rows rows = json ? read_json_rows(input, pre) : read_csv(input, pre);
    if (rows.empty()) throw Refusal(input + ": no rows");
    torch::inductor::AOTIModelPackageLoader loader(folder + "/model.pt2");
    print(loader.run({pre.features(rows)})[0], schema["labels"]);
  } catch (const Refusal& e) {
    std::cerr << "refused: " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
