// The math of one tile, shared by every codec: scores of NR query rows against a tile of key
// rows, and the probability-weighted sum of value rows into NR accumulators. Rows are given as
// pointers (into storage for fp32, into a decoded tile otherwise); D is a multiple of 16.
// Register blocking: NR query rows x NC cells of accumulators per pass over D (AVX2 builds).
#pragma once

#include "simd.h"

namespace kvk {

constexpr int BLK = 64;  // cells per tile

#if KVK_AVX2
inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <int NR, int NC>
inline void qk_cells(const float* q, const float* const* k, int j, int D, float* sc) {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    __m256 kv[NC];
    for (int i = 0; i < NC; ++i) kv[i] = _mm256_loadu_ps(k[j + i] + c);
    for (int r = 0; r < NR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + c);
      for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) sc[r * BLK + j + i] = hsum8(acc[r][i]);
}
#endif

// sc[r * BLK + j] = <q[r], k[j]> for r < NR, j in [ja, jb)
template <int NR>
inline void qk_tile(const float* q, const float* const* k, int ja, int jb, int D, float* sc) {
  int j = ja;
#if KVK_AVX2
  constexpr int NC = NR == 1 ? 4 : (NR == 2 ? 3 : 2);
  for (; j + NC <= jb; j += NC) qk_cells<NR, NC>(q, k, j, D, sc);
  for (; j < jb; ++j) qk_cells<NR, 1>(q, k, j, D, sc);
#else
  for (; j < jb; ++j)
    for (int r = 0; r < NR; ++r) sc[r * BLK + j] = dot(q + r * D, k[j], D);
#endif
}

// acc[r] += sum_j p[r * BLK + j] * v[j] for r < NR, j in [ja, jb)
template <int NR>
inline void pv_tile(const float* p, const float* const* v, int ja, int jb, int D, float* acc) {
#if KVK_AVX2
  for (int c = 0; c < D; c += 16) {
    __m256 a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm256_loadu_ps(acc + r * D + c);
      a[r][1] = _mm256_loadu_ps(acc + r * D + c + 8);
    }
    for (int j = ja; j < jb; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v[j] + c), v1 = _mm256_loadu_ps(v[j] + c + 8);
      for (int r = 0; r < NR; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + r * BLK + j);
        a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(acc + r * D + c, a[r][0]);
      _mm256_storeu_ps(acc + r * D + c + 8, a[r][1]);
    }
  }
#else
  for (int j = ja; j < jb; ++j)
    for (int r = 0; r < NR; ++r) axpy(p[r * BLK + j], v[j], acc + r * D, D);
#endif
}

// The same for any number of rows: blocks of up to 4.
inline void qk_rows(const float* q, int rows, const float* const* k, int ja, int jb, int D,
                    float* sc) {
  for (int r = 0; r < rows; r += 4) {
    const float* qr = q + r * D;
    float* s = sc + r * BLK;
    switch (rows - r < 4 ? rows - r : 4) {
      case 1: qk_tile<1>(qr, k, ja, jb, D, s); break;
      case 2: qk_tile<2>(qr, k, ja, jb, D, s); break;
      case 3: qk_tile<3>(qr, k, ja, jb, D, s); break;
      default: qk_tile<4>(qr, k, ja, jb, D, s); break;
    }
  }
}

inline void pv_rows(const float* p, int rows, const float* const* v, int ja, int jb, int D,
                    float* acc) {
  for (int r = 0; r < rows; r += 4) {
    const float* pr = p + r * BLK;
    float* a = acc + r * D;
    switch (rows - r < 4 ? rows - r : 4) {
      case 1: pv_tile<1>(pr, v, ja, jb, D, a); break;
      case 2: pv_tile<2>(pr, v, ja, jb, D, a); break;
      case 3: pv_tile<3>(pr, v, ja, jb, D, a); break;
      default: pv_tile<4>(pr, v, ja, jb, D, a); break;
    }
  }
}

}  // namespace kvk
