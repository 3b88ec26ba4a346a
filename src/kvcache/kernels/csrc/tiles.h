// The math of one tile, shared by every codec: scores of NR query rows against a tile of key
// rows, and the probability-weighted sum of value rows into NR accumulators. Rows are given as
// pointers (into storage for fp32, into a decoded tile, or straight into int8 codes whose
// row scales the caller applies to scores and weights); D is a multiple of 16.
// Register blocking: NR query rows x NC cells of accumulators per pass over D (AVX2 builds).
#pragma once

#include "simd.h"

namespace kvk {

constexpr int BLK = 64;  // cells per tile

// Cache lines to fetch while the tile math runs (the next tile's stored rows, fp16 window or
// codes, and its per-cell fields: byte spans, contiguous rows merged into one): the math's inner
// loops call step(), so that the misses overlap the arithmetic instead of waiting in a pass of
// their own (touch()); finish() asks for what the math did not reach. The lines are paced over
// the steps the tile before took (up to 2 a step): a stream that runs ahead of the read
// bandwidth fills the miss buffers, and a prefetch that finds them full stalls the math.
struct LineStream {
  // a tile's rows, key and value, one span each at most (scattered cells), and its fields
  // (a span past the last is dropped: a line not fetched early is read when needed)
  static constexpr int MAX_SPANS = 2 * BLK + 16;
  const char* span[MAX_SPANS];  // starts, rounded down to a cache line
  int64_t bytes[MAX_SPANS];
  int n = 0, i = 0;
  int64_t off = 0;
  int every = 1, count = 1;       // two lines every `every` steps; steps to the next two
  int calls = 0, last_calls = 0;  // steps since reset, and the tile before's
  void reset() { n = 0, i = 0, off = 0, count = 1, last_calls = calls, calls = 0; }
  // one more span; contiguous with the last one: merged
  void add(const char* start, int64_t len) {
    if (len <= 0) return;
    if (n > 0 && span[n - 1] + bytes[n - 1] == start) {
      bytes[n - 1] += len;
      return;
    }
    if (n == MAX_SPANS) return;
    const uintptr_t at = reinterpret_cast<uintptr_t>(start);
    span[n] = reinterpret_cast<const char*>(at & ~uintptr_t{63});
    bytes[n++] = len + (int64_t)(at & 63);
  }
  // after the spans are added: the pace, 5/6 of the lines by the steps the tile before took
  // and the rest by finish() (the first tile, no steps known, at two lines a step)
  void start() {
    int64_t lines = 0;
    for (int k = 0; k < n; ++k) lines += (bytes[k] + 63) / 64;
    every = lines > 0 ? (int)std::max<int64_t>(1, (int64_t)last_calls * 12 / (lines * 5)) : 1;
  }
  void line() {
#if KVK_AVX2
    _mm_prefetch(span[i] + off, _MM_HINT_T1);  // into L2: the tile math reads it from there
#endif
    off += 64;
    if (off >= bytes[i]) off = 0, ++i;
  }
  // a step counted in the stream itself (loops short of general registers: Steps below)
  void step();
  // two more lines (those left)
  void issue() {
    if (i < n) line();
    if (i < n) line();
  }
  void finish() {
    while (i < n) line();
  }
};

// A hot loop's steps of a line stream (none for nullptr), counted in registers: the loop's
// vector stores may alias anything, so a count kept in the stream would be reloaded and stored
// at every step. Written back when the loop ends.
struct Steps {
  LineStream* ls;
  int count = 0, calls = 0;
  explicit Steps(LineStream* s) : ls(s) {
    if (ls != nullptr) count = ls->count;
  }
  ~Steps() {
    if (ls != nullptr) ls->count = count, ls->calls += calls;
  }
  Steps(const Steps&) = delete;
  Steps& operator=(const Steps&) = delete;
  void step() {
    if (ls == nullptr) return;
    ++calls;
    if (--count > 0) return;
    count = ls->every;
    ls->issue();
  }
};

inline void LineStream::step() { Steps(this).step(); }

// Row kinds the tile math reads: 8 channels from c of a row as floats, in registers; consts:
// the vector registers load8 keeps constants in.
struct FloatRows {  // float32 rows (storage or a decoded tile)
  static constexpr int consts = 0;
  using T = float;
#if KVK_AVX2
  static __m256 load8(const T* row, int c) { return _mm256_loadu_ps(row + c); }
#endif
  static float at(const T* row, int c) { return row[c]; }
};
struct Int8Rows {  // int8 codes, used as they are: the caller applies each row's scale
  static constexpr int consts = 0;
  using T = int8_t;
#if KVK_AVX2
  static __m256 load8(const T* row, int c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + c))));
  }
