// Products over Q4_0 / Q4_1 / Q5_0 / Q8_0 rows interleaved by 8 (layout: interleaved.h). Every output is
//   y = fma((float)idot_b, d_b * dx_b, acc) over the blocks b in order (+ for Q4_1 the
//   minimums' sum fma(m_b * dx_b, (float)sx_b, accm) added at the end)
// with idot_b the exact integer dot of the block (Q4_0: nibbles . x - 8 * sx; Q5_0: - 16 * sx): the same
// float operations for a row whatever M, its place in the batch, the thread count or the
// build (the vector lanes and the plain loop round alike).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "blocks.h"
#include "interleaved.h"

namespace kvk {

void x8_gather_row(int kind, const uint8_t* data, int64_t row, int64_t row_bytes, int64_t K,
                   uint8_t* out) {
  const int gb = x8_block_bytes(kind), at = x8_codes_at(kind), nb = gb / 8;
  const int qs = kind == Q4_1X8 ? 4 : kind == Q5_0X8 ? 6 : 2;  // where a GGUF block's codes start
  const uint8_t* base = data + (row / 8) * 8 * row_bytes;
  const int l = (int)(row % 8);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* src = base + b * gb;
    uint8_t* dst = out + b * nb;
    std::memcpy(dst, src + 2 * l, 2);
    if (kind == Q4_1X8) std::memcpy(dst + 2, src + 16 + 2 * l, 2);
    if (kind == Q5_0X8) std::memcpy(dst + 2, src + 16 + 4 * l, 4);
    for (int j = 0; j < x8_code_bytes(kind) / 4; ++j)
      std::memcpy(dst + qs + 4 * j, src + at + 32 * j + 4 * l, 4);
  }
}

namespace {

#if KVK_AVX2
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// y[mb * ldy + 0..7] for the MB x rows m0.. against one group of 8 rows (blocks at g)
template <bool MIN, int MB>
void group_rows(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs,
                int64_t K, float* y, int64_t ldy) {
  constexpr int GB = MIN ? 160 : 144, AT = MIN ? 32 : 16;
  const int64_t nb = K / 32;
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MB], accm[MB];
  KVK_UNROLL
  for (int i = 0; i < MB; ++i) acc[i] = accm[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * GB;
    __m256i s16[MB];
    KVK_UNROLL
    for (int i = 0; i < MB; ++i) s16[i] = _mm256_setzero_si256();
    KVK_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + AT + 32 * j));
      const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      KVK_UNROLL
      for (int i = 0; i < MB; ++i) {
        const int8_t* x = xq + i * K + b * 32;
        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, bcast4(x + 4 * j)));
        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, bcast4(x + 16 + 4 * j)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    KVK_UNROLL
    for (int i = 0; i < MB; ++i) {
      const float dx = xd[i * nb + b];
      const int32_t sx = xs[i * nb + b];
      __m256i idot = _mm256_madd_epi16(s16[i], ones);
      if constexpr (!MIN) idot = _mm256_sub_epi32(idot, _mm256_set1_epi32(8 * sx));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[i]);
      if constexpr (MIN) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
        accm[i] = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_set1_ps(dx)), _mm256_set1_ps((float)sx),
                                  accm[i]);
      }
    }
  }
  KVK_UNROLL
  for (int i = 0; i < MB; ++i) _mm256_storeu_ps(y + i * ldy, _mm256_add_ps(acc[i], accm[i]));
}

// Q8_0X8: |w| as unsigned times x with w's sign, pair sums in int16 (2 * 128 * 127 < 2^15),
// then int32 lanes per run
template <int MB>
void group_rows_q8(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t*,
                   int64_t K, float* y, int64_t ldy) {
  constexpr int GB = 272, AT = 16;
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  KVK_UNROLL
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * GB;
    __m256i s32[MB];
    KVK_UNROLL
    for (int i = 0; i < MB; ++i) s32[i] = _mm256_setzero_si256();
    KVK_UNROLL
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + AT + 32 * j));
      const __m256i u = _mm256_sign_epi8(v, v);
      KVK_UNROLL
      for (int i = 0; i < MB; ++i) {
        const __m256i s = _mm256_sign_epi8(bcast4(xq + i * K + b * 32 + 4 * j), v);
        s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    KVK_UNROLL
    for (int i = 0; i < MB; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + b])),
                               acc[i]);
  }
  KVK_UNROLL
  for (int i = 0; i < MB; ++i) _mm256_storeu_ps(y + i * ldy, acc[i]);
}

