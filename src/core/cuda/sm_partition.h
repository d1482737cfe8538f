// SmPartition: the device's SMs split into two disjoint groups, each with its own stream (CUDA
// green contexts, driver API >= 12.5, reached through cudaGetDriverEntryPointByVersion so the
// build needs no libcuda). Work issued on stream_a() runs only on group A's SMs, work on
// stream_b() only on group B's; device memory, events and graphs work across both as on any
// stream of the device (the green contexts retain the primary context and share its memory).
//
// Used by `opd bench overlap` to measure two phases at once without them competing for SMs
// (docs/rollout.md "Rollout and teacher scoring at once": a rollout on A beside teacher scoring
// on B; at W1 every split measured slower than the phases one after the other, so the trainer
// does not use it). The driver rounds a group up to its granularity (sm_90: 8 SMs; minimum 8), so
// sms_b() can exceed what was asked; sms_a() is what is left.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace opd::cuda {

class SmPartition {
 public:
  // Group B gets at least `sms_b` SMs (rounded up by the driver); A the rest. Throws Unsupported
  // when the driver has no green contexts, InvalidArgument when sms_b leaves A empty.
  SmPartition(int device, int sms_b);
  ~SmPartition();
  SmPartition(const SmPartition&) = delete;
  SmPartition& operator=(const SmPartition&) = delete;

  cudaStream_t stream_a() const { return stream_a_; }
  cudaStream_t stream_b() const { return stream_b_; }
  int sms_a() const { return sms_a_; }
  int sms_b() const { return sms_b_; }
  int granularity() const { return granularity_; }  // SMs per step of a group's size
  std::string describe() const;                     // "A 100 SMs + B 32 SMs (granularity 8)"

  // Whether this process's driver offers green contexts (false without a device).
  static bool supported();

 private:
  void create(int device, int sms_b);
  void release() noexcept;
  void* ctx_a_ = nullptr;  // CUgreenCtx
  void* ctx_b_ = nullptr;
  cudaStream_t stream_a_ = nullptr;
  cudaStream_t stream_b_ = nullptr;
  int sms_a_ = 0, sms_b_ = 0, granularity_ = 0;
};

}  // namespace opd::cuda
