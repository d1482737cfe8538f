// cuBLASLt GEMMs for the dense layers (contract and layout mapping in gemm.h): a plan cache
// keyed by (device, transposes, m, n, k, leading dims, dtypes, epilogue, beta == 0, pointer
// alignments) holding the descriptors and the heuristic's algorithm, a 32 MiB workspace per
// stream from the caching allocator, and the plain cuBLAS baseline for the benchmark.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"

namespace opd::cuda {
namespace {

// cuBLAS recommends 32 MiB of workspace on Hopper for its best kernels.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: OPD_FAIL(Unsupported, "GEMM on dtype ", dtype_name(d));
  }
}

// Largest power of two (<= 256) dividing the address: cuBLASLt kernels need their minimum.
uint32_t alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a >>= 1;
  return a;
}

struct PlanKey {
  int device;
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldd;
  DType ab, d;
  bool bias, beta_zero;
  uint32_t align_a, align_b, align_d;
  auto tie() const {
    return std::tie(device, ta, tb, m, n, k, lda, ldb, ldd, ab, d, bias, beta_zero, align_a,
                    align_b, align_d);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // the heuristic found an algorithm
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (la) (void)cublasLtMatrixLayoutDestroy(la);
    if (lb) (void)cublasLtMatrixLayoutDestroy(lb);
    if (ld) (void)cublasLtMatrixLayoutDestroy(ld);
    if (desc) (void)cublasLtMatmulDescDestroy(desc);
  }
};

struct Context {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> lt;          // per device
  std::map<std::pair<int, cudaStream_t>, DeviceBuffer> workspace;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<int, cublasHandle_t> blas;          // for the reference path
  GemmCacheStats stats;
};

// Never destroyed: handles and blocks may be in use until the process exits, and destroying
// them after the CUDA runtime has shut down would fail.
Context& context() {
  static Context* c = new Context();
  return *c;
}

int current_device() {
  int d = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

cublasLtHandle_t lt_handle(Context& c, int device) {
  auto it = c.lt.find(device);
  if (it != c.lt.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  OPD_CUBLAS_CHECK(cublasLtCreate(&h));
  c.lt[device] = h;
  return h;
}

void* workspace(Context& c, int device, cudaStream_t stream) {
  auto key = std::make_pair(device, stream);
  auto it = c.workspace.find(key);
  if (it == c.workspace.end()) {
    it = c.workspace.emplace(key, DeviceBuffer(kWorkspaceBytes, stream)).first;
  }
  return it->second.get();
}

std::unique_ptr<Plan> make_plan(cublasLtHandle_t lt, const PlanKey& key) {
  auto p = std::make_unique<Plan>();
  const cudaDataType_t ab = cuda_type(key.ab), d = cuda_type(key.d);
  OPD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  OPD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  OPD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (key.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    OPD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    OPD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &d, sizeof(d)));
  }
  // Stored (pre-op) shapes: A is [m, k] or, transposed, [k, m]; B is [k, n] or [n, k].
  const uint64_t a_rows = key.ta ? key.k : key.m, a_cols = key.ta ? key.m : key.k;
  const uint64_t b_rows = key.tb ? key.n : key.k, b_cols = key.tb ? key.k : key.n;
  OPD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, ab, a_rows, a_cols, key.lda));
  OPD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, ab, b_rows, b_cols, key.ldb));
  OPD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, d, key.m, key.n, key.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  // Release the preference on every path (the checks below may throw).
  std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                  cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      pref_guard(pref, cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = kWorkspaceBytes;
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof(uint32_t)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof(uint32_t)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d, sizeof(uint32_t)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d, sizeof(uint32_t)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->la, p->lb, p->ld, p->ld,
                                                           pref, 1, &result, &returned);
  ++context().stats.heuristic_queries;
  if (st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    p->algo = result.algo;
    p->ok = true;
  } else if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_SUCCESS) {
    OPD_CUBLAS_CHECK(st);
  }
  return p;
}

}  // namespace

