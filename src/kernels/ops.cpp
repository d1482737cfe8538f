// Tensor-level dispatch for kernels/ops.h: validates definedness, devices, dtypes and shapes
// (errors name the op and every tensor's dtype and shape), then routes CPU f32/f64 tensors to
// the reference kernels in kernels/cpu/ and CUDA tensors to kernels/cuda/ where one exists.
#include "kernels/ops.h"

#include <cmath>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#ifdef OPD_WITH_CUDA
#include "core/cuda/allocator.h"   // cuda::current_stream
#include "kernels/cuda/cuda_ops.h"  // the CUDA kernels (raw pointers)
#include "kernels/cuda/gemm.h"      // cuBLASLt dense layers
#endif

namespace opd::ops {

namespace {

// How a tensor takes part in an op, which decides the dtype rule it must follow.
enum class Role {
  In,     // float input: the op's dtype
  Out,    // float output (written or accumulated): the op's dtype, writable
  Index,  // int32 data (ids, targets, positions, cu_seqlens)
  Table,  // float constant whose precision is independent of the op's (rope inv_freq)
};

struct Arg {
  const char* name;
  const Tensor* tensor;
  Role role;
};

// The validation context of one op call: every message carries the op name and all tensors.
class OpCheck {
 public:
  OpCheck(const char* op, std::vector<Arg> args) : op_(op), args_(std::move(args)) {
    for (const Arg& a : args_) {
      OPD_CHECK(a.tensor->defined(), InvalidArgument, op_, ": tensor ", a.name,
                " is undefined");
    }
    device_ = args_.front().tensor->device();
    for (const Arg& a : args_) {
      // A CUDA op may read a small host table (rope's inv_freq): it is uploaded per call.
      const bool host_table = a.role == Role::Table && a.tensor->device() == Device::CPU;
      expect(a.tensor->device() == device_ || host_table, "all tensors must be on the same device");
    }
  }

  const char* op() const { return op_; }
  Device device() const { return device_; }

  std::string describe() const {
    std::string s = "(";
    for (size_t i = 0; i < args_.size(); ++i) {
      s += cat(i ? ", " : "", args_[i].name, " ", args_[i].tensor->describe());
    }
    return s + ")";
  }

  // The message parts are only concatenated on failure: these checks run on every op call.
  template <typename... Parts>
  void expect(bool cond, const Parts&... what) const {
    if (!cond) OPD_FAIL(InvalidArgument, op_, ": ", what..., " ", describe());
  }

  void expect_shape(const char* name, const Tensor& t, const Shape& want) const {
    if (t.shape() != want) {
      expect(false, name, " must have shape ", shape_str(want), ", got ", shape_str(t.shape()));
    }
  }

  void expect_ndim(const char* name, const Tensor& t, int ndim) const {
    if (t.ndim() != ndim) {
      expect(false, name, " must be ", ndim, "-d, got ", shape_str(t.shape()));
    }
  }

  // Ops without a CUDA kernel yet: refuse CUDA tensors with a clear message.
  void require_cpu() const {
    if (device_ != Device::CPU) OPD_FAIL(Unsupported, op_, " on CUDA is not implemented yet");
  }

  // CPU dtype rules: float inputs/outputs share one dtype, f32 or f64; index tensors are i32;
  // outputs are writable. Returns the shared float dtype.
  DType cpu_float_dtype() const {
    const Arg* first = nullptr;  // the first float tensor sets the op's dtype
    for (const Arg& a : args_) {
      DType dt = a.tensor->dtype();
      if (a.role == Role::Index) {
        expect(dt == DType::I32, a.name, " must be i32, got ", dtype_name(dt));
      } else if (a.role == Role::Table) {
        expect(dt == DType::F32 || dt == DType::F64, a.name, " must be f32 or f64, got ",
               dtype_name(dt));
      } else if (!first) {
        first = &a;
      } else {
        expect(dt == first->tensor->dtype(), "float tensors must share one dtype, but ", a.name,
               " is ", dtype_name(dt), " and ", first->name, " is ",
               dtype_name(first->tensor->dtype()));
      }
    }
    DType dtype = first ? first->tensor->dtype() : DType::F32;
    if (dtype != DType::F32 && dtype != DType::F64) {
      if (dtype_is_float(dtype)) {
        OPD_FAIL(Unsupported, op_, ": dtype ", dtype_name(dtype),
                 " on the CPU is not implemented (f32 or f64) ", describe());
      }
      expect(false, "expects f32 or f64 tensors, got ", dtype_name(dtype));
    }
    for (const Arg& a : args_) {
      if (a.role == Role::Out) expect(a.tensor->writable(), a.name, " is read-only");
    }
    return dtype;
  }

