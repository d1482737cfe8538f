// Hopper warpgroup MMA helpers for the wgmma attention kernels (forward attention_fwd_wgmma.cu,
// backward dK/dV attention_bwd_wgmma.cu): the cp.async loader of swizzled tiles, the
// shared-memory matrix descriptor, wgmma.mma_async wrappers (inline PTX, sm_90a only), the
// fence / commit / wait of the async wgmma pipeline, the 128-byte swizzled tile layout the
// descriptors describe, and for the warp-specialized schedules mbarriers, named barriers and
// setmaxnreg. PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate";
// layouts as in FlashAttention-3 (Shah et al. 2024) and CUTLASS's GMMA canonical layouts.
// Included only by attention_fwd_wgmma.cu and attention_bwd_wgmma.cu (CUDA C++17); every wgmma
// instruction is inside
// `#if OPD_WGMMA_ENABLED` because the same file is also compiled for plain sm_90.
//
// Register fragments of wgmma.m64nNk16 (warpgroup of 4 warps, warp w = rows 16w..16w+15,
// lane: r = lane / 4, c = (lane % 4) * 2) are those of mma.sync.m16n8k16 stacked per warp:
//   A (registers, 64x16 bf16) 4 x b32: a0 = A[r][c..c+1], a1 = A[r+8][c..c+1],
//                                      a2 = A[r][c+8..c+9], a3 = A[r+8][c+8..c+9]
//   D (64xN f32) N/2 floats: d[4i + 0..1] = D[r][8i + c..c+1], d[4i + 2..3] = D[r+8][8i + c..]
// so two adjacent n8 blocks of S (keys 16k..16k+15) rounded to bf16 are the A fragment of
// O += P V for those 16 keys, without shared memory (FlashAttention-2/3).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention_mma.h"  // attn::cp_async_16 (the 16-byte zero-filling copy)
#include "kernels/cuda/mbarrier.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPD_WGMMA_ENABLED 1
#else
#define OPD_WGMMA_ENABLED 0
#endif

namespace opd::cuda::wg {

// Tiles are [rows][128] bf16 stored as two 64-column panels (panel p = columns 64p..64p+63,
// [rows][64], 128-byte rows, panel p at byte p * rows * 128). Inside a panel the 16-byte chunk
// c of row r sits at chunk c ^ (r % 8): the hardware's 128-byte swizzle (Swizzle<3,4,3>),
// which XORs address bits [4:6] with bits [7:9], so every panel must start 1024-byte aligned.
// The same XOR keeps cp.async writes and 8-row reads free of bank conflicts.
__device__ __forceinline__ uint32_t swz128_offset(int rows, int row, int chunk16) {
  const int panel = chunk16 >> 3, c = chunk16 & 7;
  return static_cast<uint32_t>(panel * rows * 128 + row * 128 + ((c ^ (row & 7)) << 4));
}

// Shared-memory matrix descriptor (PTX "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (all >> 4, 14 bits each), layout type 1 = 128-byte swizzle.
//  K-major operand (Q, K in S = Q K^T): rows 8 apart are 1024 bytes apart (SBO); the 16 K
//    elements of one instruction lie inside one 128-byte row, so LBO is unused (16 by
//    convention); stepping K by 16 inside a panel adds 32 bytes to the start address.
//  N-major operand (V in O = P V, V stored [keys][d]): N (d) runs along a 128-byte row, the
//    next 64 columns are in the next panel (LBO = panel bytes); keys 8 apart are 1024 bytes
//    apart (SBO).
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo_bytes,
                                              uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// Rows [0, ROWS) of a [rows][128] bf16 tile (row i at src + i * stride elements) into the
// swizzled panels at shared address dst, NT threads; rows >= valid_rows are zero-filled and not
// read. The caller commits the cp.async group.
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile_swz128(uint32_t dst, const __nv_bfloat16* src,
                                                 int64_t stride, int valid_rows) {
  constexpr int kChunks = 128 / 8;  // 16-byte chunks per row
  static_assert((ROWS * kChunks) % NT == 0, "chunks must divide over the threads");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / NT; ++i) {
    const int idx = i * NT + static_cast<int>(threadIdx.x);
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row < valid_rows;
    // An invalid row still needs a legal address operand; the callers' src (row 0 of a tile
    // that has at least one valid row) is in bounds.
    const __nv_bfloat16* g = valid ? src + row * stride + chunk * 8 : src;
    attn::cp_async_16(dst + swz128_offset(ROWS, row, chunk), g, valid);
  }
}

