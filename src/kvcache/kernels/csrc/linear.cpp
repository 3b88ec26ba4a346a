// A linear layer for decode-sized inputs: y [M, N] = x [M, K] @ w [N, K]^T (+ bias), few rows.
//
// Decode steps multiply a handful of rows (one per sequence) by every weight matrix, and the
// BLAS behind torch handles that shape poorly here (AVX2, no AMX): a 16-row pass over an
// 80-113 MB LM head reads the weights at a fraction of the memory bandwidth. This kernel reads
// each weight row once per step: an item is a block of NB weight rows; for every block of MB
// input rows it keeps MB x NB vector accumulators over K (NB + MB loads per MB x NB FMAs),
// then sums each accumulator's lanes. Every output is the same sum in the same order
// whatever M, the row's place in the batch or the thread count: a row's result does not
// depend on the rows decoded beside it.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "simd.h"

namespace kvk {

namespace {

constexpr int NB = 4;   // weight rows per block (MB x NB = 12 accumulators of 16 registers)
constexpr int NB1 = 8;  // weight rows per block when x is one row (more loads in flight)
constexpr int MB = 3;   // input rows per block

// y[m * ldy + n] for the R (<= MB) rows of x and the C (<= NB) rows of w, both K long
template <int R, int C>
inline void block(const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                  const float* bias) {
#if KVK_AVX2
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum8(acc[r][c]) + (bias ? bias[c] : 0.0f);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lane sums, then their sum
      for (int64_t k = 0; k < K; k += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += x[r * K + k + l] * w[c * K + k + l];
      float s = 0.0f;
      for (int l = 0; l < 8; ++l) s += lanes[l];
      y[r * ldy + c] = s + (bias ? bias[c] : 0.0f);
    }
#endif
}

template <int R>
inline void run_cols(int64_t c, const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                     const float* bias) {
  switch (c) {
    case 8: block<R, 8>(x, K, w, y, ldy, bias); break;
    case 7: block<R, 7>(x, K, w, y, ldy, bias); break;
    case 6: block<R, 6>(x, K, w, y, ldy, bias); break;
    case 5: block<R, 5>(x, K, w, y, ldy, bias); break;
    case 4: block<R, 4>(x, K, w, y, ldy, bias); break;
    case 3: block<R, 3>(x, K, w, y, ldy, bias); break;
    case 2: block<R, 2>(x, K, w, y, ldy, bias); break;
    default: block<R, 1>(x, K, w, y, ldy, bias); break;
  }
}

// an r x c block (r <= MB, c <= NB1 when r == 1, else c <= NB)
inline void run_block(int64_t r, int64_t c, const float* x, int64_t K, const float* w, float* y,
                      int64_t ldy, const float* bias) {
  switch (r) {
    case 3: run_cols<3>(c, x, K, w, y, ldy, bias); break;
    case 2: run_cols<2>(c, x, K, w, y, ldy, bias); break;
    default: run_cols<1>(c, x, K, w, y, ldy, bias); break;
  }
}

}  // namespace

// x [M, K] float32, w [N, K] float32 (both contiguous), bias [N] or empty -> [M, N]
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "kvcache linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "kvcache linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "kvcache linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "kvcache linear: K must be a multiple of 8");
  const bool has_bias = bias.numel() > 0;
  if (has_bias)
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N,
                "kvcache linear: bias [N] float32");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t nb = M == 1 ? NB1 : NB, blocks = (N + nb - 1) / nb;
  // ~64 KB of weights per grain: enough work per task, many tasks for the threads
  const int64_t grain = std::max<int64_t>(1, 16384 / (nb * K));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {  // nb weight rows, every input row block over them
      const int64_t n = b * nb, c = std::min<int64_t>(nb, N - n);
      for (int64_t m = 0; m < M; m += MB)
        run_block(std::min<int64_t>(MB, M - m), c, xp + m * K, K, wp + n * K, yp + m * N + n, N,
                  bp ? bp + n : nullptr);
    }
  });
  return y;
}

}  // namespace kvk