#endif
  static float at(const T* row, int c) { return (float)row[c]; }
};

struct NibbleRows {  // 4-bit codes, two a byte (channel 2i in byte i's low nibble), as they are
  using T = uint8_t;
  static constexpr int consts = 2;  // nibbles8's shifts and mask
#if KVK_AVX2
  static __m256 load8(const T* row, int c) { return _mm256_cvtepi32_ps(nibbles8(row, c)); }
#endif
  static float at(const T* row, int c) { return (float)((row[c / 2] >> (4 * (c % 2))) & 15); }
};

struct HalfRows {  // fp16 rows (fp16 storage or a recent window), converted as loaded
  static constexpr int consts = 0;
  using T = uint16_t;
#if KVK_AVX2
  static __m256 load8(const T* row, int c) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + c)));
  }
#endif
  static float at(const T* row, int c) { return half_to_float(row[c]); }
};

#if KVK_AVX2
// the sums of four registers' 8 floats each, reduced together (3 hadds, not 4 horizontal sums)
inline __m128 sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Vector traits for the kernels written once for both widths: 8 floats (AVX2), 16 (AVX-512).
// Vec8::nibbles(): the 4-bit codes of channels [c, c + 8) of a packed row (two a byte, low
// nibble first) as floats, never read past the row (KIVI's keys; turbo's 16-wide kernels
// unpack their own codes).
struct Vec8 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* x) { return _mm256_loadu_ps(x); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
  static void store(float* x, V v) { _mm256_storeu_ps(x, v); }
  static V nibbles(const uint8_t* row, int64_t c) {
    return _mm256_cvtepi32_ps(nibbles8(row, c));
  }
  static V halves(const uint16_t* row, int64_t c) { return HalfRows::load8(row, (int)c); }
  static __m128 sums4(V a0, V a1, V a2, V a3) { return kvk::sums4(a0, a1, a2, a3); }
  static float sum(V a) { return hsum8(a); }
};

// Cells a register block of the fused decoders (KIVI, turbo) scores at once: 4 where AVX-512
// gives 32 vector registers, 2 with AVX2's 16 (3 rows x 4 cells of accumulators beside the
// decoder's registers spilled to the stack: 195 stack accesses in turbo's block)
constexpr int kCells = KVK_AVX512 ? 4 : 2;

// out[0:NC] = the sums of acc[0:NC] (NC 4: reduced together)
template <typename V, int NC>
inline void store_sums(const typename V::V* acc, float* out) {
  if constexpr (NC == 4) {
    _mm_storeu_ps(out, V::sums4(acc[0], acc[1], acc[2], acc[3]));
  } else {
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) out[c] = V::sum(acc[c]);
  }
}

#if KVK_AVX512
struct Vec16 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* x) { return _mm512_loadu_ps(x); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* x, V v) { _mm512_storeu_ps(x, v); }
  static __m128 sums4(V a0, V a1, V a2, V a3) {
    auto fold = [](V v) {
      return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    };
    return kvk::sums4(fold(a0), fold(a1), fold(a2), fold(a3));
  }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
};
#endif

