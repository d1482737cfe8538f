// CUDA paged KV cache ops (kernels/cuda/paged_attention.cu) against the CPU reference
// (kernels/cpu/paged_attention.cpp, f64) on the same bf16/f32-representable inputs:
// kv_cache_store bit-exact; paged attention over shuffled block tables for block sizes 1/4/16,
// odd lengths, GQA ratios 1/2/3/4/8/12, head_dim 8/16/32/64/128/256, decode (1 query row: the
// decode-only kernel, also against the general kernel at the W1 shape with unequal lengths),
// chunked prefill (query rows after a context), batches 1..64, the split-KV combine path forced
// and natural;
// poisoned outputs; bad slots / block ids / lengths rejected with the CPU's messages and nothing
// written; the raw (graph) API never faults on bad indices and reports them through its flag.
// GPU only: every test skips cleanly without a device.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "core/cuda/allocator.h"
#include "core/philox.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

Tensor i32(const std::vector<int32_t>& v, const Shape& shape) { return Tensor::from_vector(v, shape); }

struct PagedSetup {
  int64_t B = 0, T = 0, hq = 0, hkv = 0, d = 0, bs = 0, num_blocks = 0, max_blocks = 0;
  std::vector<int32_t> lens, q_lens, cu, table;
  Tensor k_all, v_all;   // host f64 [sum lens, hkv, d]: every position's key/value
  Tensor q;              // host f64 [T, hq, d]: the query rows
  std::vector<int32_t> slots;  // slot of every position (sequence-major)
};

// lens[b] tokens in the cache, the last q_lens[b] of them queried. Blocks are handed out in a
// shuffled order with spare blocks; unused table entries hold -1 (never read).
PagedSetup make_setup(std::vector<int32_t> lens, std::vector<int32_t> q_lens, int64_t hq,
                      int64_t hkv, int64_t d, int64_t bs, DType dt, uint64_t seed) {
  PagedSetup s;
  s.B = static_cast<int64_t>(lens.size());
  s.lens = lens;
  s.q_lens = q_lens;
  s.hq = hq;
  s.hkv = hkv;
  s.d = d;
  s.bs = bs;
  s.cu = {0};
  int64_t positions = 0, needed = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    s.cu.push_back(s.cu.back() + q_lens[b]);
    positions += lens[b];
    const int64_t nb = (lens[b] + bs - 1) / bs;
    needed += nb;
    s.max_blocks = std::max(s.max_blocks, nb);
  }
  s.max_blocks = std::max<int64_t>(s.max_blocks + 1, 1);  // a spare column of -1
  s.T = s.cu.back();
  s.num_blocks = needed + 5;
  std::vector<int32_t> perm(static_cast<size_t>(s.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[philox_u32(seed, 9, i) % i]);
  s.table.assign(static_cast<size_t>(s.B * s.max_blocks), -1);
  size_t next = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t p = 0; p < lens[b]; ++p) {
      if (p % bs == 0) s.table[b * s.max_blocks + p / bs] = perm[next++];
      s.slots.push_back(static_cast<int32_t>(s.table[b * s.max_blocks + p / bs] * bs + p % bs));
    }
  }
  auto exact = [&](const Shape& sh, uint64_t sd, double lo, double hi) {
    return rand_in(sh, dt, sd, lo, hi).to_dtype(DType::F64);
  };
  s.k_all = exact({positions, hkv, d}, seed + 1, -2, 2);
  s.v_all = exact({positions, hkv, d}, seed + 2, -2, 2);
  s.q = exact({s.T, hq, d}, seed + 3, -2, 2);
  return s;
}

// The CPU reference output (f64) for the setup.
Tensor reference(const PagedSetup& s) {
  Tensor kc = Tensor::zeros({s.num_blocks, s.bs, s.hkv, s.d}, DType::F64);
  Tensor vc = Tensor::zeros({s.num_blocks, s.bs, s.hkv, s.d}, DType::F64);
  const int64_t P = static_cast<int64_t>(s.slots.size());
  ops::kv_cache_store(s.k_all, s.v_all, i32(s.slots, {P}), kc, vc);
  Tensor out = Tensor::poisoned({s.T, s.hq, s.d}, DType::F64);
  ops::paged_attention(s.q, kc, vc, i32(s.cu, {s.B + 1}), i32(s.lens, {s.B}),
                       i32(s.table, {s.B, s.max_blocks}), 1.0 / std::sqrt(double(s.d)), out);
  return out;
}