// Q5_0X8: codes 0..31 (the fifth bit from qh: value v's is bit v of its row's 32), less 16 x
// the block's x sum; a run's two pair sums widened to int32 (4 x 31 x 128 < 2^15)
template <int MB>
void group_rows_q5(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs,
                   int64_t K, float* y, int64_t ldy) {
  constexpr int GB = 176, QH = 16, AT = 48;
  const int64_t nb = K / 32;
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi8(16);
  // byte c of row r's qh to the 4 bytes of its lane (row r is dword r, r % 4 within a 128-bit half)
  auto spread = [](int c) {
    return _mm256_setr_epi8(c, c, c, c, 4 + c, 4 + c, 4 + c, 4 + c, 8 + c, 8 + c, 8 + c, 8 + c,
                            12 + c, 12 + c, 12 + c, 12 + c, c, c, c, c, 4 + c, 4 + c, 4 + c, 4 + c,
                            8 + c, 8 + c, 8 + c, 8 + c, 12 + c, 12 + c, 12 + c, 12 + c);
  };
  const __m256i bits_lo = _mm256_set1_epi32(0x08040201), bits_hi = _mm256_set1_epi32((int)0x80402010);
  __m256 acc[MB];
  KVK_UNROLL
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * GB;
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + QH));
    __m256i s32[MB];
    KVK_UNROLL
    for (int i = 0; i < MB; ++i) s32[i] = _mm256_setzero_si256();
    KVK_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + AT + 32 * j));
      // values 4j+t (low nibbles) take bits 4j+t: byte j/2 of qh, bit t + 4 (j % 2); values
      // 16+4j+t (high nibbles) byte 2 + j/2
      const __m256i bits = (j & 1) ? bits_hi : bits_lo;
      const __m256i bl = _mm256_and_si256(_mm256_shuffle_epi8(qh, spread(j >> 1)), bits);
      const __m256i bh = _mm256_and_si256(_mm256_shuffle_epi8(qh, spread(2 + (j >> 1))), bits);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4),
                                         _mm256_and_si256(_mm256_cmpeq_epi8(bl, bits), sixteen));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                         _mm256_and_si256(_mm256_cmpeq_epi8(bh, bits), sixteen));
      KVK_UNROLL
      for (int i = 0; i < MB; ++i) {
        const int8_t* x = xq + i * K + b * 32;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + 4 * j)),
                                           _mm256_maddubs_epi16(hi, bcast4(x + 16 + 4 * j)));
        s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(p, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    KVK_UNROLL
    for (int i = 0; i < MB; ++i) {
      const __m256i idot = _mm256_sub_epi32(s32[i], _mm256_set1_epi32(16 * xs[i * nb + b]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + b])),
                               acc[i]);
    }
  }
  KVK_UNROLL
  for (int i = 0; i < MB; ++i) _mm256_storeu_ps(y + i * ldy, acc[i]);
}
#else
// The plain loops' frame: per x row i and weight row r, acc = fma((float)dot(blk, x, r, sx),
// d_r * dx, acc) over the blocks (with MIN the minimums' fma(m_r * dx, sx, accm) beside it),
// the vector lanes' operations in their order.
template <int GB, bool MIN, int MB, class Dot>
void plain_group(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs,
                 int64_t K, float* y, int64_t ldy, Dot dot) {
  const int64_t nb = K / 32;
  for (int i = 0; i < MB; ++i) {
    float acc[8] = {}, accm[8] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * GB;
      const int8_t* x = xq + i * K + b * 32;
      const float dx = xd[i * nb + b];
      const int32_t sx = xs[i * nb + b];
      for (int r = 0; r < 8; ++r) {
        const float d = half_to_float(load16(blk + 2 * r));
        acc[r] = std::fma((float)dot(blk, x, r, sx), d * dx, acc[r]);
        if constexpr (MIN)
          accm[r] = std::fma(half_to_float(load16(blk + 16 + 2 * r)) * dx, (float)sx, accm[r]);
      }
    }
    for (int r = 0; r < 8; ++r) y[i * ldy + r] = MIN ? acc[r] + accm[r] : acc[r];
  }
}