template <int NR, int NC, typename R>
inline void qk_cells(const float* q, const typename R::T* const* k, int j, int D, int c0, int c1,
                     float* sc) {
  __m256 acc[NR][NC];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int c = c0; c < c1; c += 8) {
    __m256 kv[NC];
    KVK_UNROLL
    for (int i = 0; i < NC; ++i) kv[i] = R::load8(k[j + i], c);
    KVK_UNROLL
    for (int r = 0; r < NR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + c);
      KVK_UNROLL
      for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int i = 0; i < NC; ++i) sc[r * BLK + j + i] = hsum8(acc[r][i]);
}

// Scores of NR <= 3 rows against 4 cells: the query rows stay in registers, each key row is
// loaded once (pinned), and each row's 4 sums are reduced together (3 hadds, not 4 horizontal
// sums).
template <int NR, typename R>
inline void qk_cells4(const float* q, const typename R::T* const* k, int j, int D, int c0, int c1,
                      float* sc, Steps& st) {
  __m256 acc[NR][4];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int c = c0; c < c1; c += 8) {
    st.step();
    __m256 qv[NR];
    KVK_UNROLL
    for (int r = 0; r < NR; ++r) {
      qv[r] = _mm256_loadu_ps(q + r * D + c);
      pin(qv[r]);
    }
    for (int i = 0; i < 4; ++i) {
      __m256 kv = R::load8(k[j + i], c);
      pin(kv);
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) acc[r][i] = _mm256_fmadd_ps(qv[r], kv, acc[r][i]);
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    _mm_storeu_ps(sc + r * BLK + j, sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}
#endif

// sc[r * BLK + j] = <q[r], k[j]> over channels [c0, c1) for r < NR, j in [ja, jb)
template <int NR, typename R>
inline void qk_tile(const float* q, const typename R::T* const* k, int ja, int jb, int D,
                    int c0, int c1, float* sc, LineStream* ls) {
  int j = ja;
#if KVK_AVX2
  Steps st(ls);
  if constexpr (NR <= 3) {
    for (; j + 4 <= jb; j += 4) qk_cells4<NR, R>(q, k, j, D, c0, c1, sc, st);
  } else {
    for (; j + 2 <= jb; j += 2) qk_cells<NR, 2, R>(q, k, j, D, c0, c1, sc);
  }
  for (; j < jb; ++j) qk_cells<NR, 1, R>(q, k, j, D, c0, c1, sc);
#else
  (void)ls;
  for (; j < jb; ++j)
    KVK_UNROLL
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
  Steps st(ls);
  __m256 a[NR][NV];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int x = 0; x < NV; ++x) a[r][x] = _mm256_loadu_ps(acc + r * D + c0 + 8 * x);
  for (int j = ja; j < jb; ++j) {
    st.step();
    __m256 pr[NR];
    KVK_UNROLL
    for (int r = 0; r < NR; ++r) pr[r] = _mm256_broadcast_ss(p + r * BLK + j);
    KVK_UNROLL
    for (int x = 0; x < NV; ++x) {
      __m256 vx = R::load8(v[j], c0 + 8 * x);
      pin(vx);  // one load for the NR rows
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) a[r][x] = _mm256_fmadd_ps(pr[r], vx, a[r][x]);
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int x = 0; x < NV; ++x) _mm256_storeu_ps(acc + r * D + c0 + 8 * x, a[r][x]);
}
#endif