struct GpuCache {
  Tensor kc, vc;
};
// The cache filled on the GPU by kv_cache_store (slots on the device). Unused slots poisoned.
GpuCache gpu_cache(const PagedSetup& s, DType dt) {
  GpuCache c{dev_poison({s.num_blocks, s.bs, s.hkv, s.d}, dt),
             dev_poison({s.num_blocks, s.bs, s.hkv, s.d}, dt)};
  const int64_t P = static_cast<int64_t>(s.slots.size());
  ops::kv_cache_store(dev(s.k_all.to_dtype(DType::F32), dt), dev(s.v_all.to_dtype(DType::F32), dt),
                      dev_i32(i32(s.slots, {P})), c.kc, c.vc);
  return c;
}

Tensor run_gpu(const PagedSetup& s, DType dt, const GpuCache& c, bool indices_on_device) {
  Tensor out = dev_poison({s.T, s.hq, s.d}, dt);
  Tensor cu = i32(s.cu, {s.B + 1}), lens = i32(s.lens, {s.B}),
         table = i32(s.table, {s.B, s.max_blocks});
  if (indices_on_device) {
    cu = dev_i32(cu);
    lens = dev_i32(lens);
    table = dev_i32(table);
  }
  ops::paged_attention(dev(s.q.to_dtype(DType::F32), dt), c.kc, c.vc, cu, lens, table,
                       1.0 / std::sqrt(double(s.d)), out);
  return host(out).to_dtype(DType::F64);
}

// bf16: K/V/q exact in bf16, scores/softmax/accumulation in f32 (P is NOT rounded to bf16), one
// rounding of the output to bf16 (<= 2^-9 relative): rtol 8e-3; the atol covers outputs near 0
// (convex combinations of values in [-2, 2) that cancel) against f32 accumulation noise.
// f32: exp2f and f32 online-softmax sums over <= 1000 keys: ~1e-6 relative.
Tol paged_tol(DType dt) { return dt == DType::F32 ? Tol{1e-4, 1e-5, 2e-5} : Tol{8e-3, 2e-4, 4e-3}; }

::testing::AssertionResult matches(const Tensor& got, const Tensor& ref, DType dt) {
  const Tol t = paged_tol(dt);
  return close(got, ref, t.rtol, t.atol, t.rel_l2);
}

struct Case {
  const char* name;
  std::vector<int32_t> lens, q_lens;
  int64_t hq, hkv, d, bs;
};

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({"decode_one", {1}, {1}, 2, 1, 128, 16});
  v.push_back({"decode_odd_bs1", {7, 33, 1, 100}, {1, 1, 1, 1}, 16, 8, 128, 1});
  v.push_back({"decode_bs4_gqa4", {5, 17, 64, 65, 3}, {1, 1, 1, 1, 1}, 16, 4, 128, 4});
  v.push_back({"decode_mha_d64", {31, 200, 9}, {1, 1, 1}, 4, 4, 64, 16});
  v.push_back({"decode_gqa8_d32", {129, 1, 77}, {1, 1, 1}, 8, 1, 32, 16});
  v.push_back({"prefill_fresh", {37, 16, 1}, {37, 16, 1}, 4, 2, 128, 16});
  v.push_back({"chunk_after_context", {50, 300, 19}, {13, 7, 19}, 16, 8, 128, 4});
  v.push_back({"mixed_decode_and_chunks", {1000, 2, 257, 640}, {1, 2, 31, 1}, 16, 8, 128, 16});
  v.push_back({"empty_query_rows", {12, 40}, {0, 3}, 4, 2, 64, 4});
  v.push_back({"gqa8_chunk_d128", {90, 45}, {9, 45}, 8, 1, 128, 1});
  // The fixture models' small heads (qwen2: head_dim 8, the others 16): 1-2 lanes per token.
  v.push_back({"small_heads_d8", {23, 1, 70}, {5, 1, 1}, 6, 2, 8, 4});
  v.push_back({"small_heads_d16", {9, 130, 2}, {9, 1, 2}, 4, 1, 16, 16});
  // Decode-only kernel (every q_len <= 1): head_dim 256, a group that is not a power of two (3:
  // a tile of 4 heads with one unused), a group of 12 (two tiles of 8), sequences without a
  // query row, and block size 1 with more blocks than one CTA stages (1023 positions per split
  // at most: forced splits).
  v.push_back({"decode_d256", {300, 17, 1}, {1, 1, 1}, 8, 2, 256, 16});
  v.push_back({"decode_gqa3_partial_tile", {65, 130}, {1, 1}, 6, 2, 64, 16});
  v.push_back({"decode_gqa12_two_tiles", {70, 33}, {1, 1}, 12, 1, 128, 4});
  v.push_back({"decode_no_query_rows", {12, 40, 5}, {0, 1, 1}, 4, 2, 128, 16});
  v.push_back({"decode_bs1_beyond_staged_table", {2500, 3}, {1, 1}, 4, 2, 64, 1});
  v.push_back({"chunk_d256", {40, 20}, {5, 20}, 4, 2, 256, 16});
  return v;
}

