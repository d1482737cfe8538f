// A minimal safetensors reader for the PyTorch op fixtures (tests/fixtures/ops, written by
// tools/make_op_fixtures.py): 8-byte little-endian header length, JSON header, raw data;
// F64/F32/I32/I64 only. A stand-in until model/safetensors is merged into this branch.
#pragma once

#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>  // the JSON header
#include <stdexcept>
#include <string>

#include "core/tensor.h"

namespace opd::test {

class Fixture {
 public:
  explicit Fixture(const std::string& path) : path_(path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open fixture " + path);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    uint64_t n = 0;
    for (int i = 7; i >= 0 && bytes.size() >= 8; --i) n = n << 8 | static_cast<uint8_t>(bytes[i]);
    if (bytes.size() < 8 || n > bytes.size() - 8) throw std::runtime_error("bad header: " + path);
    auto header = nlohmann::json::parse(bytes.substr(8, n));
    const std::map<std::string, DType> dtypes = {
        {"F64", DType::F64}, {"F32", DType::F32}, {"I32", DType::I32}, {"I64", DType::I64}};
    size_t data_size = bytes.size() - 8 - n;
    for (auto& [name, e] : header.items()) {
      if (name == "__metadata__") continue;
      Tensor t = Tensor::empty(e.at("shape").get<Shape>(), dtypes.at(e.at("dtype")));
      size_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
      if (begin > end || end > data_size || end - begin != t.nbytes())
        throw std::runtime_error("bad offsets for " + name + " in " + path);
      if (t.nbytes()) std::memcpy(t.raw(), bytes.data() + 8 + n + begin, t.nbytes());
      tensors_.emplace(name, t);
    }
  }
  const Tensor& operator[](const std::string& name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) throw std::runtime_error("no tensor " + name + " in " + path_);
    return it->second;
  }

 private:
  std::string path_;
  std::map<std::string, Tensor> tensors_;
};

}  // namespace opd::test