// acc[r][c0:c1] += sum_j p[r * BLK + j] * v[j][c0:c1] for r < NR, j in [ja, jb)
// (c0, c1 multiples of 16)
template <int NR, typename R>
inline void pv_tile(const float* p, const typename R::T* const* v, int ja, int jb, int D,
                    int c0, int c1, float* acc, LineStream* ls) {
#if KVK_AVX2
  // 12 (8) accumulators: 16 registers with the rest. A row kind that keeps constants in
  // registers (NibbleRows) spills two of 12 to the stack where only 16 vector registers exist
  // (AVX2 without AVX-512's 32): 6 there (docs/design/kernels.md).
  constexpr int NV = NR <= 3 && (KVK_AVX512 || R::consts == 0) ? 4 : 2;
  int c = c0;
  for (; c + 8 * NV <= c1; c += 8 * NV) pv_cols<NR, NV, R>(p, v, ja, jb, D, c, acc, ls);
  for (; c < c1; c += 16) pv_cols<NR, 2, R>(p, v, ja, jb, D, c, acc, ls);
#else
  (void)ls;
  for (int j = ja; j < jb; ++j)
    KVK_UNROLL
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

// ---- Keys stored before RoPE, scored as they are decoded ------------------------------------
// KIVI's 4-bit codes with a scale and minimum per channel (of the cell's group record), or the
// fp16 rows of the recent window, rotated by the cell's position: each 8 + 8 channel pair
// (i, i + D/2) of a key row is decoded and rotated in registers and meets the query rows at
// once, so the rotated key is never stored.
struct KiviKeys {
  const uint8_t* rows[BLK];       // packed codes (channel 2i in byte i's low nibble)
  const uint16_t* half[BLK];      // or fp16 rows (a tile of window rows: rows[] unused)
  const float *a[BLK], *b[BLK];   // the record's channel scale and minimum [D], as floats
  const float *cs[BLK], *sn[BLK];  // the cos and sin rows [D/2] of the cell's position
};

#if KVK_AVX2
// RoPE of a key's channels [i, i + W) (x1 -> *r1) and [i + D/2, ...) (x2 -> *r2) by the cos /
// sin rows of its position: the operations of codecs/family.h's apply_rope, in its order
template <typename V>
inline void rope_pair(typename V::V x1, typename V::V x2, const float* cs, const float* sn,
                      int64_t i, typename V::V* r1, typename V::V* r2) {
  const auto cv = V::load(cs + i), sv = V::load(sn + i);
  *r1 = V::fnma(x2, sv, V::mul(x1, cv));
  *r2 = V::fma(x1, sv, V::mul(x2, cv));
}

// A KIVI key row's channels [i, i + W) (*r1) and [i + D/2, ...) (*r2): codes times the channel
// scales a plus the minimums b, rotated by the cos / sin rows (the decoder's one pass in
// codecs/affine.cpp and the fused scores below)
// (a1, b1: the scales and minimums of channels [i, i + W), a2, b2: of [i + D/2, ...))
template <typename V>
inline void kivi_rotated(const uint8_t* row, typename V::V a1, typename V::V b1, typename V::V a2,
                         typename V::V b2, const float* cs, const float* sn, int64_t i,
                         int64_t half, typename V::V* r1, typename V::V* r2) {
  const auto x1 = V::fma(V::nibbles(row, i), a1, b1);
  const auto x2 = V::fma(V::nibbles(row, half + i), a2, b2);
  rope_pair<V>(x1, x2, cs, sn, i, r1, r2);
}

template <typename V>
inline void kivi_rotated(const uint8_t* row, const float* a, const float* b, const float* cs,
                         const float* sn, int64_t i, int64_t half, typename V::V* r1,
                         typename V::V* r2) {
  kivi_rotated<V>(row, V::load(a + i), V::load(b + i), V::load(a + half + i),
                  V::load(b + half + i), cs, sn, i, half, r1, r2);
}

// Scores of NR <= 3 rows against NC (kCells or 1) cells from j, W channels of each half a step
// (SHARED: the cells share one record, whose ranges are loaded once a step; HALF: fp16 rows)
template <typename V, int NR, int NC, bool SHARED = false, bool HALF = false>
inline void qk_kivi_cells(const float* q, const KiviKeys& t, int j, int D, float* sc,
                          LineStream* ls) {
  const int half = D / 2;
  typename V::V acc[NR][NC];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) acc[r][c] = V::zero();
  for (int i = 0; i < half; i += V::W) {
    if (ls != nullptr)  // a step per 8 channels, as many per cell at either width (the
      KVK_UNROLL
      for (int s = 0; s < V::W / 8; ++s) ls->step();  // loop is short of registers for Steps)
    typename V::V a1{}, b1{}, a2{}, b2{};
    if constexpr (SHARED) {
      a1 = V::load(t.a[j] + i), b1 = V::load(t.b[j] + i);
      a2 = V::load(t.a[j] + half + i), b2 = V::load(t.b[j] + half + i);
    }
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) {
      typename V::V r1, r2;
      if constexpr (HALF)
        rope_pair<V>(V::halves(t.half[j + c], i), V::halves(t.half[j + c], half + i),
                     t.cs[j + c], t.sn[j + c], i, &r1, &r2);
      else if constexpr (SHARED)
        kivi_rotated<V>(t.rows[j + c], a1, b1, a2, b2, t.cs[j + c], t.sn[j + c], i, half, &r1,
                        &r2);
      else
        kivi_rotated<V>(t.rows[j + c], t.a[j + c], t.b[j + c], t.cs[j + c], t.sn[j + c], i,
                        half, &r1, &r2);
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) {
        acc[r][c] = V::fma(V::load(q + r * D + i), r1, acc[r][c]);
        acc[r][c] = V::fma(V::load(q + r * D + half + i), r2, acc[r][c]);
      }
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r) store_sums<V, NC>(acc[r], sc + r * BLK + j);
}

