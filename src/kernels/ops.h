// The one dispatch header: every model op, on Tensors, routed by device and dtype to
// kernels/cpu/<op>.cpp (the readable reference, f32 and f64) or kernels/cuda/<op>.cu.
//
// Conventions (all ops):
// - Token layout is packed ("varlen"): a batch of B sequences of different lengths is T rows,
//   sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1]); there is no padding at all, so
//   nothing can attend to padding or send gradient into it. cu_seqlens is i32 [B+1], starts
//   at 0, is non-decreasing and ends at T (validated).
// - CUDA tensors (f32 or bf16 storage, f32 arithmetic): float inputs/outputs share one dtype,
//   except that statistics (rstd, lse, losses) and parameter gradients (dw, dtable, dbias) are
//   f32 (master gradients); linear_forward may write an f32 y from bf16 operands and
//   linear_backward accumulates dw in f32 or in the operands' dtype; rope's inv_freq is f32.
//   Ops are issued on cuda::current_stream() (core/cuda/allocator.h). Index inputs are checked
//   on the device before the op's kernels run (one small read-back), so nothing is written
//   when they are rejected, as on the CPU.
// - Activation gradients are written (=); parameter gradients are accumulated (+=), so
//   micro-batches add into the same gradient buffers.
// - Inputs must be contiguous tensors of matching dtype (f32 or f64 on the CPU); shapes are
//   validated and a mismatch throws InvalidArgument naming the op and the shapes.
// - Index inputs (token ids, targets, positions) come from data: ops check them and throw
//   InvalidData naming row, value and limit (CUDA kernels report through an error flag).
#pragma once

#include "core/tensor.h"

namespace opd::ops {

// out[t, :] = table[ids[t], :].  ids i32 [T] in [0, V); table [V, H]; out [T, H].
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
// dtable[ids[t], :] += dout[t, :], in row order (deterministic, no atomics).
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

// RMSNorm over the last dim H of x [N, H]: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
// rstd [N] (f32 for f32 inputs) is saved for the backward. Used per head for q/k norm too.
void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
// dx = rstd * (w*dy - x * rstd^2 * mean(x * w * dy)) (written); dw += sum_rows dy * x * rstd.
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw);

// RMSNorm fused with the residual add before it (pre-norm blocks): sum = x + r (written: the
// residual stream continues from it), y = rmsnorm(sum) * w, rstd as in rmsnorm_forward. On
// CUDA in bf16 the sum is rounded to bf16 before the norm, so the norm sees the stored sum.
void rmsnorm_residual_forward(const Tensor& x, const Tensor& r, const Tensor& w, double eps,
                              Tensor& sum, Tensor& y, Tensor& rstd);
// ds = rmsnorm_dx(dy; sum) + dres (written): the gradient of the residual stream at sum, which
// both x and r receive; dres is the gradient arriving through the residual path and may be
// the same tensor as ds (in place). dw += sum_rows dy * sum * rstd.
void rmsnorm_residual_backward(const Tensor& dy, const Tensor& sum, const Tensor& w,
                               const Tensor& rstd, const Tensor& dres, Tensor& ds, Tensor& dw);

// Rotary embedding in place on x [T, heads, head_dim], Hugging Face "rotate_half" layout:
// for i < d/2 with angle = positions[t] * inv_freq[i]:
//   x[i]' = x[i] cos - x[i+d/2] sin,  x[i+d/2]' = x[i+d/2] cos + x[i] sin.
// positions i32 [T] (>= 0); inv_freq f32 [head_dim/2] (model/ computes it, incl. llama3 scaling).
void rope_forward(Tensor& x, const Tensor& positions, const Tensor& inv_freq);
// The transpose of the rotation (rotation by -angle), in place on dx.
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& inv_freq);