  // Runs fn(T{}) with T = float or double, the C++ type of cpu_float_dtype() (checked first):
  // the reference kernels are templates, so one call site serves both precisions. Returns fn's
  // result.
  template <typename Fn>
  decltype(auto) on_cpu(Fn&& fn) const {
    if (cpu_float_dtype() == DType::F32) return fn(float{});
    return fn(double{});
  }

  // CUDA dtype rules: index tensors are i32, tables f32, the tensors named in `f32` are f32,
  // those in `free` are left to the caller, and every other float tensor shares one dtype,
  // f32 or bf16, which is returned; outputs are writable.
  DType cuda_float_dtype(std::initializer_list<const char*> f32 = {},
                         std::initializer_list<const char*> free = {}) const {
    auto named = [](std::initializer_list<const char*> list, const char* name) {
      for (const char* n : list)
        if (std::string_view(n) == name) return true;
      return false;
    };
    const Arg* first = nullptr;
    for (const Arg& a : args_) {
      DType dt = a.tensor->dtype();
      if (a.role == Role::Index) {
        expect(dt == DType::I32, a.name, " must be i32, got ", dtype_name(dt));
      } else if (a.role == Role::Table || named(f32, a.name)) {
        expect(dt == DType::F32, a.name, " must be f32 on CUDA, got ", dtype_name(dt));
      } else if (named(free, a.name)) {
        continue;
      } else if (!first) {
        first = &a;
        if (dt != DType::F32 && dt != DType::BF16) {
          if (dtype_is_float(dt)) {
            OPD_FAIL(Unsupported, op_, ": dtype ", dtype_name(dt),
                     " on CUDA is not implemented (f32 or bf16) ", describe());
          }
          expect(false, "expects f32 or bf16 tensors on CUDA, got ", dtype_name(dt));
        }
      } else {
        expect(dt == first->tensor->dtype(), "float tensors must share one dtype, but ", a.name,
               " is ", dtype_name(dt), " and ", first->name, " is ",
               dtype_name(first->tensor->dtype()));
      }
    }
    for (const Arg& a : args_) {
      if (a.role == Role::Out) expect(a.tensor->writable(), a.name, " is read-only");
    }
    return first ? first->tensor->dtype() : DType::F32;
  }