// qk_kivi_cells for nr (1 to 3) rows
template <typename V, int NC, bool SHARED = false, bool HALF = false>
inline void qk_kivi_nr(int nr, const float* q, const KiviKeys& t, int j, int D, float* sc,
                       LineStream* ls) {
  if (nr == 1) qk_kivi_cells<V, 1, NC, SHARED, HALF>(q, t, j, D, sc, ls);
  else if (nr == 2) qk_kivi_cells<V, 2, NC, SHARED, HALF>(q, t, j, D, sc, ls);
  else qk_kivi_cells<V, 3, NC, SHARED, HALF>(q, t, j, D, sc, ls);
}

template <typename V>
inline void qk_kivi_tile(const float* q, int rows, const KiviKeys& t, int ja, int jb, int D,
                         float* sc, LineStream* ls, bool half_rows) {
  for (int r = 0; r < rows; r += 3) {
    const float* qr = q + r * D;
    float* s = sc + r * BLK;
    const int nr = rows - r < 3 ? rows - r : 3;
    int j = ja;
    if (half_rows) {
      for (; j + kCells <= jb; j += kCells)
        qk_kivi_nr<V, kCells, false, true>(nr, qr, t, j, D, s, ls);
      for (; j < jb; ++j) qk_kivi_nr<V, 1, false, true>(nr, qr, t, j, D, s, ls);
      continue;
    }
    for (; j + kCells <= jb; j += kCells) {
      // one record: its ranges loaded once a step (records change once in 64 positions;
      // kivi4_keys hands each new one the next range, so equal ends mean one throughout)
      if (t.a[j] == t.a[j + kCells - 1]) qk_kivi_nr<V, kCells, true>(nr, qr, t, j, D, s, ls);
      else qk_kivi_nr<V, kCells>(nr, qr, t, j, D, s, ls);
    }
    for (; j < jb; ++j) qk_kivi_nr<V, 1>(nr, qr, t, j, D, s, ls);
  }
}

// sc[r * BLK + j] = <q[r], rotated key j> for r < rows, j in [ja, jb) (D a multiple of 16;
// half_rows: the tile's keys are fp16 rows, t.half, else KIVI codes).
// 8 channels a step even where the CPU has AVX-512: the 16-wide loop (Vec16) was slower where
// a thread issues 512-bit FMAs at about half the rate of 256-bit ones (docs/design/kernels.md)
inline void qk_kivi_rows(const float* q, int rows, const KiviKeys& t, int ja, int jb, int D,
                         float* sc, LineStream* ls, bool half_rows = false) {
  qk_kivi_tile<Vec8>(q, rows, t, ja, jb, D, sc, ls, half_rows);
}
#endif

