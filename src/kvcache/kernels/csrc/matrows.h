// Blocks of dot products between a few rows of x [M, K] and rows of w [N, K]: y = x w^T.
// An r x c block keeps r x c vector accumulators over K (c + r loads per r x c FMAs), then
// sums each accumulator's lanes, so every output is the same sum in the same order whatever
// block it was computed in. Used by the linear layers (linear.cpp) and the scores of dense
// attention (dense.cpp). K is a multiple of 8.
#pragma once

#include <cstdint>

#include "simd.h"

namespace kvk {

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
  if constexpr (R == 1) {  // only a single row takes blocks wider than NB
    switch (c) {
      case 8: return block<1, 8>(x, K, w, y, ldy, bias);
      case 7: return block<1, 7>(x, K, w, y, ldy, bias);
      case 6: return block<1, 6>(x, K, w, y, ldy, bias);
      case 5: return block<1, 5>(x, K, w, y, ldy, bias);
      default: break;
    }
  }
  switch (c) {
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

}  // namespace kvk
