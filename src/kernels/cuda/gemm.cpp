// cuBLASLt GEMMs for the dense layers (contract and layout mapping in gemm.h): a plan cache
// keyed by (device, transposes, m, n, k, leading dims, dtypes, epilogue, beta == 0, pointer
// alignments, tuned) holding the descriptors and the heuristic's algorithm (or, for tuned
// decode plans, the fastest of its candidates by measurement), a 32 MiB workspace per stream
// from the caching allocator, and the plain cuBLAS baseline for the benchmark.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <vector>
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
  bool tune = false;
  int sm_count = 0;  // the stream's SM count target (gemm_set_stream_sm_count); 0 = the device's
  auto tie() const {
    return std::tie(device, ta, tb, m, n, k, lda, ldb, ldd, ab, d, bias, beta_zero, align_a,
                    align_b, align_d, tune, sm_count);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;     // the heuristic found an algorithm
  bool tuned = false;  // key.tune: the algorithm was chosen by timing (not yet: heuristic's)
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
  std::map<cudaStream_t, int> stream_sms;      // gemm_set_stream_sm_count
  GemmCacheStats stats;
  std::vector<GemmTuneRecord> tune_records;
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

using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                   cublasStatus_t (*)(cublasLtMatmulPreference_t)>;

// The search limits of a plan: the workspace we own, the operands' alignments.
Preference make_preference(const PlanKey& key) {
  cublasLtMatmulPreference_t pref = nullptr;
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  // Release the preference on every path (the checks below may throw).
  Preference guard(pref, cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = kWorkspaceBytes;
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof(uint32_t)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof(uint32_t)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d, sizeof(uint32_t)));
  OPD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d, sizeof(uint32_t)));
  return guard;
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
  if (key.sm_count > 0) {
    const int32_t sms = key.sm_count;
    OPD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  // Stored (pre-op) shapes: A is [m, k] or, transposed, [k, m]; B is [k, n] or [n, k].
  const uint64_t a_rows = key.ta ? key.k : key.m, a_cols = key.ta ? key.m : key.k;
  const uint64_t b_rows = key.tb ? key.n : key.k, b_cols = key.tb ? key.k : key.n;
  OPD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, ab, a_rows, a_cols, key.lda));
  OPD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, ab, b_rows, b_cols, key.ldb));
  OPD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, d, key.m, key.n, key.ldd));

  Preference pref = make_preference(key);
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->la, p->lb, p->ld, p->ld,
                                                           pref.get(), 1, &result, &returned);
  ++context().stats.heuristic_queries;
  if (st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    p->algo = result.algo;
    p->ok = true;
  } else if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_SUCCESS) {
    OPD_CUBLAS_CHECK(st);
  }
  return p;
}