// Causal grouped-query attention per sequence. q [T, Hq, D], k/v [T, Hkv, D], Hq % Hkv == 0
// (query head h reads kv head h / (Hq/Hkv)). Row t of sequence b attends to rows
// cu_seqlens[b] .. t. out [T, Hq, D]; lse f32 [T, Hq] = log-sum-exp of the scaled scores
// (saved for the backward, as flash-attention does).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                       double scale, Tensor& out, Tensor& lse);
// dq, dk, dv written. Uses out and lse from the forward: P = exp(S - lse),
// dP = dout v^T, dS = P * (dP - rowsum(dout * out)).
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                        double scale, Tensor& dq, Tensor& dk, Tensor& dv);

// SwiGLU: out = silu(gate) * up, gate/up/out [N, I]; silu(g) = g * sigmoid(g).
void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup);

// y [N, out] = x [N, in] @ w[out, in]^T (+ bias [out] when bias is defined). GEMM through
// OpenBLAS on the CPU, cuBLASLt on CUDA.
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y);
// dx = dy @ w (written; skipped when dx is undefined); dw += dy^T @ x;
// dbias += sum_rows dy (when dbias is defined).
void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dx, Tensor& dw,
                     Tensor& dbias);

// Cross-entropy per row of logits [N, V] against targets i32 [N]; target -100 = ignored
// (loss 0, no gradient); other targets must be in [0, V). losses [N] and lse [N] written.
// Returns the number of non-ignored rows.
int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                              Tensor& lse);
// dlogits = scale * (softmax(logits) - onehot(target)) for valid rows, 0 for ignored rows.
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            double scale, Tensor& dlogits);

// ---- Paged KV cache (generation; see docs/rollout.md) ----
// One layer's cache is k_cache / v_cache [num_blocks, block_size, Hkv, D]: a pool of fixed-size
// blocks, slot s of block b holding the key (value) of one token. A sequence's token at
// position p lives at slot (block_table[p / block_size], p % block_size); blocks are handed out
// by model/kv_cache.h, so sequences never need contiguous memory and can share blocks.

// Scatter new keys/values into the cache: k_cache[slot / bs, slot % bs] = k[t] with
// slot = slot_mapping[t], and the same for v. k, v [T, Hkv, D]; slot_mapping i32 [T], every
// entry in [0, num_blocks * block_size) (validated: InvalidData naming row, value and limit).
void kv_cache_store(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, Tensor& k_cache,
                    Tensor& v_cache);

// Causal GQA attention of new query rows against a paged cache (prefill chunks and decode).
// q [T, Hq, D] packed by cu_seqlens_q [B+1]; sequence b has seq_lens[b] tokens in the cache,
// its own new rows included (stored first with kv_cache_store), and its q_len_b =
// cu_seqlens_q[b+1] - cu_seqlens_q[b] query rows are its last q_len_b positions: row
// cu_seqlens_q[b] + i is position p = seq_lens[b] - q_len_b + i and attends to positions 0..p:
//   out = softmax(scale * q K[0..p]^T) V[0..p].
// block_tables i32 [B, max_blocks]: row b lists the blocks of sequence b; only the first
// ceil(seq_lens[b] / block_size) entries are read (each checked to be in [0, num_blocks)).
// Decode is q_len_b = 1. Equals the rows of attention_forward over the whole sequences.
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                     const Tensor& block_tables, double scale, Tensor& out);

// Row gather: out[i, :] = rows[i] == -1 ? 0 : in[rows[i], :]. in [N_in, H], out [N_out, H],
// rows i32 [N_out] with entries in [-1, N_in) (validated: InvalidData naming row, value and
// limit). The model picks a packed batch's loss rows with it, and scatters their gradient back
// through the inverse map. On CUDA in and out may differ in dtype (f32 <-> bf16, rounded to
// nearest even); on the CPU they share one.
void gather_rows(const Tensor& in, const Tensor& rows, Tensor& out);
// out = in converted to out's dtype, same shape (CUDA: f32 <-> bf16; CPU: f32 <-> f64).
void convert(const Tensor& in, Tensor& out);

// Elementwise helpers: out = a + b; acc += x.
void add(const Tensor& a, const Tensor& b, Tensor& out);
void add_inplace(Tensor& acc, const Tensor& x);

}  // namespace opd::ops
