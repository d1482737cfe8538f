// CPU backend of the collectives (communicator.h) over the TCP store: every collective is one
// store exchange of each rank's bytes, then each rank reduces what it needs in rank order
// (f32 accumulation), which makes the result deterministic and identical on every rank. Traffic
// is world x size per rank: meant for tests, the CPU reference and small CPU runs, not speed.
#include <cstring>

#include "core/dtype.h"
#include "dist/communicator.h"

namespace opd::dist {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

void Communicator::check_tensor(const char* call, const char* name, const Tensor& t) const {
  OPD_CHECK(t.defined(), InvalidArgument, call, ": ", name, " is undefined");
  OPD_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, InvalidArgument, call, ": ",
            name, " ", t.describe(), " must be f32 or bf16");
  OPD_CHECK(t.device() == device(), InvalidArgument, call, ": ", name, " ", t.describe(),
            " is not on the ", backend(), " communicator's device");
}

namespace {

float load(const char* base, DType dt, int64_t i) {
  if (dt == DType::F32) {
    float v;
    std::memcpy(&v, base + i * 4, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, base + i * 2, 2);
  return bf16_to_float(b);
}

void store_value(void* base, DType dt, int64_t i, float v) {
  if (dt == DType::F32) static_cast<float*>(base)[i] = v;
  else static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
}

std::string desc(const char* call, const Tensor& t, const char* extra = "") {
  return cat(call, " ", dtype_name(t.dtype()), "[", t.numel(), "]", extra);
}

class CpuCommunicator final : public Communicator {
 public:
  explicit CpuCommunicator(std::shared_ptr<Store> store) : Communicator(std::move(store)) {}
  const char* backend() const override { return "cpu"; }
  Device device() const override { return Device::CPU; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    check_tensor("all_reduce", "tensor", t);
    OPD_CHECK(t.writable(), InvalidArgument, "all_reduce: tensor is read-only");
    auto parts = exchange(desc("all_reduce", t, op == ReduceOp::Sum ? " sum" : " avg"), t);
    reduce_block(parts, t.dtype(), 0, t.numel(), op, t.raw());
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    check_tensor("reduce_scatter", "in", in);
    check_tensor("reduce_scatter", "out", out);
    OPD_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * world_size(),
              InvalidArgument, "reduce_scatter: in ", in.describe(), " must hold world_size (",
              world_size(), ") x out ", out.describe(), " elements of one dtype");
    OPD_CHECK(out.writable(), InvalidArgument, "reduce_scatter: out is read-only");
    auto parts = exchange(desc("reduce_scatter", in, op == ReduceOp::Sum ? " sum" : " avg"), in);
    reduce_block(parts, in.dtype(), out.numel() * rank(), out.numel(), op, out.raw());
  }

  void all_gather(const Tensor& in, Tensor& out) override {
    check_tensor("all_gather", "in", in);
    check_tensor("all_gather", "out", out);
    OPD_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * world_size(),
              InvalidArgument, "all_gather: out ", out.describe(), " must hold world_size (",
              world_size(), ") x in ", in.describe(), " elements of one dtype");
    OPD_CHECK(out.writable(), InvalidArgument, "all_gather: out is read-only");
    // The payload is copied into the exchange before out is written, so in may alias out.
    auto parts = exchange(desc("all_gather", in), in);
    char* dst = static_cast<char*>(out.raw());
    for (int r = 0; r < world_size(); ++r) std::memcpy(dst + r * in.nbytes(), parts[r].data(), in.nbytes());
  }

  void broadcast(Tensor& t, int root) override {
    check_tensor("broadcast", "tensor", t);
    OPD_CHECK(root >= 0 && root < world_size(), InvalidArgument, "broadcast: root ", root,
              " is outside [0, ", world_size(), ")");
    const std::string d = desc("broadcast", t, cat(" from ", root).c_str());
    std::string_view mine = rank() == root
                                ? std::string_view(static_cast<const char*>(t.raw()), t.nbytes())
                                : std::string_view();
    auto parts = store_->exchange(d, mine);
    OPD_CHECK(parts[root].size() == t.nbytes(), Io, "broadcast: rank ", root, " sent ",
              parts[root].size(), " bytes, expected ", t.nbytes());
    if (rank() != root) {
      OPD_CHECK(t.writable(), InvalidArgument, "broadcast: tensor is read-only");
      std::memcpy(t.raw(), parts[root].data(), t.nbytes());
    }
  }

  void synchronize() override {}

 private:
  std::vector<std::string> exchange(const std::string& d, const Tensor& t) {
    auto parts = store_->exchange(d, std::string_view(static_cast<const char*>(t.raw()), t.nbytes()));
    for (int r = 0; r < world_size(); ++r)
      OPD_CHECK(parts[r].size() == t.nbytes(), Io, d, ": rank ", r, " sent ", parts[r].size(),
                " bytes, expected ", t.nbytes());
    return parts;
  }

  // out[i] = sum_r parts[r][offset + i] in rank order, in f32; / world for Avg.
  void reduce_block(const std::vector<std::string>& parts, DType dt, int64_t offset, int64_t n,
                    ReduceOp op, void* out) const {
    for (int64_t i = 0; i < n; ++i) {
      float acc = load(parts[0].data(), dt, offset + i);
      for (int r = 1; r < world_size(); ++r) acc += load(parts[r].data(), dt, offset + i);
      if (op == ReduceOp::Avg) acc = acc / static_cast<float>(world_size());
      store_value(out, dt, i, acc);
    }
  }
};

}  // namespace

std::unique_ptr<Communicator> make_cpu_communicator(std::shared_ptr<Store> store) {
  OPD_CHECK(store != nullptr, InvalidArgument, "make_cpu_communicator: no store");
  return std::make_unique<CpuCommunicator>(std::move(store));
}

}  // namespace opd::dist
