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

// y[m * ldy + n] for the R (<= MB) rows of x and the C (<= NB) rows of w, both K long. PIN:
// the weights are in cache (see below).
template <int R, int C, bool PIN = false>
inline void block(const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                  const float* bias) {
#if KVK_AVX2
  __m256 acc[R][C];
  KVK_UNROLL
  for (int r = 0; r < R; ++r)
    KVK_UNROLL
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  // R x rows in registers, then one weight vector at a time meets them: R + 1 registers beside
  // the accumulators (16 for 3 x 4), R + C loads per R x C FMAs. With PIN, each loaded vector
  // is pinned to a register (simd.h's pin), else GCC folds it into R FMAs' memory operands;
  // a block's first row block, reading from memory, keeps the folded loads (faster there).
  // The same FMAs either way: the same bits. Why and what it bought: docs/design/kernels.md.
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[R];
    KVK_UNROLL
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm256_loadu_ps(x + r * K + k);
      if constexpr (PIN) pin(xv[r]);
    }
    KVK_UNROLL
    for (int c = 0; c < C; ++c) {
      __m256 wv = _mm256_loadu_ps(w + c * K + k);
      if constexpr (PIN) pin(wv);
      KVK_UNROLL
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  KVK_UNROLL
  for (int r = 0; r < R; ++r)
    KVK_UNROLL
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum8(acc[r][c]) + (bias ? bias[c] : 0.0f);
#else
  KVK_UNROLL
  for (int r = 0; r < R; ++r)
    KVK_UNROLL
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

template <int R, bool PIN = false>
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
    case 4: block<R, 4, PIN>(x, K, w, y, ldy, bias); break;
    case 3: block<R, 3, PIN>(x, K, w, y, ldy, bias); break;
    case 2: block<R, 2, PIN>(x, K, w, y, ldy, bias); break;
    default: block<R, 1, PIN>(x, K, w, y, ldy, bias); break;
  }
}

// an r x c block (r <= MB, c <= NB1 when r == 1, else c <= NB); cached: the c rows of w were
// read by a block just before (pinned loads, block's PIN, for 2 and 3 rows)
inline void run_block(int64_t r, int64_t c, const float* x, int64_t K, const float* w, float* y,
                      int64_t ldy, const float* bias, bool cached = false) {
  switch (r) {
    case 3:
      if (cached) run_cols<3, true>(c, x, K, w, y, ldy, bias);
      else run_cols<3>(c, x, K, w, y, ldy, bias);
      break;
    case 2:
      if (cached) run_cols<2, true>(c, x, K, w, y, ldy, bias);
      else run_cols<2>(c, x, K, w, y, ldy, bias);
      break;
    default: run_cols<1>(c, x, K, w, y, ldy, bias); break;
  }
}

}  // namespace kvk