// ---- 4-bit key codes against int16 queries ---------------------------------------------
// Scores from 4-bit affine key codes without turning the codes into floats: each query row is
// rounded once per work item to int16 steps (q16 = round(q / qscale), qscale = max|q| / 32767,
// the row itself replaced by q16 * qscale, so that every score of the work item, from codes,
// minimums, key centres or fp16 window rows, is the rounded query's dot with the decoded key),
// laid out in the order split_nibbles64 leaves a row's codes in, and every code row meets it
// in vpmaddwd (16 products an instruction, summed in pairs into int32; vpdpwssd where the CPU
// has AVX-VNNI or AVX512-VNNI). The rounding moves each query channel by at most max|q| / 65534.
//   q16 layout, per block b of 64 channels: q16[b * 64 + k * 16 + L * 8 + w] = channel
//   b * 64 + 32 L + 4 w + k  (k < 4, L < 2 the 128-bit lane, w < 8 the 16-bit word)

// Query row q [D] rounded in place; q16 [D] its steps, in the layout above (nibble_order: D a
// multiple of 64, for 4-bit keys) or in channel order (D a multiple of 16, for 8-bit keys:
// qk8_rows); returns qscale.
inline float quantize_query16(float* q, int D, int16_t* q16, bool nibble_order = true) {
  float top = 0.f;
  for (int c = 0; c < D; ++c) top = std::max(top, std::fabs(q[c]));
  if (top == 0.f) {
    std::fill(q16, q16 + D, (int16_t)0);
    return 0.f;
  }
  const float qscale = top / 32767.f;
  // channel c's place in q16: the layout above, or channel order
  auto slot = [nibble_order](int c) {
    const int o = c % 64;
    return nibble_order ? c - o + o % 4 * 16 + o / 32 * 8 + o % 32 / 4 : c;
  };
  int c = 0;
#if KVK_AVX2
  // the same divisions and round-half-even as the loop below, 8 channels an instruction
  const __m256 sv = _mm256_set1_ps(qscale);
  for (; c + 8 <= D; c += 8) {
    const __m256 k = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(q + c), sv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_ps(q + c, _mm256_mul_ps(k, sv));
    alignas(32) int32_t steps[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(steps), _mm256_cvtps_epi32(k));
    for (int i = 0; i < 8; ++i) q16[slot(c + i)] = (int16_t)steps[i];
  }
#endif
  for (; c < D; ++c) {
    const float steps = std::nearbyint(q[c] / qscale);  // as int16_steps (attend.py)
    q16[slot(c)] = (int16_t)steps;
    q[c] = steps * qscale;
  }
  return qscale;
}

#if KVK_AVX2
// The 4-bit codes of 64 channels (32 bytes, channel 2i in byte i's low nibble) as four int16
// registers: word w of lane L of x[k] holds channel 32 L + 4 w + k (the q16 layout).
inline void split_nibbles64(const uint8_t* row, __m256i x[4]) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)row), m = _mm256_set1_epi16(15);
  x[0] = _mm256_and_si256(b, m);
  x[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
  x[2] = _mm256_and_si256(_mm256_srli_epi16(b, 8), m);
  x[3] = _mm256_srli_epi16(b, 12);
}

// acc + the int32 sums of adjacent int16 products of a and b (vpdpwssd where the CPU has
// AVX-VNNI or AVX512-VNNI, else vpmaddwd and an add)
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)  // the same instruction, EVEX-coded
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// Per 128-bit lane L, int32 partial sums of sum_c code_c * q16_c over the block's 32 channels
// 32 L .. 32 L + 31 (their total is the lane's horizontal sum)
inline __m256i dot16x4(const __m256i x[4], const int16_t* q16) {
  const __m256i* q = reinterpret_cast<const __m256i*>(q16);
  __m256i s = _mm256_madd_epi16(x[0], _mm256_loadu_si256(q));
  s = dpwssd(s, x[1], _mm256_loadu_si256(q + 1));
  s = dpwssd(s, x[2], _mm256_loadu_si256(q + 2));
  return dpwssd(s, x[3], _mm256_loadu_si256(q + 3));
}

