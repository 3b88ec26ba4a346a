// What the codec families' units (codecs/*.cpp) share: the Tile a decoder fills, the code
// rows and window rows of cells, RoPE from the tables, metadata records, b-bit unpacking. Each
// family's unit defines its readers (readers.h) and its tile decoder (below); readers.cpp
// holds what every family reads the same way (windows, runs, fields, line streams) and
// decode(), the one switch over kinds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "../readers.h"
#include "../tiles.h"

namespace kvk {

template <typename T>
inline const T* ptr(const at::Tensor& t) {
  return t.numel() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

// the cos and sin rows [D/2] of a position
inline std::pair<const float*, const float*> rope_rows(const Rope& rope, int64_t pos, int64_t D) {
  TORCH_CHECK(pos >= 0 && pos < rope.count, "kvcache kernel: position ", pos,
              " outside the RoPE tables (", rope.count, ")");
  return {rope.cos + pos * (D / 2), rope.sin + pos * (D / 2)};
}

inline void apply_rope(const Rope& rope, int64_t pos, float* x, int64_t D) {
  const int64_t half = D / 2;
  const auto [c, s] = rope_rows(rope, pos, D);
#if KVK_AVX2
  for (int64_t i = 0; i < half; i += 8) {
    __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(x + i, _mm256_fnmadd_ps(x2, sv, _mm256_mul_ps(x1, cv)));
    _mm256_storeu_ps(x + half + i, _mm256_fmadd_ps(x1, sv, _mm256_mul_ps(x2, cv)));
  }
#else
  for (int64_t i = 0; i < half; ++i) {
    float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * s[i];
    x[half + i] = x2 * c[i] + x1 * s[i];
  }
#endif
}

// A metadata record's rows [D] converted to float, kept while cells share the record.
// the rows [D] of head h of record m (cell c's) from tables ta (and tb) as floats into a (b)
inline void record_rows(const Reader& r, int64_t c, int32_t m, int64_t h, const uint16_t* ta,
                 const uint16_t* tb, float* a, float* b) {
  TORCH_CHECK(m >= 0 && m < r.meta_rows, "kvcache kernel: cell ", c, " has no metadata (", m,
              ")");
  half_row(ta + (m * r.H + h) * r.D, a, (int)r.D);
  if (tb != nullptr) half_row(tb + (m * r.H + h) * r.D, b, (int)r.D);
}

struct Record {
  int32_t meta = -1;
  float a[kMaxDim], b[kMaxDim];

  // record of cell c (head h) from tables a (and b): float rows, converted on a change
  void load(const Reader& r, int64_t c, int64_t h, const uint16_t* ta, const uint16_t* tb) {
    const int32_t m = r.meta_of[c];
    if (m == meta && m >= 0) return;  // (a cell without a record fails below, never reuses)
    record_rows(r, c, m, h, ta, tb, a, b);
    meta = m;
  }
};

// ---- unpacking -------------------------------------------------------------------------
// b-bit codes (code i at bits [i*b, (i+1)*b) of the row, little-endian; b divides 8 here)
// of 8 consecutive channels starting at channel i -> 8 integers in an AVX2 register
// the 64-bit word whose low 8 * BITS bits are the codes of channels [i, i + 8) of a row of
// `width` bytes: one unaligned load, never past the row (the last group loads backwards)
template <int BITS>
inline uint64_t word8(const uint8_t* row, int64_t i, int64_t width) {
  const int64_t off = i * BITS / 8;  // 8 codes = BITS bytes
  uint64_t w;
  if (off + 8 <= width) {
    std::memcpy(&w, row + off, 8);
    return w;
  }
  std::memcpy(&w, row + off + BITS - 8, 8);
  return w >> (8 * (8 - BITS));
}

#if KVK_AVX2
template <int BITS>
inline __m256i codes8(const uint8_t* row, int64_t i, int64_t width) {
  if constexpr (BITS == 4) return nibbles8(row, i);  // simd.h's, as the kivi key decoder
  const uint64_t w = word8<BITS>(row, i, width);
  const __m256i sh_lo = _mm256_set_epi64x(3 * BITS, 2 * BITS, BITS, 0);
  const __m256i sh_hi = _mm256_set_epi64x(7 * BITS, 6 * BITS, 5 * BITS, 4 * BITS);
  const __m256i mask = _mm256_set1_epi64x((1 << BITS) - 1);
  const __m256i wv = _mm256_set1_epi64x((long long)w);
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(wv, sh_lo), mask);  // 4 x 64-bit
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi64(wv, sh_hi), mask);
  // lanes (32-bit): lo0 0 lo1 0 lo2 0 lo3 0 | hi in the odd lanes -> lo0 hi0 lo1 hi1 ...
  const __m256i mixed = _mm256_blend_epi32(lo, _mm256_slli_epi64(hi, 32), 0xAA);
  return _mm256_permutevar8x32_epi32(mixed, _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0));
}
#endif