TEST(CudaPagedAttention, MatchesCpuReferenceAcrossShapes) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dt : {DType::BF16, DType::F32}) {
    for (const Case& c : cases()) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_label(dt));
      PagedSetup s = make_setup(c.lens, c.q_lens, c.hq, c.hkv, c.d, c.bs, dt, seed += 10);
      Tensor ref = reference(s);
      GpuCache cache = gpu_cache(s, dt);
      EXPECT_TRUE(matches(run_gpu(s, dt, cache, false), ref, dt));
      EXPECT_TRUE(matches(run_gpu(s, dt, cache, true), ref, dt));
    }
  }
}

// The W1 decode shape (64 sequences x 8 kv heads, 16 query heads, head_dim 128, blocks of 16)
// at contexts 256..768 through the Tensor-level op (the decode kernel, one split on an H200).
TEST(CudaPagedAttention, W1DecodeBatch64) {
  REQUIRE_GPU();
  for (int32_t base : {256, 511, 768}) {
    SCOPED_TRACE(base);
    std::vector<int32_t> lens, q_lens;
    for (int b = 0; b < 64; ++b) {
      lens.push_back(base - (b * 7) % 13);
      q_lens.push_back(1);
    }
    PagedSetup s = make_setup(lens, q_lens, 16, 8, 128, 16, DType::BF16, 7 + base);
    cuda::PagedAttentionArgs a;
    a.batch = 64;
    a.total_q = 64;
    a.hq = 16;
    a.hkv = 8;
    a.head_dim = 128;
    a.block_size = 16;
    a.max_q_len = 1;
    a.max_seq_len = base;
    a.dtype = DType::BF16;
    EXPECT_TRUE(cuda::paged_attention_launch(a).decode) << "decode rows take the decode kernel";
    EXPECT_TRUE(matches(run_gpu(s, DType::BF16, gpu_cache(s, DType::BF16), true), reference(s),
                        DType::BF16));
  }
}

// One raw-API call on a setup (indices on the device): the output as f64 on the host.
struct RawRun {
  Tensor out;
  cuda::PagedAttentionLaunch launch;
};
RawRun run_raw(const PagedSetup& s, const GpuCache& c, DType dt, int64_t max_q_len,
               int64_t max_seq_len, int force_splits, int sm_count = 0) {
  Tensor q = dev(s.q.to_dtype(DType::F32), dt);
  Tensor cu = dev_i32(i32(s.cu, {s.B + 1})), lens = dev_i32(i32(s.lens, {s.B})),
         table = dev_i32(i32(s.table, {s.B, s.max_blocks}));
  Tensor out = dev_poison({s.T, s.hq, s.d}, dt);
  Tensor flag = dev_i32(i32({-1}, {1}));
  cuda::PagedAttentionArgs a;
  a.q = q.raw();
  a.k_cache = c.kc.raw();
  a.v_cache = c.vc.raw();
  a.out = out.raw();
  a.cu_seqlens_q = cu.data<int32_t>();
  a.seq_lens = lens.data<int32_t>();
  a.block_tables = table.data<int32_t>();
  a.batch = s.B;
  a.total_q = s.T;
  a.hq = s.hq;
  a.hkv = s.hkv;
  a.head_dim = s.d;
  a.num_blocks = s.num_blocks;
  a.block_size = s.bs;
  a.max_blocks = s.max_blocks;
  a.max_q_len = max_q_len;
  a.max_seq_len = max_seq_len;
  a.scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  a.dtype = dt;
  a.error_flag = reinterpret_cast<unsigned*>(flag.data<int32_t>());
  a.sm_count = sm_count;
  a.force_splits = force_splits;
  RawRun r;
  r.launch = cuda::paged_attention_launch(a);
  cuda::DeviceBuffer ws(r.launch.workspace_bytes, nullptr);
  cuda::paged_attention(a, r.launch.workspace_bytes ? ws.get() : nullptr, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flag.to(Device::CPU).data<int32_t>()[0], -1) << "no index was bad";
  r.out = host(out).to_dtype(DType::F64);
  return r;
}