template <int MB>
void group_rows_q5(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs,
                   int64_t K, float* y, int64_t ldy) {
  auto dot = [](const uint8_t* blk, const int8_t* x, int r, int32_t sx) {
    uint32_t qh;
    std::memcpy(&qh, blk + 16 + 4 * r, 4);
    int32_t idot = 0;
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 4; ++t) {
        const uint8_t byte = blk[48 + 32 * j + 4 * r + t];
        const int v = 4 * j + t;
        const int lo = (byte & 15) | (((qh >> v) & 1) << 4);
        const int hi = (byte >> 4) | (((qh >> (16 + v)) & 1) << 4);
        idot += lo * x[v] + hi * x[16 + v];
      }
    return idot - 16 * sx;
  };
  plain_group<176, false, MB>(g, xq, xd, xs, K, y, ldy, dot);
}

template <int MB>
void group_rows_q8(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs,
                   int64_t K, float* y, int64_t ldy) {
  auto dot = [](const uint8_t* blk, const int8_t* x, int r, int32_t) {
    int32_t idot = 0;
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) idot += (int8_t)blk[16 + 32 * j + 4 * r + t] * x[4 * j + t];
    return idot;
  };
  plain_group<272, false, MB>(g, xq, xd, xs, K, y, ldy, dot);
}

template <bool MIN, int MB>
void group_rows(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs,
                int64_t K, float* y, int64_t ldy) {
  constexpr int GB = MIN ? 160 : 144, AT = MIN ? 32 : 16;
  auto dot = [](const uint8_t* blk, const int8_t* x, int r, int32_t sx) {
    int32_t idot = 0;
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 4; ++t) {
        const uint8_t byte = blk[AT + 32 * j + 4 * r + t];
        idot += (byte & 15) * x[4 * j + t] + (byte >> 4) * x[16 + 4 * j + t];
      }
    return MIN ? idot : idot - 8 * sx;
  };
  plain_group<GB, MIN, MB>(g, xq, xd, xs, K, y, ldy, dot);
}
#endif

// one group's kernel for MB x rows, per type
template <int KIND, int MB>
void group(const uint8_t* g, const int8_t* xq, const float* xd, const int32_t* xs, int64_t K,
           float* y, int64_t ldy) {
  if constexpr (KIND == Q8_0X8) group_rows_q8<MB>(g, xq, xd, xs, K, y, ldy);
  else if constexpr (KIND == Q5_0X8) group_rows_q5<MB>(g, xq, xd, xs, K, y, ldy);
  else group_rows<KIND == Q4_1X8, MB>(g, xq, xd, xs, K, y, ldy);
}

template <int KIND>
void x8_rows_t(const uint8_t* data, int64_t rows, int64_t row_bytes, const int8_t* xq,
               const float* xd, const int32_t* xs, int64_t M, int64_t K, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  // groups of 8 rows over the threads (~16 K weights an item)
  at::parallel_for(0, rows / 8, std::max<int64_t>(1, 16384 / (8 * K)), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* gp = data + g * 8 * row_bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        group<KIND, 4>(gp, xq + m * K, xd + m * nb, xs + m * nb, K, y + m * ldy + 8 * g, ldy);
      for (; m + 2 <= M; m += 2)
        group<KIND, 2>(gp, xq + m * K, xd + m * nb, xs + m * nb, K, y + m * ldy + 8 * g, ldy);
      for (; m < M; ++m)
        group<KIND, 1>(gp, xq + m * K, xd + m * nb, xs + m * nb, K, y + m * ldy + 8 * g, ldy);
    }
  });
}

}  // namespace

void x8_rows(int kind, const uint8_t* data, int64_t rows, int64_t row_bytes, const int8_t* xq,
             const float* xd, const int32_t* xs, int64_t M, int64_t K, float* y, int64_t ldy) {
  switch (kind) {
    case Q4_0X8: return x8_rows_t<Q4_0X8>(data, rows, row_bytes, xq, xd, xs, M, K, y, ldy);
    case Q4_1X8: return x8_rows_t<Q4_1X8>(data, rows, row_bytes, xq, xd, xs, M, K, y, ldy);
    case Q5_0X8: return x8_rows_t<Q5_0X8>(data, rows, row_bytes, xq, xd, xs, M, K, y, ldy);
    default: return x8_rows_t<Q8_0X8>(data, rows, row_bytes, xq, xd, xs, M, K, y, ldy);
  }
}

}  // namespace kvk
