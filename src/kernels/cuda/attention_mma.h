// Device helpers shared by the FlashAttention-2 kernels (Dao 2023, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning"): cp.async tile loads into an
// XOR-swizzled shared-memory layout, ldmatrix fragment loads and the sm_80-style
// mma.sync.m16n8k16 bf16 tensor-core instruction (inline PTX). Included only by
// attention_fwd.cu and attention_bwd.cu (CUDA C++17).
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// lane = threadIdx.x % 32, r = lane / 4, c = (lane % 4) * 2:
//   A (16x16, row-major) 4 x b32: a0 = A[r][c..c+1], a1 = A[r+8][c..c+1],
//                                 a2 = A[r][c+8..c+9], a3 = A[r+8][c+8..c+9]
//   B (16x8, "col")      2 x b32: b0 = B[c..c+1][r], b1 = B[c+8..c+9][r]
//   C (16x8, f32)        4 x f32: c0,c1 = C[r][c..c+1], c2,c3 = C[r+8][c..c+1]
// Two adjacent C tiles (columns 16j..16j+15) repacked to bf16 are exactly one A fragment
// whose k range is those 16 columns: that is how P (and dS) go from one mma's output into
// the next mma's input without shared memory (FlashAttention-2, section 3.1).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace opd::cuda::attn {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; when !valid, the 16 bytes are zero-filled
// and nothing is read (src-size 0), which is how rows past the end of a sequence become 0.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one b32 holding two bf16; `lo` (the smaller column) in the low half, as the
// fragment layouts above require.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Shared-memory tiles are [rows][D] bf16, D in {64, 128}, stored in 16-byte chunks (8 bf16)
// with chunk index XOR (row % 8). ldmatrix reads 8 rows at one logical chunk; unswizzled, a
// row pitch of 128 or 256 bytes would put all 8 in the same 4 banks (8-way conflict). The XOR
// spreads them over 8 distinct chunks = all 32 banks. cp.async writes and the epilogue's
// 4-byte stores use the same map, so they are conflict-free too.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// Loads rows [0, ROWS) of a [rows][D] tile whose row i is at src + i * stride (elements) into
// the swizzled tile `dst`; rows >= valid_rows are zero-filled (never read). NT threads.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                          int64_t stride, int valid_rows) {
  constexpr int kChunks = D / 8;
  static_assert((ROWS * kChunks) % NT == 0, "tile chunks must divide evenly over the threads");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / NT; ++i) {
    const int idx = i * NT + static_cast<int>(threadIdx.x);
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row < valid_rows;
    // An invalid row still needs a legal address operand; src itself is always in bounds.
    const __nv_bfloat16* g = valid ? src + row * stride + chunk * 8 : src;
    cp_async_16(smem_addr(dst + swz<D>(row, chunk)), g, valid);
  }
}

// ldmatrix address of lane `lane` for an A fragment (rows row0..row0+15, k columns
// 16*kk..16*kk+15) of a row-major [row][D] tile: matrices 0..3 = (rows 0-7, k 0-7),
// (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) -> a0..a3.
template <int D>
__device__ __forceinline__ uint32_t a_frag_addr(const __nv_bfloat16* tile, int row0, int kk,
                                                int lane) {
  const int row = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int chunk = kk * 2 + (lane >> 4);
  return smem_addr(tile + swz<D>(row, chunk));
}

// ldmatrix (non-transposed) address for the B fragments of two adjacent n8 tiles when B[k][n]
// = tile[n][k], i.e. the tile is stored with n as its row (K in S = Q K^T): matrices 0..3 =
// (n 0-7, k 0-7) -> b0 of n-tile 0, (n 0-7, k 8-15) -> b1 of n-tile 0, (n 8-15, k 0-7) -> b0
// of n-tile 1, (n 8-15, k 8-15) -> b1 of n-tile 1.
template <int D>
__device__ __forceinline__ uint32_t b_frag_addr_nk(const __nv_bfloat16* tile, int n0, int kk,
                                                   int lane) {
  const int row = n0 + (lane & 7) + (lane >> 4) * 8;
  const int chunk = kk * 2 + ((lane >> 3) & 1);
  return smem_addr(tile + swz<D>(row, chunk));
}

// ldmatrix.trans address for the B fragments of two adjacent n8 tiles (columns 16*dn..) when
// B[k][n] = tile[k][n], i.e. the tile is stored with k as its row (V in O = P V): rows k0..k0+15;
// matrices 0..3 = (k 0-7, n 0-7) -> b0 of n-tile 0, (k 8-15, n 0-7) -> b1 of n-tile 0,
// (k 0-7, n 8-15) -> b0 of n-tile 1, (k 8-15, n 8-15) -> b1 of n-tile 1.
template <int D>
__device__ __forceinline__ uint32_t b_frag_addr_kn(const __nv_bfloat16* tile, int k0, int dn,
                                                   int lane) {
  const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int chunk = dn * 2 + (lane >> 4);
  return smem_addr(tile + swz<D>(row, chunk));
}

// ---- helpers of the simple (f32 / any head_dim) kernels ----
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store_val(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_val(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The sequence holding packed row t: the largest b with cu[b] <= t (an empty sequence shares
// its start with the next one, which is the one that owns the row).
__device__ __forceinline__ int find_sequence(const int32_t* cu, int batch, int64_t t) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One work tile of a plan: `block` of 128 rows of the sequence whose rows are
// [start, start + len) in the packed batch.
struct Tile {
  int start, len, block, unused;
};

}  // namespace opd::cuda::attn
