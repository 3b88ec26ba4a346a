// The math of one tile, shared by every codec: scores of NR query rows against a tile of key
// rows, and the probability-weighted sum of value rows into NR accumulators. Rows are given as
// pointers (into storage for fp32, into a decoded tile, or straight into int8 codes whose
// row scales the caller applies to scores and weights); D is a multiple of 16.
// Register blocking: NR query rows x NC cells of accumulators per pass over D (AVX2 builds).
#pragma once

#include "simd.h"

namespace kvk {

constexpr int BLK = 64;  // cells per tile

// Cache lines to fetch while the tile math runs (the next tile's code rows: its keys', then
// its values'): the math's inner loops call step(), two lines at a time, so that the misses
// overlap the arithmetic instead of waiting in a pass of their own (touch()); finish() asks
// for what the math did not reach.
struct LineStream {
  const char* const* rows = nullptr;  // row starts
  int split = 0, n = 0;               // rows [0, split) are key rows, [split, n) value rows
  int64_t kbytes = 0, vbytes = 0;     // bytes of a key row, of a value row
  int i = 0;
  int64_t off = 0;
  void reset(const char* const* r, int keys, int64_t key_bytes, int count, int64_t value_bytes) {
    rows = r, split = keys, n = count, kbytes = key_bytes, vbytes = value_bytes, i = 0, off = 0;
  }
  void step() {
#if KVK_AVX2
    for (int t = 0; t < 2 && i < n; ++t) {
      _mm_prefetch(rows[i] + off, _MM_HINT_T1);  // into L2: the tile math reads it from there
      off += 64;
      if (off >= (i < split ? kbytes : vbytes)) off = 0, ++i;
    }
#endif
  }
  void finish() {
#if KVK_AVX2
    while (i < n) step();
#endif
  }
};

// Row kinds the tile math reads: 8 channels from c of a row as floats, in registers.
struct FloatRows {  // float32 rows (storage or a decoded tile)
  using T = float;
#if KVK_AVX2
  static __m256 load8(const T* row, int c) { return _mm256_loadu_ps(row + c); }
#endif
  static float at(const T* row, int c) { return row[c]; }
};
struct Int8Rows {  // int8 codes, used as they are: the caller applies each row's scale
  using T = int8_t;
#if KVK_AVX2
  static __m256 load8(const T* row, int c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + c))));
  }
#endif
  static float at(const T* row, int c) { return (float)row[c]; }
};

struct HalfRows {  // fp16 rows (fp16 storage or a recent window), converted as loaded
  using T = uint16_t;
#if KVK_AVX2
  static __m256 load8(const T* row, int c) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + c)));
  }
#endif
  static float at(const T* row, int c) { return half_to_float(row[c]); }
};

#if KVK_AVX2
template <int NR, int NC, typename R>
inline void qk_cells(const float* q, const typename R::T* const* k, int j, int D, int c0, int c1,
                     float* sc) {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int c = c0; c < c1; c += 8) {
    __m256 kv[NC];
    for (int i = 0; i < NC; ++i) kv[i] = R::load8(k[j + i], c);
    for (int r = 0; r < NR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + c);
      for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) sc[r * BLK + j + i] = hsum8(acc[r][i]);
}

// Scores of NR <= 3 rows against 4 cells: the query rows stay in registers, each key row is
// loaded once, and each row's 4 sums are reduced together (3 hadds, not 4 horizontal sums).
template <int NR, typename R>
inline void qk_cells4(const float* q, const typename R::T* const* k, int j, int D, int c0, int c1,
                      float* sc, LineStream* ls) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int c = c0; c < c1; c += 8) {
    if (ls != nullptr) ls->step();
    __m256 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q + r * D + c);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = R::load8(k[j + i], c);
      for (int r = 0; r < NR; ++r) acc[r][i] = _mm256_fmadd_ps(qv[r], kv, acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                    _mm256_hadd_ps(acc[r][2], acc[r][3]));
    _mm_storeu_ps(sc + r * BLK + j,
                  _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
}
#endif

// sc[r * BLK + j] = <q[r], k[j]> over channels [c0, c1) for r < NR, j in [ja, jb)
template <int NR, typename R>
inline void qk_tile(const float* q, const typename R::T* const* k, int ja, int jb, int D,
                    int c0, int c1, float* sc, LineStream* ls) {
  int j = ja;
#if KVK_AVX2
  if constexpr (NR <= 3) {
    for (; j + 4 <= jb; j += 4) qk_cells4<NR, R>(q, k, j, D, c0, c1, sc, ls);
  } else {
    for (; j + 2 <= jb; j += 2) qk_cells<NR, 2, R>(q, k, j, D, c0, c1, sc);
  }
  for (; j < jb; ++j) qk_cells<NR, 1, R>(q, k, j, D, c0, c1, sc);
#else
  (void)ls;
  for (; j < jb; ++j)
    for (int r = 0; r < NR; ++r) {
      float s = 0.f;
      for (int c = c0; c < c1; ++c) s += q[r * D + c] * R::at(k[j], c);
      sc[r * BLK + j] = s;
    }
#endif
}