// The decode kernel at the W1 shape with unequal context lengths (spread over 200 positions),
// the grid sized as the rollout's graphs size it (max_seq_len = 256 + 512 - 1 = 767, far above
// most lengths) and as tight as possible: against the CPU, against the general kernel on the
// same inputs (max_q_len 2 routes there), bit-identical on a second run, with forced splits,
// and with the splits it picks on its own when the batch is too small to fill 132 SMs.
TEST(CudaPagedAttention, DecodeKernelW1ShapeUnequalLengths) {
  REQUIRE_GPU();
  const DType dt = DType::BF16;
  for (int32_t base : {256, 512, 767}) {
    std::vector<int32_t> lens, q_lens;
    for (int b = 0; b < 64; ++b) {
      lens.push_back(std::max(1, base - (b * 37) % 200));
      q_lens.push_back(1);
    }
    PagedSetup s = make_setup(lens, q_lens, 16, 8, 128, 16, dt, 40 + base);
    Tensor ref = reference(s);
    GpuCache c = gpu_cache(s, dt);
    for (int64_t bound : {int64_t{767}, static_cast<int64_t>(base)}) {
      SCOPED_TRACE(cat("base ", base, " max_seq_len ", bound));
      RawRun fast = run_raw(s, c, dt, 1, bound, 0, 132);
      EXPECT_TRUE(fast.launch.decode);
      EXPECT_EQ(fast.launch.num_splits, 1) << "64 x 8 CTAs fill 132 SMs x 4";
      EXPECT_EQ(fast.launch.rows_per_cta, 2) << "both query heads of a kv head in one CTA";
      EXPECT_TRUE(matches(fast.out, ref, dt));
      RawRun again = run_raw(s, c, dt, 1, bound, 0, 132);
      EXPECT_TRUE(same_bits(again.out, fast.out)) << "deterministic";
      RawRun general = run_raw(s, c, dt, 2, bound, 0, 132);
      EXPECT_FALSE(general.launch.decode);
      EXPECT_TRUE(matches(general.out, ref, dt));
      EXPECT_TRUE(close(fast.out, general.out, 8e-3, 4e-3, 4e-3)) << "decode vs general kernel";
      for (int splits : {2, 3, 5}) {
        SCOPED_TRACE(cat("forced splits ", splits));
        RawRun split = run_raw(s, c, dt, 1, bound, splits, 132);
        EXPECT_TRUE(split.launch.decode);
        EXPECT_EQ(split.launch.num_splits, splits);
        EXPECT_TRUE(matches(split.out, ref, dt));
      }
    }
  }
  // A batch of 4 (32 CTAs per split): the decode kernel splits on its own.
  std::vector<int32_t> lens = {768, 700, 513, 90}, q_lens = {1, 1, 1, 1};
  PagedSetup s = make_setup(lens, q_lens, 16, 8, 128, 16, dt, 77);
  RawRun r = run_raw(s, gpu_cache(s, dt), dt, 1, 768, 0, 132);
  EXPECT_TRUE(r.launch.decode);
  EXPECT_GT(r.launch.num_splits, 1);
  EXPECT_GE(r.launch.split_tokens, 64);
  EXPECT_TRUE(matches(r.out, reference(s), dt));
  // Block size 1 and a full batch: one split would fill the GPU, but a CTA stages at most 1024
  // block ids (1023 positions of size-1 blocks), so 1200 positions take 2 splits.
  std::vector<int32_t> long_lens, ones;
  for (int b = 0; b < 64; ++b) {
    long_lens.push_back(1200 - (b * 13) % 150);
    ones.push_back(1);
  }
  PagedSetup t = make_setup(long_lens, ones, 16, 8, 64, 1, dt, 78);
  RawRun r2 = run_raw(t, gpu_cache(t, dt), dt, 1, 1200, 0, 132);
  EXPECT_TRUE(r2.launch.decode);
  EXPECT_EQ(r2.launch.num_splits, 2);
  EXPECT_TRUE(matches(r2.out, reference(t), dt));
}