 private:
  const char* op_;
  std::vector<Arg> args_;
  Device device_ = Device::CPU;
};

std::vector<double> table_as_double(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    v[i] = t.dtype() == DType::F32 ? static_cast<double>(t.data<float>()[i])
                                   : t.data<double>()[i];
  }
  return v;
}

#ifdef OPD_WITH_CUDA
cudaStream_t stream() { return cuda::current_stream(); }

// Device-side index checks; the messages have the shape of the CPU checks' (op, value, row,
// limit) so callers and tests see one error whatever the device.
void cuda_check_token_ids(const char* op, const Tensor& ids, int64_t vocab) {
  cuda::IndexCheckResult r = cuda::check_indices(ids.data<int32_t>(), ids.numel(),
                                                 cuda::IndexRule::InRange, vocab, stream());
  if (r.first_bad_row >= 0) {
    OPD_FAIL(InvalidData, op, ": token id ", r.value, " at row ", r.first_bad_row,
             " is outside the vocabulary [0, ", vocab, ")");
  }
}

int64_t cuda_check_targets(const char* op, const Tensor& targets, int64_t vocab) {
  cuda::IndexCheckResult r = cuda::check_indices(
      targets.data<int32_t>(), targets.numel(), cuda::IndexRule::InRangeOrIgnore, vocab, stream());
  if (r.first_bad_row >= 0) {
    OPD_FAIL(InvalidData, op, ": target ", r.value, " at row ", r.first_bad_row,
             " is outside the vocabulary [0, ", vocab, ") and is not the ignore index ",
             cpu::kIgnoreIndex);
  }
  return r.counted;
}

void cuda_check_positions(const char* op, const Tensor& positions) {
  cuda::IndexCheckResult r = cuda::check_indices(positions.data<int32_t>(), positions.numel(),
                                                 cuda::IndexRule::NonNegative, 0, stream());
  if (r.first_bad_row >= 0) {
    OPD_FAIL(InvalidData, op, ": position ", r.value, " at row ", r.first_bad_row,
             " is negative (positions must be >= 0)");
  }
}
#else
[[noreturn]] void no_cuda_backend(const OpCheck& check) {
  OPD_FAIL(Unsupported, check.op(), " on CUDA: this build has no CUDA backend");
}
#endif

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  OpCheck check("embedding_forward",
                {{"ids", &ids, Role::Index}, {"table", &table, Role::In}, {"out", &out, Role::Out}});
  check.expect_ndim("ids", ids, 1);
  check.expect_ndim("table", table, 2);
  int64_t n = ids.dim(0), vocab = table.dim(0), hidden = table.dim(1);
  check.expect_shape("out", out, {n, hidden});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype();
    cuda_check_token_ids("embedding_forward", ids, vocab);
    cuda::embedding_forward(ids.data<int32_t>(), table.raw(), n, vocab, hidden, dt, out.raw(),
                            stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::embedding_forward(ids.data<int32_t>(), table.data<T>(), n, vocab, hidden, out.data<T>());
  });
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  OpCheck check("embedding_backward", {{"ids", &ids, Role::Index},
                                       {"dout", &dout, Role::In},
                                       {"dtable", &dtable, Role::Out}});
  check.expect_ndim("ids", ids, 1);
  check.expect_ndim("dtable", dtable, 2);
  int64_t n = ids.dim(0), vocab = dtable.dim(0), hidden = dtable.dim(1);
  check.expect_shape("dout", dout, {n, hidden});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"dtable"});
    cuda_check_token_ids("embedding_backward", ids, vocab);
    cuda::embedding_backward(ids.data<int32_t>(), dout.raw(), n, vocab, hidden, dt,
                             dtable.data<float>(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::embedding_backward(ids.data<int32_t>(), dout.data<T>(), n, vocab, hidden,
                            dtable.data<T>());
  });
}

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  OpCheck check("rmsnorm_forward", {{"x", &x, Role::In},
                                    {"w", &w, Role::In},
                                    {"y", &y, Role::Out},
                                    {"rstd", &rstd, Role::Out}});
  check.expect_ndim("x", x, 2);
  int64_t n = x.dim(0), h = x.dim(1);
  check.expect_shape("w", w, {h});
  check.expect_shape("y", y, {n, h});
  check.expect_shape("rstd", rstd, {n});
  check.expect(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"rstd"});
    cuda::rmsnorm_forward(x.raw(), w.raw(), eps, n, h, dt, y.raw(), rstd.data<float>(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::rmsnorm_forward(x.data<T>(), w.data<T>(), eps, n, h, y.data<T>(), rstd.data<T>());
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  OpCheck check("rmsnorm_backward", {{"dy", &dy, Role::In},
                                     {"x", &x, Role::In},
                                     {"w", &w, Role::In},
                                     {"rstd", &rstd, Role::In},
                                     {"dx", &dx, Role::Out},
                                     {"dw", &dw, Role::Out}});
  check.expect_ndim("x", x, 2);
  int64_t n = x.dim(0), h = x.dim(1);
  check.expect_shape("dy", dy, {n, h});
  check.expect_shape("w", w, {h});
  check.expect_shape("rstd", rstd, {n});
  check.expect_shape("dx", dx, {n, h});
  check.expect_shape("dw", dw, {h});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"rstd", "dw"});
    cuda::rmsnorm_backward(dy.raw(), x.raw(), w.raw(), rstd.data<float>(), n, h, dt, dx.raw(),
                           dw.data<float>(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::rmsnorm_backward(dy.data<T>(), x.data<T>(), w.data<T>(), rstd.data<T>(), n, h,
                          dx.data<T>(), dw.data<T>());
  });
}