// Block b's part of the scores of NR rows against cells j .. j + 3: sums for lane 0 and lane 1
// of four cells reduced together (hadd keeps lanes apart), each lane times its channel group's
// scale, times the row's qscale; written (first block) or added.
template <int NR>
inline void qk4_cells4(const int16_t* q16, const float* qscale, int D,
                       const uint8_t* const* k, int j, int b, const float* s0, const float* s1,
                       bool first, float* sc, Steps& st) {
  __m256i h[2][NR];
  for (int p = 0; p < 2; ++p) {
    st.step();
    __m256i xa[4], xb[4];
    split_nibbles64(k[j + 2 * p] + b / 2, xa);
    split_nibbles64(k[j + 2 * p + 1] + b / 2, xb);
    KVK_UNROLL
    for (int r = 0; r < NR; ++r)
      h[p][r] = _mm256_hadd_epi32(dot16x4(xa, q16 + r * D + b), dot16x4(xb, q16 + r * D + b));
  }
  const __m128 sa = _mm_loadu_ps(s0 + j), sb = _mm_loadu_ps(s1 + j);
  KVK_UNROLL
  for (int r = 0; r < NR; ++r) {
    // lane 0: channels b .. b + 31 of cells j .. j + 3; lane 1: channels b + 32 .. b + 63
    const __m256 f = _mm256_cvtepi32_ps(_mm256_hadd_epi32(h[0][r], h[1][r]));
    __m128 v = _mm_mul_ps(_mm256_castps256_ps128(f), sa);
    v = _mm_mul_ps(_mm_fmadd_ps(_mm256_extractf128_ps(f, 1), sb, v), _mm_set1_ps(qscale[r]));
    float* out = sc + r * BLK + j;
    _mm_storeu_ps(out, first ? v : _mm_add_ps(v, _mm_loadu_ps(out)));
  }
}

template <int NR>
inline void qk4_cell(const int16_t* q16, const float* qscale, int D, const uint8_t* const* k,
                     int j, int b, const float* s0, const float* s1, bool first, float* sc) {
  __m256i x[4];
  split_nibbles64(k[j] + b / 2, x);
  KVK_UNROLL
  for (int r = 0; r < NR; ++r) {
    __m256i t = dot16x4(x, q16 + r * D + b);
    t = _mm256_hadd_epi32(t, t);
    const __m256 f = _mm256_cvtepi32_ps(_mm256_hadd_epi32(t, t));
    const float v = qscale[r] * (_mm_cvtss_f32(_mm256_castps256_ps128(f)) * s0[j] +
                                 _mm_cvtss_f32(_mm256_extractf128_ps(f, 1)) * s1[j]);
    sc[r * BLK + j] = first ? v : sc[r * BLK + j] + v;
  }
}

template <int NR>
inline void qk4_tile(const int16_t* q16, const float* qscale, int D, const uint8_t* const* k,
                     int ja, int jb, const float* scale, int width, float* sc, LineStream* ls) {
  Steps st(ls);
  for (int b = 0; b < D; b += 64) {
    const float* s0 = scale + (b / width) * BLK;  // the groups of the block's two lanes
    const float* s1 = scale + ((b + 32) / width) * BLK;
    int j = ja;
    for (; j + 4 <= jb; j += 4) qk4_cells4<NR>(q16, qscale, D, k, j, b, s0, s1, b == 0, sc, st);
    for (; j < jb; ++j) qk4_cell<NR>(q16, qscale, D, k, j, b, s0, s1, b == 0, sc);
  }
}

