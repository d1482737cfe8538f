// The fused kernels of the incremental forward (kernels/cuda/decode_fused.cu) against the
// composition of the CPU ops they replace: per-head RMSNorm (rounded to the storage dtype, as the
// separate kernel stores it), RoPE, the K/V scatter into cache slots; SwiGLU over a packed
// gate|up row. Head dims 8/16/128, with and without q/k norm, row strides wider than the heads
// (the packed q|k|v GEMM output), f32 and bf16; a bad slot is skipped and reported through the
// flag; launched with programmatic dependent launch behind a producer kernel they give the plain
// launches' bits; and the engine with fused layers gives the plain path's tokens (f32). Skips
// without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/cuda/allocator.h"  // DeviceBuffer
#include "cuda/cuda_test_util.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "rollout/engine.h"
#include "rollout/rollout_test_util.h"

namespace opd::test {
namespace {

struct FusedCase {
  int64_t n, hq, hkv, d;
  bool norm;
};

TEST(CudaDecodeFused, QkvNormRopeStoreMatchesTheCpuComposition) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (DType dt : {DType::F32, DType::BF16}) {
    for (const FusedCase& fc : {FusedCase{7, 4, 2, 16, true}, FusedCase{5, 6, 2, 8, false},
                                FusedCase{3, 16, 8, 128, true}, FusedCase{64, 16, 8, 128, false},
                                // head_dim > 256: pairs beyond the PDL prologue's registers
                                FusedCase{3, 2, 1, 384, true}}) {
      SCOPED_TRACE(cat(dtype_label(dt), " n ", fc.n, " heads ", fc.hq, "/", fc.hkv, " d ", fc.d,
                       fc.norm ? " norm" : ""));
      const int64_t n = fc.n, hq = fc.hq, hkv = fc.hkv, d = fc.d;
      const int64_t R = (hq + 2 * hkv) * d + 8;  // a row stride wider than the heads
      const int64_t bs = 4, blocks = (n + bs - 1) / bs + 2, slots_n = blocks * bs;
      Tensor qkv = rand_in({n, R}, dt, seed++);
      Tensor wq = rand_in({d}, dt, seed++, 0.5, 1.5), wk = rand_in({d}, dt, seed++, 0.5, 1.5);
      std::vector<int32_t> pos(static_cast<size_t>(n)), slots(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t) {
        pos[t] = static_cast<int32_t>(3 + 37 * t);
        slots[t] = static_cast<int32_t>((t * 5 + 3) % slots_n);  // distinct: 5 is coprime
      }
      ASSERT_EQ(std::gcd<int64_t>(5, slots_n), 1) << "slots must be distinct";
      Tensor inv = Tensor::empty({d / 2}, DType::F32);
      for (int64_t i = 0; i < d / 2; ++i)
        inv.data<float>()[i] = static_cast<float>(1.0 / std::pow(1e4, 2.0 * i / d));
      const double eps = 1e-6;

      // CPU reference: split the packed rows, norm (rounded to dt), RoPE, scatter.
      auto heads = [&](int64_t off, int64_t h) {
        Tensor out = Tensor::empty({n, h, d}, DType::F32);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t e = 0; e < h * d; ++e)
            out.data<float>()[t * h * d + e] = qkv.data<float>()[t * R + off + e];
        return out;
      };
      Tensor q = heads(0, hq), k = heads(hq * d, hkv), v = heads((hq + hkv) * d, hkv);
      auto norm_rope = [&](Tensor x, const Tensor& w, int64_t h) {
        if (fc.norm) {
          Tensor y = Tensor::empty({n * h, d}, DType::F32), r = Tensor::empty({n * h}, DType::F32);
          ops::rmsnorm_forward(x.reshape({n * h, d}), w, eps, y, r);
          x = round_through(y, dt).reshape({n, h, d});
        }
        ops::rope_forward(x, Tensor::from_vector(pos, {n}), inv);
        return x;
      };
      Tensor q_ref = norm_rope(q, wq, hq), k_ref = norm_rope(k, wk, hkv);

      Tensor qkv_d = dev(qkv, dt), wq_d = dev(wq, dt), wk_d = dev(wk, dt);
      Tensor pos_d = Tensor::from_vector(pos, {n}).to(Device::CUDA);
      Tensor slots_d = Tensor::from_vector(slots, {n}).to(Device::CUDA);
      Tensor inv_d = inv.to(Device::CUDA);
      Tensor q_out = dev_poison({n, hq, d}, dt);
      Tensor kc = dev_poison({blocks, bs, hkv, d}, dt), vc = dev_poison({blocks, bs, hkv, d}, dt);
      Tensor flag = Tensor::from_vector(std::vector<int32_t>{-1}, {1}).to(Device::CUDA);
      cuda::QkvNormRopeStoreArgs a;
      const size_t es = dtype_size(dt);
      a.q = qkv_d.raw();
      a.k = static_cast<const char*>(qkv_d.raw()) + hq * d * es;
      a.v = static_cast<const char*>(qkv_d.raw()) + (hq + hkv) * d * es;
      a.q_stride = a.k_stride = a.v_stride = R;
      a.q_norm = fc.norm ? wq_d.raw() : nullptr;
      a.k_norm = fc.norm ? wk_d.raw() : nullptr;
      a.eps = static_cast<float>(eps);
      a.positions = pos_d.data<int32_t>();
      a.inv_freq = inv_d.data<float>();
      a.slot_mapping = slots_d.data<int32_t>();
      a.n = n;
      a.hq = hq;
      a.hkv = hkv;
      a.head_dim = d;
      a.num_slots = slots_n;
      a.dtype = dt;
      a.q_out = q_out.raw();
      a.k_cache = kc.raw();
      a.v_cache = vc.raw();
      a.error_flag = reinterpret_cast<unsigned*>(flag.raw());
      cuda::qkv_norm_rope_store(a, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(flag.to(Device::CPU).data<int32_t>()[0], -1);
      EXPECT_TRUE(close_as(host(q_out), q_ref, dt));
      // The cache rows at the slots: k rotated, v copied exactly.
      Tensor kh = host(kc), vh = host(vc);
      Tensor k_got = Tensor::empty({n, hkv, d}, DType::F32), v_got = Tensor::empty({n, hkv, d}, DType::F32);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t e = 0; e < hkv * d; ++e) {
          k_got.data<float>()[t * hkv * d + e] = kh.data<float>()[slots[t] * hkv * d + e];
          v_got.data<float>()[t * hkv * d + e] = vh.data<float>()[slots[t] * hkv * d + e];
        }
      EXPECT_TRUE(close_as(k_got, k_ref, dt));
      EXPECT_TRUE(close(v_got, v, 0, 0, 0));

      // A bad slot: that token's k/v are skipped and it is reported; the others are written.
      std::vector<int32_t> bad = slots;
      bad[n / 2] = static_cast<int32_t>(slots_n);
      Tensor bad_d = Tensor::from_vector(bad, {n}).to(Device::CUDA);
      Tensor kc2 = dev_poison({blocks, bs, hkv, d}, dt), vc2 = dev_poison({blocks, bs, hkv, d}, dt);
      a.slot_mapping = bad_d.data<int32_t>();
      a.k_cache = kc2.raw();
      a.v_cache = vc2.raw();
      cuda::qkv_norm_rope_store(a, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(flag.to(Device::CPU).data<int32_t>()[0], n / 2);
      Tensor vh2 = host(vc2);
      EXPECT_EQ(vh2.data<float>()[slots[0] * hkv * d], v.data<float>()[0]);
    }
  }
}

// The decode attention issues each warp's first K/V loads before its PDL wait, all positions but
// this step's token (whose K/V its predecessor, qkv_norm_rope_store, writes). Launched early
// behind that store, which itself waits behind a 200 us kernel, the attention's prologue runs
// long before the store: with the new tokens' cache slots poisoned (NaN) beforehand, a load of
// them before the wait would put NaN in the output. The output and the caches must equal the
// plain launches' bytes over GQA groups 1-16, head dims 8-256, with and without q/k norm,
// packed rows wider than the heads, automatic and forced splits (the new token in a later
// split), unequal lengths down to 1.
TEST(CudaDecodeFused, DecodeAttentionLaunchedEarlyReadsThisStepsTokenOnlyAfterItsStore) {
  REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  struct Case {
    int64_t batch, hq, hkv, d, bs;
    bool norm;
    int splits;  // 0: the launch's choice
  };
  uint64_t seed = 900;
  auto bytes = [](const Tensor& t) {
    Tensor h = t.to(Device::CPU);
    const auto* p = static_cast<const uint8_t*>(h.raw());
    return std::vector<uint8_t>(p, p + h.nbytes());
  };
  for (DType dt : {DType::F32, DType::BF16}) {
    for (const Case& c : {Case{5, 4, 2, 16, 4, true, 0}, Case{3, 6, 2, 8, 16, false, 2},
                          Case{64, 16, 8, 128, 16, true, 0}, Case{7, 16, 8, 128, 16, false, 3},
                          Case{4, 32, 2, 64, 16, true, 1}, Case{3, 2, 1, 256, 8, true, 2},
                          Case{6, 8, 8, 32, 16, true, 5}}) {
      SCOPED_TRACE(cat(dtype_label(dt), " batch ", c.batch, " heads ", c.hq, "/", c.hkv, " d ",
                       c.d, " block ", c.bs, c.norm ? " norm" : "", " splits ", c.splits));
      const int64_t B = c.batch, hq = c.hq, hkv = c.hkv, d = c.d, bs = c.bs;
      const int64_t R = (hq + 2 * hkv) * d + 8;  // a row stride wider than the heads
      std::vector<int32_t> lens, cu{0}, pos, slots;
      int64_t max_len = 0, width = 0, blocks = 3;
      for (int64_t b = 0; b < B; ++b) {
        lens.push_back(static_cast<int32_t>(b == 1 ? 1 : 1 + (b * 37 + 11) % 150));
        cu.push_back(static_cast<int32_t>(b + 1));
        max_len = std::max<int64_t>(max_len, lens.back());
        width = std::max<int64_t>(width, (lens.back() + bs - 1) / bs);
        blocks += (lens.back() + bs - 1) / bs;
      }
      while (std::gcd<int64_t>(7, blocks) != 1) ++blocks;  // 7 must generate every id
      // Each sequence's blocks: distinct ids in a scrambled order.
      std::vector<int32_t> table(static_cast<size_t>(B * width), 0);
      int64_t next = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
          table[b * width + i] = static_cast<int32_t>((next++ * 7 + 2) % blocks);
      ASSERT_EQ(std::gcd<int64_t>(7, blocks), 1) << "block ids must be distinct";
      for (int64_t b = 0; b < B; ++b) {
        const int64_t t = lens[b] - 1;
        pos.push_back(static_cast<int32_t>(t));
        slots.push_back(static_cast<int32_t>(table[b * width + t / bs] * bs + t % bs));
      }
      Tensor qkv = dev(rand_in({B, R}, dt, seed++), dt);
      Tensor wq = dev(rand_in({d}, dt, seed++, 0.5, 1.5), dt), wk = dev(rand_in({d}, dt, seed++, 0.5, 1.5), dt);
      // The caches: random, but NaN at every new token's slot until the store writes it.
      Tensor kc_h = rand_in({blocks, bs, hkv, d}, dt, seed++);
      Tensor vc_h = rand_in({blocks, bs, hkv, d}, dt, seed++);
      for (int32_t slot : slots)
        for (int64_t e = 0; e < hkv * d; ++e) {
          kc_h.data<float>()[slot * hkv * d + e] = std::nanf("");
          vc_h.data<float>()[slot * hkv * d + e] = std::nanf("");
        }
      Tensor kc0 = dev(kc_h, dt), vc0 = dev(vc_h, dt);
      Tensor inv = Tensor::empty({d / 2}, DType::F32);
      for (int64_t i = 0; i < d / 2; ++i)
        inv.data<float>()[i] = static_cast<float>(1.0 / std::pow(1e6, 2.0 * i / d));
      Tensor inv_d = inv.to(Device::CUDA), pos_d = dev_i32(Tensor::from_vector(pos, {B}));
      Tensor cu_d = dev_i32(Tensor::from_vector(cu, {B + 1}));
      Tensor lens_d = dev_i32(Tensor::from_vector(lens, {B}));
      Tensor table_d = dev_i32(Tensor::from_vector(table, {B, width}));

      // Store + attention on fresh copies of the caches, plain or PDL-launched behind the 200 us
      // kernel; returns out, k cache, v cache, flag.
      auto run = [&](bool pdl, const std::vector<int32_t>& slot_ids) {
        Tensor kc = kc0.clone(), vc = vc0.clone();
        Tensor q_out = dev_poison({B, hq, d}, dt), out = dev_poison({B, hq, d}, dt);
        Tensor flag = Tensor::from_vector(std::vector<int32_t>{-1}, {1}).to(Device::CUDA);
        Tensor slots_d = dev_i32(Tensor::from_vector(slot_ids, {B}));
        cuda::QkvNormRopeStoreArgs f;
        f.set_packed_qkv(qkv.raw(), hq, hkv, d, dt);
        f.q_stride = f.k_stride = f.v_stride = R;
        f.q_norm = c.norm ? wq.raw() : nullptr;
        f.k_norm = c.norm ? wk.raw() : nullptr;
        f.eps = 1e-6f;
        f.positions = pos_d.data<int32_t>();
        f.inv_freq = inv_d.data<float>();
        f.slot_mapping = slots_d.data<int32_t>();
        f.n = B;
        f.hq = hq;
        f.hkv = hkv;
        f.head_dim = d;
        f.num_slots = blocks * bs;
        f.dtype = dt;
        f.q_out = q_out.raw();
        f.k_cache = kc.raw();
        f.v_cache = vc.raw();
        f.error_flag = reinterpret_cast<unsigned*>(flag.raw());
        f.pdl = pdl;
        cuda::PagedAttentionArgs a;
        a.q = q_out.raw();
        a.k_cache = kc.raw();
        a.v_cache = vc.raw();
        a.out = out.raw();
        a.cu_seqlens_q = cu_d.data<int32_t>();
        a.seq_lens = lens_d.data<int32_t>();
        a.block_tables = table_d.data<int32_t>();
        a.batch = B;
        a.total_q = B;
        a.hq = hq;
        a.hkv = hkv;
        a.head_dim = d;
        a.num_blocks = blocks;
        a.block_size = bs;
        a.max_blocks = width;
        a.max_q_len = 1;
        a.max_seq_len = max_len;
        a.scale = 1.0 / std::sqrt(static_cast<double>(d));
        a.dtype = dt;
        a.error_flag = f.error_flag;
        a.force_splits = c.splits;
        a.pdl = pdl;
        const cuda::PagedAttentionLaunch l = cuda::paged_attention_launch(a);
        cuda::DeviceBuffer ws(l.workspace_bytes, nullptr);
        // Everything allocated and copied before the launches (an allocation may synchronize).
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        if (pdl) cuda::spin(200.0, stream, true);
        cuda::qkv_norm_rope_store(f, stream);
        cuda::paged_attention(a, l.workspace_bytes ? ws.get() : nullptr, stream);
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        if (c.splits > 0) EXPECT_EQ(l.num_splits, std::min<int64_t>(c.splits, max_len));
        return std::vector<Tensor>{out, kc, vc, flag.to(Device::CPU)};
      };
      const std::vector<Tensor> plain = run(false, slots), early = run(true, slots);
      EXPECT_EQ(plain[3].data<int32_t>()[0], -1);
      EXPECT_EQ(early[3].data<int32_t>()[0], -1);
      // close(..., 0, 0, 0): exact, and NaN never passes.
      EXPECT_TRUE(close(host(plain[0]), host(plain[0]), 0, 0, 0)) << "NaN in the plain output";
      EXPECT_TRUE(close(host(plain[1]), host(plain[1]), 0, 0, 0)) << "a new token's k never stored";
      EXPECT_TRUE(bytes(early[0]) == bytes(plain[0])) << diff_summary(host(early[0]), host(plain[0]));
      EXPECT_TRUE(bytes(early[1]) == bytes(plain[1])) << "k cache differs";
      EXPECT_TRUE(bytes(early[2]) == bytes(plain[2])) << "v cache differs";
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(CudaDecodeFused, SwigluPackedMatchesTheCpu) {
  REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (int64_t inter : {40, 37}) {  // 16-byte chunks; single elements
      SCOPED_TRACE(cat(dtype_label(dt), " inter ", inter));
      const int64_t n = 13;
      Tensor gu = rand_in({n, 2 * inter}, dt, 77, -4, 4);
      Tensor g = Tensor::empty({n, inter}, DType::F32), u = Tensor::empty({n, inter}, DType::F32);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < inter; ++i) {
          g.data<float>()[t * inter + i] = gu.data<float>()[t * 2 * inter + i];
          u.data<float>()[t * inter + i] = gu.data<float>()[t * 2 * inter + inter + i];
        }
      Tensor ref = Tensor::empty({n, inter}, DType::F32);
      ops::swiglu_forward(g, u, ref);
      Tensor gu_d = dev(gu, dt), out = dev_poison({n, inter}, dt);
      cuda::swiglu_packed_forward(gu_d.raw(), n, inter, dt, out.raw(), nullptr);
      EXPECT_TRUE(close_as(host(out), ref, dt));
    }
  }
}

// Programmatic dependent launch (kernels/cuda/pdl.cuh) of the fused kernels, each right behind a
// kernel that writes its input (gather_rows copying it from a source buffer into a NaN-poisoned
// one): the outputs equal the plain launches' bit for bit and hold no NaN, so nothing was read
// from the input before the kernel's pdl_wait(). W1's decode shape (64 tokens, 16/8 heads of
// 128, q/k norm) and head_dim 384 (pairs beyond the prologue's registers); f32 and bf16.
TEST(CudaDecodeFused, PdlLaunchesBehindAProducerGiveThePlainLaunchesBits) {
  REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  uint64_t seed = 900;
  for (DType dt : {DType::F32, DType::BF16}) {
    for (const FusedCase& fc : {FusedCase{64, 16, 8, 128, true}, FusedCase{5, 2, 1, 384, true}}) {
      SCOPED_TRACE(cat(dtype_label(dt), " n ", fc.n, " d ", fc.d));
      const int64_t n = fc.n, hq = fc.hq, hkv = fc.hkv, d = fc.d, R = (hq + 2 * hkv) * d;
      const int64_t bs = 16, blocks = (n + bs - 1) / bs + 1, slots_n = blocks * bs;
      std::vector<int32_t> pos(n), slots(n), identity(n);
      for (int64_t t = 0; t < n; ++t) {
        pos[t] = static_cast<int32_t>(11 + 29 * t);
        slots[t] = static_cast<int32_t>((t * 7 + 2) % slots_n);
        identity[t] = static_cast<int32_t>(t);
      }
      ASSERT_EQ(std::gcd<int64_t>(7, slots_n), 1);
      Tensor inv = Tensor::empty({d / 2}, DType::F32);
      for (int64_t i = 0; i < d / 2; ++i)
        inv.data<float>()[i] = static_cast<float>(1.0 / std::pow(1e4, 2.0 * i / d));
      Tensor src = dev(rand_in({n, R}, dt, seed++), dt);
      Tensor wq = dev(rand_in({d}, dt, seed++, 0.5, 1.5), dt), wk = dev(rand_in({d}, dt, seed++, 0.5, 1.5), dt);
      Tensor pos_d = Tensor::from_vector(pos, {n}).to(Device::CUDA);
      Tensor slots_d = Tensor::from_vector(slots, {n}).to(Device::CUDA);
      Tensor rows_d = Tensor::from_vector(identity, {n}).to(Device::CUDA);
      Tensor inv_d = inv.to(Device::CUDA);
      const int64_t inter = 3 * d;
      Tensor gu_src = dev(rand_in({n, 2 * inter}, dt, seed++, -4, 4), dt);
      std::vector<Tensor> q_outs, kcs, vcs, acts;
      for (bool pdl : {false, true}) {
        Tensor qkv = dev_poison({n, R}, dt), gu = dev_poison({n, 2 * inter}, dt);
        Tensor q_out = dev_poison({n, hq, d}, dt);
        Tensor kc = dev_poison({blocks, bs, hkv, d}, dt), vc = dev_poison({blocks, bs, hkv, d}, dt);
        Tensor act = dev_poison({n, inter}, dt);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        cuda::gather_rows(src.raw(), dt, n, rows_d.data<int32_t>(), n, R, qkv.raw(), dt, stream);
        cuda::QkvNormRopeStoreArgs a;
        a.set_packed_qkv(qkv.raw(), hq, hkv, d, dt);  // R = (hq + 2 hkv) d
        a.q_norm = wq.raw();
        a.k_norm = wk.raw();
        a.positions = pos_d.data<int32_t>();
        a.inv_freq = inv_d.data<float>();
        a.slot_mapping = slots_d.data<int32_t>();
        a.n = n;
        a.hq = hq;
        a.hkv = hkv;
        a.head_dim = d;
        a.num_slots = slots_n;
        a.dtype = dt;
        a.q_out = q_out.raw();
        a.k_cache = kc.raw();
        a.v_cache = vc.raw();
        a.pdl = pdl;
        cuda::qkv_norm_rope_store(a, stream);
        cuda::gather_rows(gu_src.raw(), dt, n, rows_d.data<int32_t>(), n, 2 * inter, gu.raw(), dt, stream);
        cuda::swiglu_packed_forward(gu.raw(), n, inter, dt, act.raw(), stream, pdl);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        q_outs.push_back(host(q_out));
        acts.push_back(host(act));
        // Only the written cache rows (the rest stays poisoned in both runs).
        Tensor kh = host(kc), vh = host(vc);
        Tensor k_got = Tensor::empty({n, hkv * d}, DType::F32), v_got = Tensor::empty({n, hkv * d}, DType::F32);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t e = 0; e < hkv * d; ++e) {
            k_got.data<float>()[t * hkv * d + e] = kh.data<float>()[slots[t] * hkv * d + e];
            v_got.data<float>()[t * hkv * d + e] = vh.data<float>()[slots[t] * hkv * d + e];
          }
        kcs.push_back(k_got);
        vcs.push_back(v_got);
      }
      // close(..., 0, 0, 0): exact equality, and NaN never passes.
      EXPECT_TRUE(close(q_outs[1], q_outs[0], 0, 0, 0));
      EXPECT_TRUE(close(kcs[1], kcs[0], 0, 0, 0));
      EXPECT_TRUE(close(vcs[1], vcs[0], 0, 0, 0));
      EXPECT_TRUE(close(acts[1], acts[0], 0, 0, 0));
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The engine with fused layers gives the plain path's tokens on every fixture family (f32:
// the two differ by summation order only); greedy and sampled, n = 2, chunked prefill.
TEST(CudaDecodeFused, EngineFusedLayersGiveThePlainPathsTokens) {
  REQUIRE_GPU();
  for (const char* family : families()) {
    Transformer gpu = Transformer::load(model_dir(family)).to(Device::CUDA, DType::F32);
    const int64_t V = gpu.config().vocab_size;
    std::vector<GenerationRequest> reqs;
    for (int i = 0; i < 4; ++i) {
      GenerationRequest r = request(seeded_prompt(90 + i, 3 + 5 * i, V), 16, i % 2 ? 1.0 : 0.0, 7 + i, 2);
      r.ignore_eos = true;
      reqs.push_back(r);
    }
    EngineOptions plain;
    plain.cuda_fused = false;
    plain.max_step_tokens = 9;
    plain.block_size = 4;
    EngineOptions fused = plain;
    fused.cuda_fused = true;
    auto want = RolloutEngine(gpu, plain, {}).generate(reqs);
    auto got = RolloutEngine(gpu, fused, {}).generate(reqs);
    for (size_t r = 0; r < reqs.size(); ++r)
      for (size_t k = 0; k < 2; ++k) {
        EXPECT_EQ(got[r].samples[k].ids, want[r].samples[k].ids) << family << " request " << r;
        for (size_t t = 0; t < std::min(got[r].samples[k].ids.size(), want[r].samples[k].ids.size()); ++t)
          EXPECT_NEAR(got[r].samples[k].model_logprobs[t], want[r].samples[k].model_logprobs[t], 1e-4);
      }
  }
}

}  // namespace
}  // namespace opd::test