void rmsnorm_residual_forward(const Tensor& x, const Tensor& r, const Tensor& w, double eps,
                              Tensor& sum, Tensor& y, Tensor& rstd) {
  OpCheck check("rmsnorm_residual_forward", {{"x", &x, Role::In},
                                             {"r", &r, Role::In},
                                             {"w", &w, Role::In},
                                             {"sum", &sum, Role::Out},
                                             {"y", &y, Role::Out},
                                             {"rstd", &rstd, Role::Out}});
  check.expect_ndim("x", x, 2);
  int64_t n = x.dim(0), h = x.dim(1);
  check.expect_shape("r", r, {n, h});
  check.expect_shape("w", w, {h});
  check.expect_shape("sum", sum, {n, h});
  check.expect_shape("y", y, {n, h});
  check.expect_shape("rstd", rstd, {n});
  check.expect(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"rstd"});
    cuda::rmsnorm_residual_forward(x.raw(), r.raw(), w.raw(), eps, n, h, dt, sum.raw(), y.raw(),
                                   rstd.data<float>(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::rmsnorm_residual_forward(x.data<T>(), r.data<T>(), w.data<T>(), eps, n, h, sum.data<T>(),
                                  y.data<T>(), rstd.data<T>());
  });
}

void rmsnorm_residual_backward(const Tensor& dy, const Tensor& sum, const Tensor& w,
                               const Tensor& rstd, const Tensor& dres, Tensor& ds, Tensor& dw) {
  OpCheck check("rmsnorm_residual_backward", {{"dy", &dy, Role::In},
                                              {"sum", &sum, Role::In},
                                              {"w", &w, Role::In},
                                              {"rstd", &rstd, Role::In},
                                              {"dres", &dres, Role::In},
                                              {"ds", &ds, Role::Out},
                                              {"dw", &dw, Role::Out}});
  check.expect_ndim("sum", sum, 2);
  int64_t n = sum.dim(0), h = sum.dim(1);
  check.expect_shape("dy", dy, {n, h});
  check.expect_shape("w", w, {h});
  check.expect_shape("rstd", rstd, {n});
  check.expect_shape("dres", dres, {n, h});
  check.expect_shape("ds", ds, {n, h});
  check.expect_shape("dw", dw, {h});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"rstd", "dw"});
    cuda::rmsnorm_residual_backward(dy.raw(), sum.raw(), w.raw(), rstd.data<float>(), dres.raw(),
                                    n, h, dt, ds.raw(), dw.data<float>(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::rmsnorm_residual_backward(dy.data<T>(), sum.data<T>(), w.data<T>(), rstd.data<T>(),
                                   dres.data<T>(), n, h, ds.data<T>(), dw.data<T>());
  });
}