#if KVK_AVX2
// acc[r][c0 : c0 + 8 * NV] += sum_j p[r * BLK + j] * v[j][c0 : ...]: NR x NV accumulators, so
// that enough independent FMA chains are in flight (one chain per accumulator and cell)
template <int NR, int NV, typename R>
inline void pv_cols(const float* p, const typename R::T* const* v, int ja, int jb, int D, int c0,
                    float* acc, LineStream* ls) {
  __m256 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < NV; ++x) a[r][x] = _mm256_loadu_ps(acc + r * D + c0 + 8 * x);
  for (int j = ja; j < jb; ++j) {
    if (ls != nullptr) ls->step();
    __m256 pr[NR];
    for (int r = 0; r < NR; ++r) pr[r] = _mm256_broadcast_ss(p + r * BLK + j);
    for (int x = 0; x < NV; ++x) {
      const __m256 vx = R::load8(v[j], c0 + 8 * x);
      for (int r = 0; r < NR; ++r) a[r][x] = _mm256_fmadd_ps(pr[r], vx, a[r][x]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < NV; ++x) _mm256_storeu_ps(acc + r * D + c0 + 8 * x, a[r][x]);
}
#endif

// acc[r][c0:c1] += sum_j p[r * BLK + j] * v[j][c0:c1] for r < NR, j in [ja, jb)
// (c0, c1 multiples of 16)
template <int NR, typename R>
inline void pv_tile(const float* p, const typename R::T* const* v, int ja, int jb, int D,
                    int c0, int c1, float* acc, LineStream* ls) {
#if KVK_AVX2
  // 12 (8) accumulators: 16 registers with the rest (a row kind that kept constants in
  // registers spilled 12 to the stack: the store-reload chain cost ~15 % of a call)
  constexpr int NV = NR <= 3 ? 4 : 2;
  int c = c0;
  for (; c + 8 * NV <= c1; c += 8 * NV) pv_cols<NR, NV, R>(p, v, ja, jb, D, c, acc, ls);
  for (; c < c1; c += 16) pv_cols<NR, 2, R>(p, v, ja, jb, D, c, acc, ls);
#else
  (void)ls;
  for (int j = ja; j < jb; ++j)
    for (int r = 0; r < NR; ++r)
      for (int c = c0; c < c1; ++c) acc[r * D + c] += p[r * BLK + j] * R::at(v[j], c);
#endif
}

// The same for any number of rows: blocks of up to 4. Channels [c0, c1) (the whole row unless
// given; multiples of 8).
template <typename R = FloatRows>
inline void qk_rows(const float* q, int rows, const typename R::T* const* k, int ja, int jb,
                    int D, float* sc, int c0 = 0, int c1 = -1, LineStream* ls = nullptr) {
  if (c1 < 0) c1 = D;
  for (int r = 0; r < rows; r += 4) {
    const float* qr = q + r * D;
    float* s = sc + r * BLK;
    switch (rows - r < 4 ? rows - r : 4) {
      case 1: qk_tile<1, R>(qr, k, ja, jb, D, c0, c1, s, ls); break;
      case 2: qk_tile<2, R>(qr, k, ja, jb, D, c0, c1, s, ls); break;
      case 3: qk_tile<3, R>(qr, k, ja, jb, D, c0, c1, s, ls); break;
      default: qk_tile<4, R>(qr, k, ja, jb, D, c0, c1, s, ls); break;
    }
  }
}

// Columns [c0, c1) of the value sums (the whole row unless given)
template <typename R = FloatRows>
inline void pv_rows(const float* p, int rows, const typename R::T* const* v, int ja, int jb,
                    int D, float* acc, int c0 = 0, int c1 = -1, LineStream* ls = nullptr) {
  if (c1 < 0) c1 = D;
  for (int r = 0; r < rows; r += 4) {
    const float* pr = p + r * BLK;
    float* a = acc + r * D;
    switch (rows - r < 4 ? rows - r : 4) {
      case 1: pv_tile<1, R>(pr, v, ja, jb, D, c0, c1, a, ls); break;
      case 2: pv_tile<2, R>(pr, v, ja, jb, D, c0, c1, a, ls); break;
      case 3: pv_tile<3, R>(pr, v, ja, jb, D, c0, c1, a, ls); break;
      default: pv_tile<4, R>(pr, v, ja, jb, D, c0, c1, a, ls); break;
    }
  }
}

}  // namespace kvk