// Batches 1..64 through the raw API with forced split counts (1, 2, 3, 7): the combine kernel
// against the single-split kernel and the CPU.
TEST(CudaPagedAttention, RawApiForcedSplitsAndBatches) {
  REQUIRE_GPU();
  for (int64_t B : {1, 2, 5, 17, 64}) {
    std::vector<int32_t> lens, q_lens;
    for (int64_t b = 0; b < B; ++b) {
      lens.push_back(static_cast<int32_t>(1 + (b * 37) % 150));
      q_lens.push_back(b % 3 == 0 ? std::min<int32_t>(lens.back(), 4) : 1);
    }
    PagedSetup s = make_setup(lens, q_lens, 8, 2, 128, 16, DType::BF16, 300 + B);
    Tensor ref = reference(s);
    GpuCache c = gpu_cache(s, DType::BF16);
    Tensor q = dev(s.q.to_dtype(DType::F32), DType::BF16);
    Tensor cu = dev_i32(i32(s.cu, {B + 1})), lens_d = dev_i32(i32(s.lens, {B})),
           table = dev_i32(i32(s.table, {B, s.max_blocks}));
    for (int splits : {1, 2, 3, 7}) {
      SCOPED_TRACE(cat("B ", B, " splits ", splits));
      Tensor out = dev_poison({s.T, s.hq, s.d}, DType::BF16);
      cuda::PagedAttentionArgs a;
      a.q = q.raw();
      a.k_cache = c.kc.raw();
      a.v_cache = c.vc.raw();
      a.out = out.raw();
      a.cu_seqlens_q = cu.data<int32_t>();
      a.seq_lens = lens_d.data<int32_t>();
      a.block_tables = table.data<int32_t>();
      a.batch = B;
      a.total_q = s.T;
      a.hq = s.hq;
      a.hkv = s.hkv;
      a.head_dim = s.d;
      a.num_blocks = s.num_blocks;
      a.block_size = s.bs;
      a.max_blocks = s.max_blocks;
      a.max_q_len = 4;
      a.max_seq_len = 150;
      a.scale = 1.0 / std::sqrt(128.0);
      a.dtype = DType::BF16;
      a.force_splits = splits;
      const cuda::PagedAttentionLaunch l = cuda::paged_attention_launch(a);
      EXPECT_EQ(l.num_splits, std::min(splits, 150));
      cuda::DeviceBuffer ws(l.workspace_bytes, nullptr);
      cuda::paged_attention(a, l.workspace_bytes ? ws.get() : nullptr, nullptr);
      EXPECT_TRUE(matches(host(out).to_dtype(DType::F64), ref, DType::BF16));
    }
  }
}

TEST(CudaPagedAttention, KvCacheStoreIsExactAndLeavesOtherSlots) {
  REQUIRE_GPU();
  for (DType dt : {DType::BF16, DType::F32}) {
    for (int64_t d : {128, 6}) {  // 6: rows not a multiple of 16 bytes (element path)
      SCOPED_TRACE(cat(dtype_label(dt), " d ", d));
      const int64_t nb = 9, bs = 4, hkv = 3, n = 11;
      Tensor k = rand_in({n, hkv, d}, dt, 1), v = rand_in({n, hkv, d}, dt, 2);
      std::vector<int32_t> slots;
      for (int64_t t = 0; t < n; ++t) slots.push_back(static_cast<int32_t>((t * 7 + 3) % (nb * bs)));
      Tensor init = rand_in({nb, bs, hkv, d}, dt, 3);
      Tensor kc_ref = init.clone(), vc_ref = init.clone();
      ops::kv_cache_store(k, v, i32(slots, {n}), kc_ref, vc_ref);
      Tensor kc = dev(init, dt), vc = dev(init, dt);
      ops::kv_cache_store(dev(k, dt), dev(v, dt), dev_i32(i32(slots, {n})), kc, vc);
      EXPECT_TRUE(same_bits(host(kc), kc_ref));
      EXPECT_TRUE(same_bits(host(vc), vc_ref));
      // Host slot mapping works too.
      Tensor kc2 = dev(init, dt), vc2 = dev(init, dt);
      ops::kv_cache_store(dev(k, dt), dev(v, dt), i32(slots, {n}), kc2, vc2);
      EXPECT_TRUE(same_bits(host(kc2), kc_ref));
    }
  }
}