namespace {

void rope_dispatch(const char* op, Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                   bool forward) {
  OpCheck check(op, {{"x", &x, Role::Out},
                     {"positions", &positions, Role::Index},
                     {"inv_freq", &inv_freq, Role::Table}});
  check.expect_ndim("x", x, 3);
  int64_t n = x.dim(0), heads = x.dim(1), head_dim = x.dim(2);
  check.expect(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  check.expect_shape("positions", positions, {n});
  check.expect_shape("inv_freq", inv_freq, {head_dim / 2});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    // inv_freq on the host (the model keeps it there): f32 values uploaded for this call.
    Tensor freq = inv_freq;
    if (inv_freq.device() == Device::CPU) {
      std::vector<double> f64 = table_as_double(inv_freq);
      std::vector<float> f32(f64.begin(), f64.end());
      freq = Tensor::from_vector(f32, inv_freq.shape()).to(Device::CUDA);
    }
    DType dt = check.cuda_float_dtype();
    check.expect(freq.dtype() == DType::F32, "inv_freq must be f32 on CUDA");
    cuda_check_positions(op, positions);
    cuda::rope(x.raw(), positions.data<int32_t>(), freq.data<float>(), n, heads, head_dim, dt,
               !forward, stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    std::vector<double> freq = table_as_double(inv_freq);
    const int32_t* pos = positions.data<int32_t>();
    if (forward) cpu::rope_forward(x.data<T>(), pos, freq.data(), n, heads, head_dim);
    else cpu::rope_backward(x.data<T>(), pos, freq.data(), n, heads, head_dim);
  });
}

// Shapes shared by attention forward and backward; returns {batch, n, hq, hkv, d}.
struct AttnDims {
  int64_t batch, n, hq, hkv, d;
};

AttnDims attention_dims(const OpCheck& check, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cu_seqlens, double scale) {
  check.expect_ndim("q", q, 3);
  check.expect_ndim("k", k, 3);
  check.expect_ndim("cu_seqlens", cu_seqlens, 1);
  AttnDims a{cu_seqlens.dim(0) - 1, q.dim(0), q.dim(1), k.dim(1), q.dim(2)};
  check.expect(a.batch >= 0, "cu_seqlens must have B + 1 >= 1 entries");
  check.expect_shape("k", k, {a.n, a.hkv, a.d});
  check.expect_shape("v", v, {a.n, a.hkv, a.d});
  check.expect(a.hkv >= 1 && a.hq % a.hkv == 0,
               "query heads ", a.hq, " must be a multiple of kv heads ", a.hkv);
  check.expect(std::isfinite(scale), "scale must be finite, got ", scale);
  return a;
}

}  // namespace

void rope_forward(Tensor& x, const Tensor& positions, const Tensor& inv_freq) {
  rope_dispatch("rope_forward", x, positions, inv_freq, true);
}