// K-major operand descriptor (A or B of a product whose K dimension is the tile's 128 columns)
// for rows row0.. (row0 a multiple of 8) and K step ks (columns 16ks..16ks+15) of a swizzled
// [rows][128] tile at shared address tile: panel ks / 4, +32 bytes per 16 columns inside it.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int rows, int row0, int ks) {
  return make_desc(tile + (ks >> 2) * (rows * 128) + row0 * 128 + (ks & 3) * 32, 16, 1024);
}
// N-major B operand descriptor (B[k][n] = tile[k][n], N = the 128 columns) of the 16 rows
// k0..k0+15 (k0 a multiple of 8) of a swizzled [rows][128] tile: the second 64 columns are the
// next panel (LBO = panel bytes), rows 8 apart are 1024 bytes apart (SBO).
__device__ __forceinline__ uint64_t desc_n_major(uint32_t tile, int rows, int k0) {
  return make_desc(tile + k0 * 128, rows * 128, 1024);
}

#if OPD_WGMMA_ENABLED

// Orders this thread's earlier register writes (accumulators, A fragments) before the
// wgmma.mma_async that follow; required whenever other instructions touched them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to the async proxy
// that wgmma reads through; each writing thread fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- ping-pong variant: mbarriers (producer/consumer pipeline) and named barriers ----------
// mbarriers: kernels/cuda/mbarrier.cuh (mbar_init / mbar_arrive / mbar_wait below forward to it).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) { mbar::init(bar, count); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) { mbar::arrive(bar); }
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) { mbar::wait(bar, parity); }
// The mbarrier receives one arrival (counted in its init count: .noinc) when every cp.async this
// thread issued so far has completed, without the thread waiting for them.
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Named barriers (bar.sync / bar.arrive id, count): `count` threads in all, the arriving ones do
// not wait. Id 0 is __syncthreads'. Warp-uniform operands, whole warps.
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Warp-specialized register split (setmaxnreg, sm_90a): every warp of the warpgroup executes
// it; .dec gives registers back to the SM's pool, .inc blocks until the pool has them. The
// launch allocates the same count to every warp, and registers are a per-SM-sub-partition
// budget (16,384 per quarter; warp w runs on quarter w % 4), so a 3-warpgroup CTA launched at
// 168 can move to 24 (producer) + 2 x 240 (consumers) per quarter: 504 x 32 <= 16,384.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Register "fence": the compiler must assume x changes here, so no read of an accumulator
// is moved above the wgmma_wait before it and no write below the next wgmma issue.
template <int N>
__device__ __forceinline__ void fence_regs(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
template <int N, int M>
__device__ __forceinline__ void fence_regs(uint32_t (&x)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
  }
}

// d[0..32) (+)= A(desc_a, 64 x 16) * B(desc_b, 16 x 64); scale_d = 0 overwrites d. Operands
// K-major by default; kTransA / kTransB = 1 (imm-trans-a / -b): MN-major (A stored [k][m],
// B stored [k][n], each described like desc_n_major's tiles), e.g. the backward's dQ = dS K
// with dS^T staged [keys][queries] (<1, 1>).
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
  static_assert((kTransA == 0 || kTransA == 1) && (kTransB == 0 || kTransB == 1), "0 or 1");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB)
      : "memory");
}

// d[0..64) (+)= A(desc_a, 64 x 16) * B(desc_b, 16 x 128); scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}

// d[0..64) += A(registers a, 64 x 16) * B(desc_b, 16 x 128), B N-major (imm-trans-b = 1).
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const uint32_t (&a)[4],
                                                     uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
      : "memory");
}

#endif  // OPD_WGMMA_ENABLED

}  // namespace opd::cuda::wg