void gemm(const GemmArgs& g, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return;
  OPD_CHECK(g.k > 0, InvalidArgument, "gemm: k = 0 (callers handle empty reductions)");
  Context& c = context();
  std::unique_lock<std::mutex> lock(c.mutex);  // plans are shared; the bias pointer is per call
  const int device = current_device();
  PlanKey key{device, g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.ab_dtype,
              g.d_dtype, g.bias != nullptr, g.beta == 0.0f, alignment(g.a), alignment(g.b),
              alignment(g.d)};
  const bool bias_epilogue = g.bias && alignment(g.bias) >= 16;  // the epilogue reads vectors
  key.bias = bias_epilogue;
  const cublasLtHandle_t lt = lt_handle(c, device);
  auto it = c.plans.find(key);
  if (it == c.plans.end()) it = c.plans.emplace(key, make_plan(lt, key)).first;
  Plan* plan = it->second.get();
  if (g.bias && (!bias_epilogue || !plan->ok)) {
    // No bias epilogue for this shape or pointer: the plain GEMM, then one bias pass.
    OPD_CHECK(g.ldd == g.m, Unsupported, "gemm: bias without the epilogue needs ldd == m");
    lock.unlock();
    GemmArgs plain = g;
    plain.bias = nullptr;
    gemm(plain, stream);
    add_bias_rows(g.d, g.bias, g.n, g.m, g.d_dtype, stream);  // D column j = output row j
    return;
  }
  OPD_CHECK(plan->ok, Unsupported, "cuBLASLt has no algorithm for the GEMM m=", g.m, " n=", g.n,
            " k=", g.k, " (", dtype_name(g.ab_dtype), " -> ", dtype_name(g.d_dtype), ")");
  ++c.stats.calls;
  if (key.bias) {
    OPD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &g.bias, sizeof(g.bias)));
  }
  void* ws = workspace(c, device, stream);
  OPD_CUBLAS_CHECK(cublasLtMatmul(lt, plan->desc, &g.alpha, g.a, plan->la, g.b, plan->lb, &g.beta,
                                  g.d, plan->ld, g.d, plan->ld, &plan->algo, ws, kWorkspaceBytes,
                                  stream));
}

void linear_forward(const void* x, const void* w, const void* bias, int64_t n, int64_t in,
                    int64_t out, DType in_dtype, DType out_dtype, void* y, cudaStream_t stream) {
  // y^T [out, n] = W [out, in] (stored [in, out] column-major: transposed) x^T [in, n].
  GemmArgs g;
  g.trans_a = true;
  g.m = out, g.n = n, g.k = in;
  g.a = w, g.lda = in;
  g.b = x, g.ldb = in;
  g.d = y, g.ldd = out;
  g.ab_dtype = in_dtype, g.d_dtype = out_dtype;
  g.bias = bias;
  gemm(g, stream);
}

void linear_backward_input(const void* dy, const void* w, int64_t n, int64_t in, int64_t out,
                           DType in_dtype, DType out_dtype, void* dx, cudaStream_t stream) {
  // dx^T [in, n] = W^T [in, out] (stored [in, out] column-major: as is) dy^T [out, n].
  GemmArgs g;
  g.m = in, g.n = n, g.k = out;
  g.a = w, g.lda = in;
  g.b = dy, g.ldb = out;
  g.d = dx, g.ldd = in;
  g.ab_dtype = in_dtype, g.d_dtype = out_dtype;
  gemm(g, stream);
}

void linear_backward_weight(const void* dy, const void* x, int64_t n, int64_t in, int64_t out,
                            DType in_dtype, DType dw_dtype, void* dw, cudaStream_t stream) {
  // dW^T [in, out] += x^T [in, n] (stored [in, n]: as is) dy [n, out] (stored [out, n]: transposed).
  GemmArgs g;
  g.trans_b = true;
  g.m = in, g.n = out, g.k = n;
  g.a = x, g.lda = in;
  g.b = dy, g.ldb = out;
  g.d = dw, g.ldd = in;
  g.ab_dtype = in_dtype, g.d_dtype = dw_dtype;
  g.beta = 1.0f;
  gemm(g, stream);
}

void gemm_cublas_reference(const GemmArgs& g, cudaStream_t stream) {
  OPD_CHECK(g.bias == nullptr, InvalidArgument, "gemm_cublas_reference: no bias epilogue");
  if (g.m == 0 || g.n == 0) return;
  Context& c = context();
  cublasHandle_t h = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    const int device = current_device();
    auto it = c.blas.find(device);
    if (it == c.blas.end()) {
      OPD_CUBLAS_CHECK(cublasCreate(&h));
      c.blas[device] = h;
    } else {
      h = it->second;
    }
  }
  OPD_CUBLAS_CHECK(cublasSetStream(h, stream));
  OPD_CUBLAS_CHECK(cublasGemmEx(h, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(g.m),
                                static_cast<int>(g.n), static_cast<int>(g.k), &g.alpha, g.a,
                                cuda_type(g.ab_dtype), static_cast<int>(g.lda), g.b,
                                cuda_type(g.ab_dtype), static_cast<int>(g.ldb), &g.beta, g.d,
                                cuda_type(g.d_dtype), static_cast<int>(g.ldd), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}

GemmCacheStats gemm_cache_stats() {
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mutex);
  GemmCacheStats s = c.stats;
  s.plans = static_cast<int64_t>(c.plans.size());
  return s;
}

}  // namespace opd::cuda