void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq) {
  rope_dispatch("rope_backward", dx, positions, inv_freq, false);
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                       double scale, Tensor& out, Tensor& lse) {
  OpCheck check("attention_forward", {{"q", &q, Role::In},
                                      {"k", &k, Role::In},
                                      {"v", &v, Role::In},
                                      {"cu_seqlens", &cu_seqlens, Role::Index},
                                      {"out", &out, Role::Out},
                                      {"lse", &lse, Role::Out}});
#ifdef OPD_WITH_CUDA
  if (check.device() == Device::CUDA)
    return opd::cuda::attention_forward_cuda(q, k, v, cu_seqlens, scale, out, lse);
#endif
  check.require_cpu();
  AttnDims a = attention_dims(check, q, k, v, cu_seqlens, scale);
  check.expect_shape("out", out, {a.n, a.hq, a.d});
  check.expect_shape("lse", lse, {a.n, a.hq});
  check.on_cpu([&](auto t) {  // the dtype checks validate cu_seqlens' dtype before it is read
    using T = decltype(t);
    const int32_t* cu = cu_seqlens.data<int32_t>();
    cpu::attention_forward(q.data<T>(), k.data<T>(), v.data<T>(), cu, a.batch, a.n, a.hq, a.hkv,
                           a.d, scale, out.data<T>(), lse.data<T>());
  });
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                        double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  OpCheck check("attention_backward", {{"dout", &dout, Role::In},
                                       {"q", &q, Role::In},
                                       {"k", &k, Role::In},
                                       {"v", &v, Role::In},
                                       {"out", &out, Role::In},
                                       {"lse", &lse, Role::In},
                                       {"cu_seqlens", &cu_seqlens, Role::Index},
                                       {"dq", &dq, Role::Out},
                                       {"dk", &dk, Role::Out},
                                       {"dv", &dv, Role::Out}});
#ifdef OPD_WITH_CUDA
  if (check.device() == Device::CUDA)
    return opd::cuda::attention_backward_cuda(dout, q, k, v, out, lse, cu_seqlens, scale, dq,
                                              dk, dv);
#endif
  check.require_cpu();
  AttnDims a = attention_dims(check, q, k, v, cu_seqlens, scale);
  check.expect_shape("dout", dout, {a.n, a.hq, a.d});
  check.expect_shape("out", out, {a.n, a.hq, a.d});
  check.expect_shape("lse", lse, {a.n, a.hq});
  check.expect_shape("dq", dq, {a.n, a.hq, a.d});
  check.expect_shape("dk", dk, {a.n, a.hkv, a.d});
  check.expect_shape("dv", dv, {a.n, a.hkv, a.d});
  check.on_cpu([&](auto t) {  // the dtype checks validate cu_seqlens' dtype before it is read
    using T = decltype(t);
    const int32_t* cu = cu_seqlens.data<int32_t>();
    cpu::attention_backward(dout.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(), out.data<T>(),
                            lse.data<T>(), cu, a.batch, a.n, a.hq, a.hkv, a.d, scale, dq.data<T>(),
                            dk.data<T>(), dv.data<T>());
  });
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  OpCheck check("swiglu_forward",
                {{"gate", &gate, Role::In}, {"up", &up, Role::In}, {"out", &out, Role::Out}});
  check.expect_shape("up", up, gate.shape());
  check.expect_shape("out", out, gate.shape());
  int64_t n = gate.numel();
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype();
    cuda::swiglu_forward(gate.raw(), up.raw(), n, dt, out.raw(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::swiglu_forward(gate.data<T>(), up.data<T>(), n, out.data<T>());
  });
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  OpCheck check("swiglu_backward", {{"dout", &dout, Role::In},
                                    {"gate", &gate, Role::In},
                                    {"up", &up, Role::In},
                                    {"dgate", &dgate, Role::Out},
                                    {"dup", &dup, Role::Out}});
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"dout", &dout},
                         {"up", &up}, {"dgate", &dgate}, {"dup", &dup}}) {
    check.expect_shape(name, *t, gate.shape());
  }
  int64_t n = gate.numel();
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype();
    cuda::swiglu_backward(dout.raw(), gate.raw(), up.raw(), n, dt, dgate.raw(), dup.raw(),
                          stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::swiglu_backward(dout.data<T>(), gate.data<T>(), up.data<T>(), n, dgate.data<T>(),
                         dup.data<T>());
  });
}

void linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  std::vector<Arg> args = {{"x", &x, Role::In}, {"w", &w, Role::In}, {"y", &y, Role::Out}};
  if (bias.defined()) args.push_back({"bias", &bias, Role::In});
  OpCheck check("linear_forward", std::move(args));
  check.expect_ndim("x", x, 2);
  check.expect_ndim("w", w, 2);
  int64_t n = x.dim(0), in = x.dim(1), out = w.dim(0);
  check.expect_shape("w", w, {out, in});
  check.expect_shape("y", y, {n, out});
  if (bias.defined()) check.expect_shape("bias", bias, {out});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({}, {"y", "bias"});
    DType ydt = y.dtype();
    check.expect(ydt == dt || ydt == DType::F32, "y must be ", dtype_name(dt), " or f32, got ",
                 dtype_name(ydt));
    if (bias.defined()) check.expect(bias.dtype() == ydt, "bias must have the dtype of y");
    if (n == 0 || out == 0) return;
    const void* b = bias.defined() ? bias.raw() : nullptr;
    if (in == 0) {  // an empty reduction: y = bias (or 0); cuBLASLt refuses k = 0
      y.fill_zero();
      if (b) cuda::add_bias_rows(y.raw(), b, n, out, ydt, stream());
      return;
    }
    cuda::linear_forward(x.raw(), w.raw(), b, n, in, out, dt, ydt, y.raw(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::linear_forward(x.data<T>(), w.data<T>(), bias.defined() ? bias.data<T>() : nullptr, n, in,
                        out, y.data<T>());
  });
}