TEST(CudaPagedAttention, BadIndicesRejectedWithCpuMessagesNothingWritten) {
  REQUIRE_GPU();
  const DType dt = DType::BF16;
  PagedSetup s = make_setup({20, 9}, {1, 2}, 4, 2, 64, 4, dt, 900);
  GpuCache c = gpu_cache(s, dt);
  Tensor kc_before = host(c.kc);
  // kv_cache_store: slot beyond the cache, and negative.
  for (int32_t bad : {static_cast<int32_t>(s.num_blocks * s.bs), -1}) {
    Tensor k = rand_in({3, s.hkv, s.d}, dt, 5);
    std::vector<int32_t> slots = {0, bad, 1};
    Tensor kc_cpu = Tensor::zeros({s.num_blocks, s.bs, s.hkv, s.d}, DType::F32), vc_cpu = kc_cpu.clone();
    const std::string want = message_head(error_message(
        [&] { ops::kv_cache_store(k, k, i32(slots, {3}), kc_cpu, vc_cpu); }, ErrorKind::InvalidData));
    const std::string got = message_head(error_message(
        [&] { ops::kv_cache_store(dev(k, dt), dev(k, dt), dev_i32(i32(slots, {3})), c.kc, c.vc); },
        ErrorKind::InvalidData));
    EXPECT_EQ(got, want);
    EXPECT_TRUE(same_bits(host(c.kc), kc_before)) << "nothing may be written";
  }
  // paged_attention: a block id outside the cache, a seq_len beyond the table, too few tokens.
  auto attempt = [&](std::vector<int32_t> table, std::vector<int32_t> lens) {
    Tensor out = dev_poison({s.T, s.hq, s.d}, dt);
    const std::string msg = message_head(error_message(
        [&] {
          ops::paged_attention(dev(s.q.to_dtype(DType::F32), dt), c.kc, c.vc,
                               dev_i32(i32(s.cu, {s.B + 1})), dev_i32(i32(lens, {s.B})),
                               dev_i32(i32(table, {s.B, s.max_blocks})), 0.125, out);
        },
        ErrorKind::InvalidData));
    EXPECT_TRUE(all_nan(host(out))) << "nothing may be written";
    return msg;
  };
  auto cpu_message = [&](std::vector<int32_t> table, std::vector<int32_t> lens) {
    Tensor kc = Tensor::zeros({s.num_blocks, s.bs, s.hkv, s.d}, DType::F32);
    Tensor out = Tensor::zeros({s.T, s.hq, s.d}, DType::F32);
    return message_head(error_message(
        [&] {
          ops::paged_attention(s.q.to_dtype(DType::F32), kc, kc, i32(s.cu, {s.B + 1}),
                               i32(lens, {s.B}), i32(table, {s.B, s.max_blocks}), 0.125, out);
        },
        ErrorKind::InvalidData));
  };
  std::vector<int32_t> t1 = s.table;
  t1[s.max_blocks + 1] = static_cast<int32_t>(s.num_blocks);  // sequence 1, block 1
  EXPECT_EQ(attempt(t1, s.lens), cpu_message(t1, s.lens));
  std::vector<int32_t> t2 = s.table;
  t2[2] = -7;
  EXPECT_EQ(attempt(t2, s.lens), cpu_message(t2, s.lens));
  std::vector<int32_t> long_lens = {static_cast<int32_t>(s.max_blocks * s.bs + 1), 9};
  EXPECT_EQ(attempt(s.table, long_lens), cpu_message(s.table, long_lens));
  std::vector<int32_t> short_lens = {20, 1};  // 2 query rows but 1 token
  EXPECT_EQ(attempt(s.table, short_lens), cpu_message(s.table, short_lens));
}

