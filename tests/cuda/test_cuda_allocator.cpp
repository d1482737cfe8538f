// Caching device allocator: size classes and bookkeeping with a fake backend (runs on the CPU,
// no GPU needed), then the real device allocator behind Tensor (GPU only).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <set>
#include <vector>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "core/tensor.h"

namespace opd {
namespace {

using cuda::AllocatorStats;
using cuda::allocation_class;
using cuda::CachingAllocator;

TEST(AllocatorClasses, RoundUpWithBoundedWaste) {
  EXPECT_EQ(allocation_class(0), 512u);
  EXPECT_EQ(allocation_class(1), 512u);
  EXPECT_EQ(allocation_class(512), 512u);
  EXPECT_EQ(allocation_class(513), 1024u);
  EXPECT_EQ(allocation_class(4096), 4096u);
  EXPECT_EQ(allocation_class(4097), 4096u + 512u);
  EXPECT_EQ(allocation_class(8192), 8192u);
  EXPECT_EQ(allocation_class(size_t{1} << 30), size_t{1} << 30);
  EXPECT_EQ(allocation_class((size_t{1} << 30) + 1), (size_t{1} << 30) + (size_t{2} << 20));
  size_t prev = 0;
  for (size_t b = 1; b < (size_t{3} << 31); b = b * 9 / 8 + 7) {
    const size_t c = allocation_class(b);
    ASSERT_GE(c, b);
    ASSERT_EQ(c % 512, 0u) << b;
    ASSERT_GE(c, prev) << "classes are monotone at " << b;
    if (b > 4096) ASSERT_LE(static_cast<double>(c - b), 0.125 * static_cast<double>(b)) << b;
    ASSERT_EQ(allocation_class(c), c) << "a class is its own class";
    prev = c;
  }
}

// Hands out fake addresses, counts calls, can simulate running out of memory.
struct FakeBackend : cuda::BlockBackend {
  struct Counters {
    int allocs = 0, releases = 0, device_syncs = 0, stream_syncs = 0;
    size_t live_bytes = 0, capacity = SIZE_MAX;
    std::set<void*> live;
  };
  Counters* c;
  char* next = reinterpret_cast<char*>(0x10000);
  explicit FakeBackend(Counters* counters) : c(counters) {}
  void* allocate(size_t bytes) override {
    if (c->live_bytes + bytes > c->capacity) return nullptr;
    void* p = next;
    next += bytes + 256;
    ++c->allocs;
    c->live_bytes += bytes;
    c->live.insert(p);
    sizes[p] = bytes;
    return p;
  }
  void release(void* p) override {
    ++c->releases;
    c->live_bytes -= sizes[p];
    c->live.erase(p);
  }
  int current_device() override { return 0; }
  void synchronize_device() override { ++c->device_syncs; }
  void synchronize_stream(cudaStream_t) override { ++c->stream_syncs; }
  std::map<void*, size_t> sizes;
};

cudaStream_t fake_stream(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }

TEST(AllocatorBookkeeping, SteadyStateReusesBlocksWithoutNewMallocs) {
  FakeBackend::Counters c;
  CachingAllocator a(std::make_unique<FakeBackend>(&c));
  const std::vector<size_t> step = {1000, 123456, 7, 4 << 20, 123456, 999};
  for (int iter = 0; iter < 5; ++iter) {
    std::vector<void*> ptrs;
    for (size_t b : step) ptrs.push_back(a.allocate(b, nullptr));
    std::set<void*> distinct(ptrs.begin(), ptrs.end());
    EXPECT_EQ(distinct.size(), ptrs.size()) << "live blocks are distinct";
    for (void* p : ptrs) a.deallocate(p);
  }
  EXPECT_EQ(c.allocs, 6) << "only the first step reaches the device";
  AllocatorStats s = a.stats();
  EXPECT_EQ(s.allocations, 30);
  EXPECT_EQ(s.cache_hits, 24);
  EXPECT_EQ(s.in_use, 0);
  EXPECT_EQ(s.requested, 0);
  EXPECT_EQ(s.cached, s.reserved);
  int64_t want_peak = 0;
  for (size_t b : step) want_peak += static_cast<int64_t>(allocation_class(b));
  EXPECT_EQ(s.peak_in_use, want_peak);
  EXPECT_EQ(s.reserved, want_peak);
}

TEST(AllocatorBookkeeping, StatsTrackRequestedInUseAndPeak) {
  FakeBackend::Counters c;
  CachingAllocator a(std::make_unique<FakeBackend>(&c));
  void* p = a.allocate(5000, nullptr);
  void* q = a.allocate(100, nullptr);
  AllocatorStats s = a.stats();
  EXPECT_EQ(s.requested, 5100);
  EXPECT_EQ(s.in_use, static_cast<int64_t>(allocation_class(5000) + 512));
  a.deallocate(p);
  s = a.stats();
  EXPECT_EQ(s.requested, 100);
  EXPECT_EQ(s.in_use, 512);
  EXPECT_EQ(s.peak_in_use, static_cast<int64_t>(allocation_class(5000) + 512));
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_in_use, 512);
  a.deallocate(q);
}

TEST(AllocatorBookkeeping, FreeListsArePerStream) {
  FakeBackend::Counters c;
  CachingAllocator a(std::make_unique<FakeBackend>(&c));
  void* p = a.allocate(1 << 20, fake_stream(1));
  a.deallocate(p);
  void* q = a.allocate(1 << 20, fake_stream(2));
  EXPECT_NE(p, q) << "a block freed by stream 1 is not handed to stream 2";
  void* r = a.allocate(1 << 20, fake_stream(1));
  EXPECT_EQ(p, r) << "but is reused by stream 1";
  EXPECT_EQ(c.allocs, 2);
  a.deallocate(q);
  a.deallocate(r);
  a.release_stream(fake_stream(1));
  EXPECT_EQ(c.stream_syncs, 1);
  EXPECT_EQ(c.releases, 1);
  EXPECT_EQ(a.stats().cached, static_cast<int64_t>(allocation_class(1 << 20)));
}

TEST(AllocatorBookkeeping, EmptyCacheReleasesOnlyFreeBlocks) {
  FakeBackend::Counters c;
  CachingAllocator a(std::make_unique<FakeBackend>(&c));
  void* keep = a.allocate(70000, nullptr);
  void* drop = a.allocate(80000, nullptr);
  a.deallocate(drop);
  a.empty_cache();
  EXPECT_EQ(c.releases, 1);
  EXPECT_EQ(c.device_syncs, 1) << "waits for queued kernels before cudaFree";
  EXPECT_TRUE(c.live.count(keep));
  AllocatorStats s = a.stats();
  EXPECT_EQ(s.cached, 0);
  EXPECT_EQ(s.reserved, static_cast<int64_t>(allocation_class(70000)));
  a.empty_cache();  // nothing cached: no sync
  EXPECT_EQ(c.device_syncs, 1);
  a.deallocate(keep);
}

TEST(AllocatorBookkeeping, OutOfMemoryReleasesTheCacheThenThrows) {
  FakeBackend::Counters c;
  c.capacity = 10 << 20;
  CachingAllocator a(std::make_unique<FakeBackend>(&c));
  void* p = a.allocate(6 << 20, nullptr);
  a.deallocate(p);  // cached: 6 MiB of the 10 are reserved
  void* q = a.allocate(7 << 20, nullptr);  // needs the cache released first
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(a.stats().oom_retries, 1);
  EXPECT_EQ(c.releases, 1);
  try {
    a.allocate(8 << 20, nullptr);
    ADD_FAILURE() << "no OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
  a.deallocate(q);
}

TEST(AllocatorBookkeeping, DoubleFreeIsAnInternalError) {
  FakeBackend::Counters c;
  CachingAllocator a(std::make_unique<FakeBackend>(&c));
  void* p = a.allocate(100, nullptr);
  a.deallocate(p);
  EXPECT_THROW(a.deallocate(p), Error);
  a.deallocate(nullptr);  // ignored
}

TEST(AllocatorBookkeeping, DestructorReleasesCachedBlocks) {
  FakeBackend::Counters c;
  {
    CachingAllocator a(std::make_unique<FakeBackend>(&c));
    for (size_t b : {1u << 10, 1u << 14, 1u << 22}) a.deallocate(a.allocate(b, nullptr));
  }
  EXPECT_EQ(c.releases, 3);
  EXPECT_TRUE(c.live.empty());
}

#define REQUIRE_GPU()                                                \
  do {                                                               \
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

TEST(DeviceAllocator, TensorStorageComesFromTheCacheInSteadyState) {
  REQUIRE_GPU();
  auto& a = cuda::device_allocator();
  const MemoryStats before = memory_stats(Device::CUDA);
  for (int iter = 0; iter < 3; ++iter) {
    Tensor x = Tensor::empty({1000, 1000}, DType::F32, Device::CUDA);
    Tensor y = Tensor::zeros({257}, DType::BF16, Device::CUDA);
    EXPECT_EQ(memory_stats(Device::CUDA).in_use - before.in_use, 4000000 + 514);
  }
  const int64_t mallocs = a.stats().device_mallocs;
  for (int iter = 0; iter < 10; ++iter) {
    Tensor x = Tensor::empty({1000, 1000}, DType::F32, Device::CUDA);
    Tensor y = Tensor::zeros({257}, DType::BF16, Device::CUDA);
  }
  EXPECT_EQ(a.stats().device_mallocs, mallocs);
  EXPECT_EQ(memory_stats(Device::CUDA).in_use, before.in_use);
  a.empty_cache();
  EXPECT_EQ(a.stats().cached, 0);
}

TEST(DeviceAllocator, RoundTripThroughCachedBlocksKeepsData) {
  REQUIRE_GPU();
  std::vector<float> v(12345);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f - 7;
  for (int iter = 0; iter < 3; ++iter) {
    Tensor d = Tensor::from_vector(v, {12345}).to(Device::CUDA);
    Tensor h = d.to(Device::CPU);
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(h.data<float>()[i], v[i]);
  }
}

TEST(DeviceAllocator, HugeRequestIsOutOfMemoryNotACrash) {
  REQUIRE_GPU();
  try {
    Tensor t = Tensor::empty({int64_t{1} << 40}, DType::F32, Device::CUDA);  // 4 TiB
    ADD_FAILURE() << "4 TiB allocation succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory) << e.what();
  }
  Tensor ok = Tensor::zeros({16}, DType::F32, Device::CUDA);  // the device is still usable
  EXPECT_EQ(ok.to(Device::CPU).data<float>()[3], 0.0f);
}

}  // namespace
}  // namespace opd