template <int BITS>
inline int code_at(const uint8_t* row, int64_t i) {
  const int64_t bit = i * BITS;
  uint32_t w = row[bit / 8];
  if (bit % 8 + BITS > 8) w |= (uint32_t)row[bit / 8 + 1] << 8;
  return (int)((w >> (bit % 8)) & ((1u << BITS) - 1));
}

// out[0:D] = codes as floats (0 .. 2^BITS - 1), for BITS in {2, 4}
template <int BITS>
inline void unpack_row(const uint8_t* row, float* out, int64_t D) {
#if KVK_AVX2
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(codes8<BITS>(row, i, D * BITS / 8)));
#else
  for (int64_t i = 0; i < D; ++i) out[i] = (float)code_at<BITS>(row, i);
#endif
}

// ---- a tile of decoded rows -------------------------------------------------------------
struct Tile {
  const Reader& r;
  int64_t h;
  const int32_t* cells;
  const int32_t* pos;
  float* tile;
  const float** rows;
  uint8_t* dom;
  const Rope& rope;
};

[[noreturn]] __attribute__((noinline, cold)) inline void out_of_range(const char* what, int64_t i,
                                                                int64_t n) {
  TORCH_CHECK(false, "kvcache kernel: ", what, " ", i, " out of range (", n, ")");
}

// the window row of cell c, decoded into out; false when the cell is stored as codes
inline bool from_window(const Reader& r, int64_t c, int64_t h, float* out) {
  if (r.window == nullptr) return false;
  if (c >= r.window_len) out_of_range("cell outside the window map:", c, r.window_len);
  const int32_t slot = r.window[c];
  if (slot < 0) return false;
  if (slot >= r.residual_rows) out_of_range("window slot", slot, r.residual_rows);
  half_row(r.residual + ((int64_t)slot * r.H + h) * r.D, out, (int)r.D);
  return true;
}

inline const uint8_t* code_row(const Reader& r, int64_t c, int64_t h) {
  if (c >= r.rows) out_of_range("cell without codes:", c, r.rows);
  return r.data + c * r.data_cell + h * r.data_head;
}

// rows[j] = the code row of head h of cells[j], j in [a, b): one range check for the run and
// the reader's fields in locals (stores through rows[] may alias them otherwise: a reload of
// each field per cell)
template <typename T>
inline void code_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
                      const T** rows) {
  const int64_t n = r.rows, stride = r.data_cell;
  int32_t top = -1;
  for (int j = a; j < b; ++j) top = std::max(top, cells[j]);
  if (top >= n) out_of_range("cell without codes:", top, n);
  const uint8_t* base = r.data + h * r.data_head;
  for (int j = a; j < b; ++j) rows[j] = reinterpret_cast<const T*>(base + cells[j] * stride);
}

// Calls row(j, c, out) for each cell not read from the window, then applies RoPE.
template <typename RowFn>
inline void each_row(const Tile& t, int a, int b, RowFn row) {
  const int64_t D = t.r.D;
  for (int j = a; j < b; ++j) {
    const int64_t c = t.cells[j];
    float* out = t.tile + (int64_t)j * D;
    t.rows[j] = out;
    t.dom[j] = 0;
    if (!from_window(t.r, c, t.h, out) && !row(j, c, out)) continue;  // false: no RoPE
    if (t.r.pre_rope) apply_rope(t.rope, t.pos[j], out, D);
  }
}

// whether cell c's row is in the fp16 window
inline bool in_window(const Reader& r, int64_t c) {
  return r.window != nullptr && c < r.window_len && r.window[c] >= 0;
}

// Whether cells[0:n] are consecutive ids (readers.cpp)
bool is_run(const int32_t* cells, int n);

// out[j] = the fp16 field `inner` of cells[j]'s record of `stride` fields, for j in [a, b)
// (readers.cpp)
void half_fields(const uint16_t* fields, int64_t rows, int64_t stride, int64_t inner,
                 const int32_t* cells, int a, int b, float* out);

// each family's tile decoder: rows [a, b) of t (readers.h, decode)
void decode_float(const Tile& t, int a, int b);     // F32, F16, BF16
void decode_int8(const Tile& t, int a, int b);      // INT8
void decode_affine(const Tile& t, int a, int b);    // AFFINE_ROWS, AFFINE_CHANNELS
void decode_turbo(const Tile& t, int a, int b);     // TURBO

}  // namespace kvk