// The raw API does no host-side validation (graph capture): bad indices must not fault, must be
// reported in the flag (first bad sequence / row), and must not disturb the valid sequences.
TEST(CudaPagedAttention, RawApiGuardsBadIndicesWithErrorFlag) {
  REQUIRE_GPU();
  const DType dt = DType::BF16;
  PagedSetup s = make_setup({40, 33, 70}, {1, 1, 1}, 8, 4, 128, 16, dt, 1200);
  Tensor ref = reference(s);
  GpuCache c = gpu_cache(s, dt);
  std::vector<int32_t> table = s.table;
  table[1 * s.max_blocks + 1] = 1 << 30;  // sequence 1 reads a block far outside the cache
  std::vector<int32_t> lens = s.lens;
  lens[2] = 1 << 20;  // sequence 2 claims more tokens than its table (and the bound) hold
  Tensor q = dev(s.q.to_dtype(DType::F32), dt);
  Tensor cu = dev_i32(i32(s.cu, {s.B + 1})), lens_d = dev_i32(i32(lens, {s.B})),
         table_d = dev_i32(i32(table, {s.B, s.max_blocks}));
  Tensor out = dev_poison({s.T, s.hq, s.d}, dt);
  Tensor flag = dev_i32(i32({-1}, {1}));  // 0xffffffff: no error
  for (int splits : {1, 4}) {
    cuda::PagedAttentionArgs a;
    a.q = q.raw();
    a.k_cache = c.kc.raw();
    a.v_cache = c.vc.raw();
    a.out = out.raw();
    a.cu_seqlens_q = cu.data<int32_t>();
    a.seq_lens = lens_d.data<int32_t>();
    a.block_tables = table_d.data<int32_t>();
    a.batch = s.B;
    a.total_q = s.T;
    a.hq = s.hq;
    a.hkv = s.hkv;
    a.head_dim = s.d;
    a.num_blocks = s.num_blocks;
    a.block_size = s.bs;
    a.max_blocks = s.max_blocks;
    a.max_q_len = 1;
    a.max_seq_len = 70;
    a.scale = 1.0 / std::sqrt(128.0);
    a.dtype = dt;
    a.error_flag = reinterpret_cast<unsigned*>(flag.data<int32_t>());
    a.force_splits = splits;
    const cuda::PagedAttentionLaunch l = cuda::paged_attention_launch(a);
    cuda::DeviceBuffer ws(l.workspace_bytes, nullptr);
    cuda::paged_attention(a, l.workspace_bytes ? ws.get() : nullptr, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(flag.to(Device::CPU).data<int32_t>()[0], 1) << "first bad sequence";
    Tensor got = host(out).to_dtype(DType::F64);
    // Sequence 0 (row 0) is intact.
    EXPECT_TRUE(matches(got.slice_rows(0, 1), ref.slice_rows(0, 1), dt));
  }
  // kv_cache_store through the raw API: a bad slot is skipped and its row reported.
  Tensor k = dev(rand_in({4, s.hkv, s.d}, dt, 77), dt);
  std::vector<int32_t> slots = {0, 1, 1 << 30, -5};
  Tensor slots_d = dev_i32(i32(slots, {4}));
  Tensor flag2 = dev_i32(i32({-1}, {1}));
  cuda::PagedStoreArgs st;
  st.k = k.raw();
  st.v = k.raw();
  st.slot_mapping = slots_d.data<int32_t>();
  st.n = 4;
  st.num_blocks = s.num_blocks;
  st.block_size = s.bs;
  st.hkv = s.hkv;
  st.head_dim = s.d;
  st.dtype = dt;
  st.k_cache = c.kc.raw();
  st.v_cache = c.vc.raw();
  st.error_flag = reinterpret_cast<unsigned*>(flag2.data<int32_t>());
  cuda::kv_cache_store(st, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flag2.to(Device::CPU).data<int32_t>()[0], 2) << "first bad row";
}

}  // namespace
}  // namespace opd::test