// sc[r * BLK + j] = qscale[r] * sum_c q16[r][c] * code_j[c] * scale[group(c) * BLK + j] for
// r < rows, j in [ja, jb): 4-bit packed key rows k[j] (D / 2 bytes), groups of `width`
// channels (a multiple of 32; D a multiple of 64), q16 rows as quantize_query16 leaves them.
inline void qk4_rows(const int16_t* q16, const float* qscale, int rows, int D,
                     const uint8_t* const* k, int ja, int jb, const float* scale, int width,
                     float* sc, LineStream* ls = nullptr) {
  for (int r = 0; r < rows; r += 3) {
    const int16_t* q = q16 + r * D;
    float* s = sc + r * BLK;
    switch (rows - r < 3 ? rows - r : 3) {
      case 1: qk4_tile<1>(q, qscale + r, D, k, ja, jb, scale, width, s, ls); break;
      case 2: qk4_tile<2>(q, qscale + r, D, k, ja, jb, scale, width, s, ls); break;
      default: qk4_tile<3>(q, qscale + r, D, k, ja, jb, scale, width, s, ls); break;
    }
  }
}

// ---- 8-bit key codes against int16 queries ---------------------------------------------
// The int8 codes of 16 channels widened to int16 meet the query's steps (quantize_query16 in
// channel order) in vpdpwssd: 16 products an instruction and no conversion to float per
// channel (the float path took a widening, a conversion and an FMA per 8 channels and row).
// Sums stay exact in int32 (|q16| <= 32767, |code| <= 127: 64 channels < 2^28, 256 < 2^31).

// Scores of NR rows against NC (4 or 1) cells from j (D a multiple of 16), times qscale
template <int NR, int NC>
inline void qk8_cells(const int16_t* q16, const float* qscale, int D, const int8_t* const* k,
                      int j, float* sc, Steps& st) {
  __m256i acc[NR][NC];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int i = 0; i < NC; ++i) acc[r][i] = _mm256_setzero_si256();
  for (int c = 0; c < D; c += 16) {
    st.step();
    __m256i qv[NR];
    KVK_UNROLL
    for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_si256((const __m256i*)(q16 + r * D + c));
    KVK_UNROLL
    for (int i = 0; i < NC; ++i) {
      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(k[j + i] + c)));
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) acc[r][i] = dpwssd(acc[r][i], x, qv[r]);
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r) {
    if constexpr (NC == 4) {
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]),
                                          _mm256_hadd_epi32(acc[r][2], acc[r][3]));
      const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      _mm_storeu_ps(sc + r * BLK + j, _mm_mul_ps(_mm_cvtepi32_ps(t), _mm_set1_ps(qscale[r])));
    } else {
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc[r][0]),
                                _mm256_extracti128_si256(acc[r][0], 1));
      t = _mm_hadd_epi32(t, t);
      t = _mm_hadd_epi32(t, t);
      sc[r * BLK + j] = (float)_mm_cvtsi128_si32(t) * qscale[r];
    }
  }
}

// sc[r * BLK + j] = qscale[r] * sum_c q16[r][c] * k[j][c] for r < rows, j in [ja, jb): int8 key
// rows k[j] (D channels, a multiple of 16), q16 rows in channel order (the caller applies the
// keys' row scales)
inline void qk8_rows(const int16_t* q16, const float* qscale, int rows, int D,
                     const int8_t* const* k, int ja, int jb, float* sc, LineStream* ls = nullptr) {
  Steps st(ls);
  for (int r = 0; r < rows; r += 3) {
    const int16_t* q = q16 + r * D;
    const float* qs = qscale + r;
    float* s = sc + r * BLK;
    const int nr = rows - r < 3 ? rows - r : 3;
    int j = ja;
    for (; j + 4 <= jb; j += 4) {
      if (nr == 1) qk8_cells<1, 4>(q, qs, D, k, j, s, st);
      else if (nr == 2) qk8_cells<2, 4>(q, qs, D, k, j, s, st);
      else qk8_cells<3, 4>(q, qs, D, k, j, s, st);
    }
    for (; j < jb; ++j) {
      if (nr == 1) qk8_cells<1, 1>(q, qs, D, k, j, s, st);
      else if (nr == 2) qk8_cells<2, 1>(q, qs, D, k, j, s, st);
      else qk8_cells<3, 1>(q, qs, D, k, j, s, st);
    }
  }
}
#endif

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