void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dx, Tensor& dw,
                     Tensor& dbias) {
  std::vector<Arg> args = {
      {"dy", &dy, Role::In}, {"x", &x, Role::In}, {"w", &w, Role::In}, {"dw", &dw, Role::Out}};
  if (dx.defined()) args.push_back({"dx", &dx, Role::Out});
  if (dbias.defined()) args.push_back({"dbias", &dbias, Role::Out});
  OpCheck check("linear_backward", std::move(args));
  check.expect_ndim("x", x, 2);
  check.expect_ndim("w", w, 2);
  int64_t n = x.dim(0), in = x.dim(1), out = w.dim(0);
  check.expect_shape("w", w, {out, in});
  check.expect_shape("dy", dy, {n, out});
  check.expect_shape("dw", dw, {out, in});
  if (dx.defined()) check.expect_shape("dx", dx, {n, in});
  if (dbias.defined()) check.expect_shape("dbias", dbias, {out});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"dbias"}, {"dw"});
    check.expect(dw.dtype() == dt || dw.dtype() == DType::F32, "dw must be ", dtype_name(dt),
                 " or f32, got ", dtype_name(dw.dtype()));
    if (dx.defined() && n > 0 && in > 0) {
      if (out == 0) dx.fill_zero();
      else cuda::linear_backward_input(dy.raw(), w.raw(), n, in, out, dt, dt, dx.raw(), stream());
    }
    if (n > 0 && in > 0 && out > 0) {
      cuda::linear_backward_weight(dy.raw(), x.raw(), n, in, out, dt, dw.dtype(), dw.raw(),
                                   stream());
    }
    if (dbias.defined() && out > 0) {
      cuda::column_sum_accumulate(dy.raw(), n, out, dt, dbias.data<float>(), stream());
    }
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::linear_backward(dy.data<T>(), x.data<T>(), w.data<T>(), n, in, out,
                         dx.defined() ? dx.data<T>() : nullptr, dw.data<T>(),
                         dbias.defined() ? dbias.data<T>() : nullptr);
  });
}

int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                              Tensor& lse) {
  OpCheck check("cross_entropy_forward", {{"logits", &logits, Role::In},
                                          {"targets", &targets, Role::Index},
                                          {"losses", &losses, Role::Out},
                                          {"lse", &lse, Role::Out}});
  check.expect_ndim("logits", logits, 2);
  int64_t n = logits.dim(0), vocab = logits.dim(1);
  check.expect(vocab >= 1, "the vocabulary must not be empty");
  check.expect_shape("targets", targets, {n});
  check.expect_shape("losses", losses, {n});
  check.expect_shape("lse", lse, {n});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"losses", "lse"});
    int64_t counted = cuda_check_targets("cross_entropy_forward", targets, vocab);
    cuda::cross_entropy_forward(logits.raw(), targets.data<int32_t>(), n, vocab, dt,
                                losses.data<float>(), lse.data<float>(), stream());
    return counted;
#else
    no_cuda_backend(check);
#endif
  }
  return check.on_cpu([&](auto t) {
    using T = decltype(t);
    return cpu::cross_entropy_forward(logits.data<T>(), targets.data<int32_t>(), n, vocab,
                                      losses.data<T>(), lse.data<T>());
  });
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            double scale, Tensor& dlogits) {
  OpCheck check("cross_entropy_backward", {{"logits", &logits, Role::In},
                                           {"targets", &targets, Role::Index},
                                           {"lse", &lse, Role::In},
                                           {"dlogits", &dlogits, Role::Out}});
  check.expect_ndim("logits", logits, 2);
  int64_t n = logits.dim(0), vocab = logits.dim(1);
  check.expect(vocab >= 1, "the vocabulary must not be empty");
  check.expect_shape("targets", targets, {n});
  check.expect_shape("lse", lse, {n});
  check.expect_shape("dlogits", dlogits, {n, vocab});
  check.expect(std::isfinite(scale), "scale must be finite, got ", scale);
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype({"lse"});
    cuda_check_targets("cross_entropy_backward", targets, vocab);
    cuda::cross_entropy_backward(logits.raw(), targets.data<int32_t>(), lse.data<float>(), n,
                                 vocab, scale, dt, dlogits.raw(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::cross_entropy_backward(logits.data<T>(), targets.data<int32_t>(), lse.data<T>(), n, vocab,
                                scale, dlogits.data<T>());
  });
}