// Times the plan's candidate algorithms on the call's own operands (D is written: beta == 0)
// and keeps the fastest. Candidates: the heuristic's up to 8 results, and split-K 2/4/8/16
// variants of its first 4 where they support split-K and do not split yet (the heuristic sizes
// its choice for large GEMMs; a decode GEMM of 64 rows has few output tiles, and splitting K is
// how it gets enough CTAs to stream the weight at full bandwidth). Each candidate runs 3 times,
// each run after a 96 MiB memset that evicts the 60 MB L2 (the decode step reads its weights
// from HBM, never from L2); the median counts. <= 24 candidates x 3 runs x ~40 us: ~3 ms per
// shape. Called with the context mutex held, outside capture.
void tune_plan(cublasLtHandle_t lt, Context& c, Plan& plan, const PlanKey& key, const GemmArgs& g,
               void* ws, cudaStream_t stream) {
  const auto t0 = std::chrono::steady_clock::now();
  plan.tuned = true;  // attempted: whatever happens below, this plan is not timed again
  Preference pref = make_preference(key);
  std::vector<cublasLtMatmulHeuristicResult_t> found(8);
  int returned = 0;
  OPD_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, plan.desc, plan.la, plan.lb, plan.ld, plan.ld,
                                                  pref.get(), static_cast<int>(found.size()),
                                                  found.data(), &returned));
  ++c.stats.heuristic_queries;
  std::vector<cublasLtMatmulAlgo_t> cands;
  std::vector<int> splits;
  for (int i = 0; i < returned; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS || found[i].workspaceSize > kWorkspaceBytes) continue;
    cands.push_back(found[i].algo);
    splits.push_back(1);
  }
  const size_t base = cands.size();
  for (size_t i = 0; i < base && i < 4; ++i) {
    int32_t support = 0, current = 1;
    uint32_t schemes = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&cands[i], CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support,
                                          sizeof(support), &written) != CUBLAS_STATUS_SUCCESS ||
        !support)
      continue;
    if (cublasLtMatmulAlgoConfigGetAttribute(&cands[i], CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &current,
                                             sizeof(current), &written) != CUBLAS_STATUS_SUCCESS ||
        current > 1)
      continue;
    (void)cublasLtMatmulAlgoCapGetAttribute(&cands[i], CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK,
                                            &schemes, sizeof(schemes), &written);
    uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
    for (uint32_t sch : {static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE),
                         static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE),
                         static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)})
      if (scheme == CUBLASLT_REDUCTION_SCHEME_NONE && (schemes & sch)) scheme = sch;
    if (scheme == CUBLASLT_REDUCTION_SCHEME_NONE) continue;
    for (int32_t k_splits : {2, 4, 8, 16}) {
      if (key.k / k_splits < 128) break;
      cublasLtMatmulAlgo_t a = cands[i];
      if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k_splits,
                                               sizeof(k_splits)) != CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                               sizeof(scheme)) != CUBLAS_STATUS_SUCCESS)
        continue;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(lt, plan.desc, plan.la, plan.lb, plan.ld, plan.ld, &a, &check) !=
              CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > kWorkspaceBytes)
        continue;
      cands.push_back(a);
      splits.push_back(k_splits);
    }
  }
  if (cands.empty()) return;  // keep the heuristic's choice

  constexpr int kRuns = 3;
  constexpr size_t kFlushBytes = size_t{96} << 20;
  DeviceBuffer flush(kFlushBytes, stream);
  std::vector<cudaEvent_t> events(cands.size() * kRuns * 2, nullptr);
  struct EventGuard {
    std::vector<cudaEvent_t>& e;
    ~EventGuard() {
      for (cudaEvent_t x : e)
        if (x) (void)cudaEventDestroy(x);
    }
  } guard{events};
  for (cudaEvent_t& e : events) OPD_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<bool> ran(cands.size(), true);
  for (size_t i = 0; i < cands.size(); ++i) {
    for (int r = 0; r < kRuns && ran[i]; ++r) {
      OPD_CUDA_CHECK(cudaMemsetAsync(flush.get(), r, kFlushBytes, stream));
      OPD_CUDA_CHECK(cudaEventRecord(events[(i * kRuns + r) * 2], stream));
      const cublasStatus_t st = cublasLtMatmul(lt, plan.desc, &g.alpha, g.a, plan.la, g.b, plan.lb,
                                               &g.beta, g.d, plan.ld, g.d, plan.ld, &cands[i], ws,
                                               kWorkspaceBytes, stream);
      OPD_CUDA_CHECK(cudaEventRecord(events[(i * kRuns + r) * 2 + 1], stream));
      if (st != CUBLAS_STATUS_SUCCESS) ran[i] = false;  // this candidate cannot run: skip it
    }
  }
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  double best = 0, first = 0;
  int best_i = -1;
  for (size_t i = 0; i < cands.size(); ++i) {
    if (!ran[i]) continue;
    std::vector<float> ms(kRuns);
    for (int r = 0; r < kRuns; ++r)
      OPD_CUDA_CHECK(cudaEventElapsedTime(&ms[r], events[(i * kRuns + r) * 2],
                                          events[(i * kRuns + r) * 2 + 1]));
    std::sort(ms.begin(), ms.end());
    const double med = ms[kRuns / 2];
    if (i == 0) first = med;
    if (best_i < 0 || med < best) {
      best = med;
      best_i = static_cast<int>(i);
    }
  }
  if (best_i < 0) return;
  // Keep the heuristic's choice unless another is clearly faster (5%): the choice is then stable
  // from one process to the next instead of following timing noise (a different algorithm
  // rounds differently, and a resumed run should sample what the first process sampled).
  if (ran[0] && best > 0.95 * first) best_i = 0, best = first;
  plan.algo = cands[static_cast<size_t>(best_i)];
  plan.ok = true;
  c.stats.tuned_plans += 1;
  c.stats.tuning_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  c.tune_records.push_back({key.m, key.n, key.k, static_cast<int>(cands.size()), first * 1e3,
                            best * 1e3, best_i, splits[static_cast<size_t>(best_i)]});
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  OPD_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  return st != cudaStreamCaptureStatusNone;
}

}  // namespace

void gemm_set_stream_sm_count(cudaStream_t stream, int sms) {
  OPD_CHECK(sms >= 0, InvalidArgument, "gemm_set_stream_sm_count: ", sms, " SMs");
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (sms == 0) c.stream_sms.erase(stream);
  else c.stream_sms[stream] = sms;
}

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
  key.tune = g.tune && g.beta == 0.0f;
  if (!c.stream_sms.empty()) {
    auto sms = c.stream_sms.find(stream);
    if (sms != c.stream_sms.end()) key.sm_count = sms->second;
  }
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
  if (key.tune && !plan->tuned && !capturing(stream)) tune_plan(lt, c, *plan, key, g, ws, stream);
  OPD_CUBLAS_CHECK(cublasLtMatmul(lt, plan->desc, &g.alpha, g.a, plan->la, g.b, plan->lb, &g.beta,
                                  g.d, plan->ld, g.d, plan->ld, &plan->algo, ws, kWorkspaceBytes,
                                  stream));
}

void linear_forward(const void* x, const void* w, const void* bias, int64_t n, int64_t in,
                    int64_t out, DType in_dtype, DType out_dtype, void* y, cudaStream_t stream,
                    bool tune) {
  // y^T [out, n] = W [out, in] (stored [in, out] column-major: transposed) x^T [in, n].
  GemmArgs g;
  g.trans_a = true;
  g.m = out, g.n = n, g.k = in;
  g.a = w, g.lda = in;
  g.b = x, g.ldb = in;
  g.d = y, g.ldd = out;
  g.ab_dtype = in_dtype, g.d_dtype = out_dtype;
  g.bias = bias;
  g.tune = tune;
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

std::vector<GemmTuneRecord> gemm_tune_records() {
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.tune_records;
}

}  // namespace opd::cuda
