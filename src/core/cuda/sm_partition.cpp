// SmPartition over CUDA green contexts (see sm_partition.h). The driver entry points come from
// cudaGetDriverEntryPointByVersion (no link to libcuda); every call is checked and a failure
// names the entry point and the driver's error.
#include "core/cuda/sm_partition.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include "core/cuda/allocator.h"  // release_stream
#include "core/cuda/cuda_check.h"
#include "core/error.h"

namespace opd::cuda {
namespace {

struct GreenApi {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetDevResource_v12040 get_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 split = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 generate_desc = nullptr;
  PFN_cuGreenCtxCreate_v12040 create = nullptr;
  PFN_cuGreenCtxDestroy_v12040 destroy = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream_create = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  bool ok = false;
};

template <typename Fn>
bool load(const char* name, int version, Fn& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    return false;
  }
  fn = reinterpret_cast<Fn>(p);
  return true;
}

const GreenApi& api() {
  static const GreenApi a = [] {
    GreenApi g;
    g.ok = load("cuDeviceGet", 2000, g.device_get) &&
           load("cuDeviceGetDevResource", 12040, g.get_resource) &&
           load("cuDevSmResourceSplitByCount", 12040, g.split) &&
           load("cuDevResourceGenerateDesc", 12040, g.generate_desc) &&
           load("cuGreenCtxCreate", 12040, g.create) && load("cuGreenCtxDestroy", 12040, g.destroy) &&
           load("cuGreenCtxStreamCreate", 12050, g.stream_create) &&
           load("cuGetErrorName", 6000, g.error_name);
    return g;
  }();
  return a;
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = "unknown";
  if (api().error_name) api().error_name(r, &name);
  OPD_FAIL(Cuda, what, " failed: ", name, " (", static_cast<int>(r), ")");
}

void destroy_stream(cudaStream_t s) noexcept {
  if (!s) return;
  try {
    device_allocator().release_stream(s);
  } catch (...) {
  }
  (void)cudaStreamDestroy(s);
}

}  // namespace

bool SmPartition::supported() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return false;
  }
  return api().ok;
}

SmPartition::SmPartition(int device, int sms_b) {
  try {
    create(device, sms_b);
  } catch (...) {
    release();
    throw;
  }
}

void SmPartition::create(int device, int sms_b) {
  OPD_CHECK(supported(), Unsupported,
            "SM partitions need CUDA green contexts (driver API 12.5 or later) and a device");
  const GreenApi& g = api();
  OPD_CUDA_CHECK(cudaSetDevice(device));
  OPD_CUDA_CHECK(cudaFree(nullptr));  // the primary context exists before the green ones
  CUdevice dev = 0;
  check(g.device_get(&dev, device), "cuDeviceGet");
  CUdevResource all{};
  check(g.get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
  const int total = static_cast<int>(all.sm.smCount);
  granularity_ = static_cast<int>(all.sm.smCoscheduledAlignment);
  OPD_CHECK(sms_b >= 1 && sms_b < total, InvalidArgument, "SM partition: group B asks for ", sms_b,
            " SMs of the device's ", total, " (must leave group A at least one)");
  CUdevResource b{}, a{};
  unsigned int groups = 1;
  check(g.split(&b, &groups, &all, &a, 0, static_cast<unsigned int>(sms_b)),
        "cuDevSmResourceSplitByCount");
  OPD_CHECK(groups == 1 && a.sm.smCount > 0, InvalidArgument, "SM partition: ", sms_b,
            " SMs for group B (rounded to ", b.sm.smCount, ") leave none of the ", total, " for group A");
  sms_a_ = static_cast<int>(a.sm.smCount);
  sms_b_ = static_cast<int>(b.sm.smCount);
  CUdevResourceDesc desc_a = nullptr, desc_b = nullptr;
  check(g.generate_desc(&desc_a, &a, 1), "cuDevResourceGenerateDesc (A)");
  check(g.generate_desc(&desc_b, &b, 1), "cuDevResourceGenerateDesc (B)");
  CUgreenCtx ca = nullptr, cb = nullptr;
  check(g.create(&ca, desc_a, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate (A)");
  ctx_a_ = ca;
  check(g.create(&cb, desc_b, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate (B)");
  ctx_b_ = cb;
  CUstream sa = nullptr, sb = nullptr;
  check(g.stream_create(&sa, ca, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate (A)");
  stream_a_ = sa;
  check(g.stream_create(&sb, cb, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate (B)");
  stream_b_ = sb;
}

SmPartition::~SmPartition() { release(); }

void SmPartition::release() noexcept {
  destroy_stream(stream_a_);
  destroy_stream(stream_b_);
  if (api().destroy) {
    if (ctx_a_) (void)api().destroy(static_cast<CUgreenCtx>(ctx_a_));
    if (ctx_b_) (void)api().destroy(static_cast<CUgreenCtx>(ctx_b_));
  }
  stream_a_ = stream_b_ = nullptr;
  ctx_a_ = ctx_b_ = nullptr;
}

std::string SmPartition::describe() const {
  return cat("A ", sms_a_, " SMs + B ", sms_b_, " SMs (granularity ", granularity_, ")");
}

}  // namespace opd::cuda