void gather_rows(const Tensor& in, const Tensor& rows, Tensor& out) {
  OpCheck check("gather_rows",
                {{"in", &in, Role::In}, {"rows", &rows, Role::Index}, {"out", &out, Role::Out}});
  check.expect_ndim("in", in, 2);
  check.expect_ndim("rows", rows, 1);
  const int64_t n_in = in.dim(0), h = in.dim(1), n_out = rows.dim(0);
  check.expect_shape("out", out, {n_out, h});
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    check.cuda_float_dtype({}, {"in", "out"});  // index dtype, writability
    cuda::IndexCheckResult r = cuda::check_indices(rows.data<int32_t>(), n_out,
                                                   cuda::IndexRule::InRangeOrNone, n_in, stream());
    if (r.first_bad_row >= 0) {
      OPD_FAIL(InvalidData, "gather_rows: source row ", r.value, " at row ", r.first_bad_row,
               " is outside [-1, ", n_in, ")");
    }
    cuda::gather_rows(in.raw(), in.dtype(), n_in, rows.data<int32_t>(), n_out, h, out.raw(),
                      out.dtype(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::gather_rows(in.data<T>(), n_in, rows.data<int32_t>(), n_out, h, out.data<T>());
  });
}

void convert(const Tensor& in, Tensor& out) {
  OpCheck check("convert", {{"in", &in, Role::In}, {"out", &out, Role::Out}});
  check.expect_shape("out", out, in.shape());
  const int64_t n = in.numel();
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    check.cuda_float_dtype({}, {"in", "out"});
    cuda::convert(in.raw(), in.dtype(), n, out.raw(), out.dtype(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  const DType a = in.dtype(), b = out.dtype();
  check.expect((a == DType::F32 || a == DType::F64) && (b == DType::F32 || b == DType::F64),
               "expects f32 or f64 tensors on the CPU");
  check.expect(out.writable(), "out is read-only");
  for (int64_t i = 0; i < n; ++i) {
    const double v = a == DType::F32 ? in.data<float>()[i] : in.data<double>()[i];
    if (b == DType::F32) out.data<float>()[i] = static_cast<float>(v);
    else out.data<double>()[i] = v;
  }
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  OpCheck check("add", {{"a", &a, Role::In}, {"b", &b, Role::In}, {"out", &out, Role::Out}});
  check.expect_shape("b", b, a.shape());
  check.expect_shape("out", out, a.shape());
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype();
    cuda::add(a.raw(), b.raw(), a.numel(), dt, out.raw(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::add(a.data<T>(), b.data<T>(), a.numel(), out.data<T>());
  });
}

void add_inplace(Tensor& acc, const Tensor& x) {
  OpCheck check("add_inplace", {{"acc", &acc, Role::Out}, {"x", &x, Role::In}});
  check.expect_shape("x", x, acc.shape());
  if (check.device() == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    DType dt = check.cuda_float_dtype();
    cuda::add(acc.raw(), x.raw(), acc.numel(), dt, acc.raw(), stream());
    return;
#else
    no_cuda_backend(check);
#endif
  }
  check.on_cpu([&](auto t) {
    using T = decltype(t);
    cpu::add_inplace(acc.data<T>(), x.data<T>(), acc.numel());
  });
}

}  // namespace opd::ops
