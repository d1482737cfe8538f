// The CPU reference kernels behind kernels/ops.h: plain loops over raw host pointers, templated
// on the element type T (float and double are instantiated). Shapes and dtypes were validated
// by the Tensor-level dispatcher (ops.cpp); index inputs (ids, targets, positions, cu_seqlens)
// come from data and are validated here, before anything is written, because these kernels
// are the ones that index with them. Formulas are stated once, in kernels/ops.h.
#pragma once

#include <cstdint>

namespace opd::cpu {

// ---- embedding.cpp ----
// Throws InvalidData "<op>: token id <v> at row <t> is outside the vocabulary [0, V)".
void check_token_ids(const char* op, const int32_t* ids, int64_t n, int64_t vocab);
template <typename T>
void embedding_forward(const int32_t* ids, const T* table, int64_t n, int64_t vocab,
                       int64_t hidden, T* out);
template <typename T>
void embedding_backward(const int32_t* ids, const T* dout, int64_t n, int64_t vocab,
                        int64_t hidden, T* dtable);

// ---- rows.cpp ----  in [n_in, h], out [n_out, h]; rows [n_out] in [-1, n_in) (-1: zero row).
// Throws InvalidData "<op>: source row <r> at row <i> is outside [-1, n_in)".
void check_rows(const char* op, const int32_t* rows, int64_t n_out, int64_t n_in);
template <typename T>
void gather_rows(const T* in, int64_t n_in, const int32_t* rows, int64_t n_out, int64_t h,
                 T* out);

// ---- rmsnorm.cpp ----  x, y [n, h]; w, dw [h]; rstd [n].
template <typename T>
void rmsnorm_forward(const T* x, const T* w, double eps, int64_t n, int64_t h, T* y, T* rstd);
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t h,
                      T* dx, T* dw);

// ---- rmsnorm_residual.cpp ----  x, r, sum, y, dy, dres, ds [n, h]; ds may alias dres.
template <typename T>
void rmsnorm_residual_forward(const T* x, const T* r, const T* w, double eps, int64_t n,
                              int64_t h, T* sum, T* y, T* rstd);
template <typename T>
void rmsnorm_residual_backward(const T* dy, const T* sum, const T* w, const T* rstd,
                               const T* dres, int64_t n, int64_t h, T* ds, T* dw);

// ---- rope.cpp ----  x [n, heads, head_dim] in place; inv_freq [head_dim / 2] as double so
// the angle positions[t] * inv_freq[i] is formed in double whatever the caller's dtype.
void check_positions(const char* op, const int32_t* positions, int64_t n);
template <typename T>
void rope_forward(T* x, const int32_t* positions, const double* inv_freq, int64_t n,
                  int64_t heads, int64_t head_dim);
template <typename T>
void rope_backward(T* dx, const int32_t* positions, const double* inv_freq, int64_t n,
                   int64_t heads, int64_t head_dim);

// ---- attention.cpp ----  q/out/dq [n, hq, d]; k, v, dk, dv [n, hkv, d]; lse [n, hq];
// cu_seqlens [batch + 1].
// Throws InvalidData naming the entry index, its value and the bound it breaks.
void check_cu_seqlens(const char* op, const int32_t* cu_seqlens, int64_t batch, int64_t n);
template <typename T>
void attention_forward(const T* q, const T* k, const T* v, const int32_t* cu_seqlens,
                       int64_t batch, int64_t n, int64_t hq, int64_t hkv, int64_t d, double scale,
                       T* out, T* lse);
template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const int32_t* cu_seqlens, int64_t batch, int64_t n,
                        int64_t hq, int64_t hkv, int64_t d, double scale, T* dq, T* dk, T* dv);

// ---- attention_context.cpp ----  query rows over cached context: q/out [n_q, hq, d],
// k, v [n_k, hkv, d], lse [n_q, hq]; sequence b's queries cu_q[b] .. cu_q[b+1] are the last
// rows of its keys cu_k[b] .. cu_k[b+1] (query i sees keys 0 .. len_k - len_q + i).
// check_cu_seqlens_context: both cu_seqlens valid and len_k >= len_q (InvalidData otherwise).
void check_cu_seqlens_context(const char* op, const int32_t* cu_q, const int32_t* cu_k,
                              int64_t batch, int64_t n_q, int64_t n_k);
template <typename T>
void attention_forward_context(const T* q, const T* k, const T* v, const int32_t* cu_q,
                               const int32_t* cu_k, int64_t batch, int64_t n_q, int64_t n_k,
                               int64_t hq, int64_t hkv, int64_t d, double scale, T* out, T* lse);

// ---- paged_attention.cpp ----  k, v [n, hkv, d]; caches [num_blocks, bs, hkv, d];
// q, out [n, hq, d]; cu_seqlens_q [batch + 1]; seq_lens [batch]; block_tables [batch, max_blocks].
template <typename T>
void kv_cache_store(const T* k, const T* v, const int32_t* slot_mapping, int64_t n,
                    int64_t num_blocks, int64_t block_size, int64_t hkv, int64_t d, T* k_cache,
                    T* v_cache);
// The index checks of paged_attention (cu_seqlens_q, seq_lens vs q rows and block table
// capacity, the block ids a sequence uses), shared with the CUDA dispatch for its messages.
void check_paged_indices(const int32_t* cu_seqlens_q, const int32_t* seq_lens,
                         const int32_t* block_tables, int64_t batch, int64_t n,
                         int64_t num_blocks, int64_t block_size, int64_t max_blocks);
template <typename T>
void paged_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* cu_seqlens_q,
                     const int32_t* seq_lens, const int32_t* block_tables, int64_t batch,
                     int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t num_blocks,
                     int64_t block_size, int64_t max_blocks, double scale, T* out);

// ---- swiglu.cpp ----  all [n] (elementwise).
template <typename T>
void swiglu_forward(const T* gate, const T* up, int64_t n, T* out);
template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, int64_t n, T* dgate, T* dup);

// ---- linear.cpp ----  x [n, in]; w [out, in]; bias [out] or nullptr; y [n, out].
template <typename T>
void linear_forward(const T* x, const T* w, const T* bias, int64_t n, int64_t in, int64_t out,
                    T* y);
// dx may be nullptr (skipped); dbias may be nullptr (skipped); dw is accumulated.
template <typename T>
void linear_backward(const T* dy, const T* x, const T* w, int64_t n, int64_t in, int64_t out,
                     T* dx, T* dw, T* dbias);

// ---- cross_entropy.cpp ----  logits, dlogits [n, vocab]; targets, losses, lse [n].
inline constexpr int32_t kIgnoreIndex = -100;
// Throws InvalidData "<op>: target <v> at row <t> is outside the vocabulary [0, V) ...".
void check_targets(const char* op, const int32_t* targets, int64_t n, int64_t vocab);
template <typename T>
int64_t cross_entropy_forward(const T* logits, const int32_t* targets, int64_t n, int64_t vocab,
                              T* losses, T* lse);
template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse, int64_t n,
                            int64_t vocab, double scale, T* dlogits);

// ---- elementwise.cpp ----  all [n].
template <typename T>
void add(const T* a, const T* b, int64_t n, T* out);
template <typename T>
void add_inplace(T* acc, const T* x, int64_t n);

}  // namespace opd::cpu
