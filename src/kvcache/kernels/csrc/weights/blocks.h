// GGUF weight blocks (ggml's layouts) decoded into one form the dot products and the
// dequantizer share, so that each block layout is unpacked in one place:
//
//   a row of K weights -> q int8 [K]   the integer codes, offsets removed (Q4_0: nibble - 8)
//                         d  [K / G]   per block of G: the factor of the codes
//                         dm [K / G]   per block: the factor of the minimums (MIN types)
//                         sc [K / 16]  per 16 values: an integer scale (K-quants; 1 otherwise)
//                         mn [K / 32]  per 32 values: an integer minimum (MIN types)
//
//   weight = d * sc * q + dm * mn      (G = 32: sc = 1; Q4_1: dm = m, mn = 1;
//                                       Q4_K: d * sc_j, dm = -dmin, mn = m_j)
//
// G is 32 for the q8_0 family (Q4_0, Q4_1, Q5_0, Q8_0) and 256 for the K-quants (Q4_K, Q6_K):
// their activations are quantized per block of G (ggml's q8_0 and q8_K).
#pragma once

#include <cstdint>
#include <cstring>

#include "../simd.h"

namespace kvk {

// ggml's type numbers (GGMLQuantizationType); + X8: the type's blocks of 8 rows interleaved
// (interleaved.h), the same bytes in another order
constexpr int X8 = 256;
enum BlockKind : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14,
  Q4_0X8 = Q4_0 + X8, Q4_1X8 = Q4_1 + X8, Q5_0X8 = Q5_0 + X8, Q8_0X8 = Q8_0 + X8
};

struct BlockTraits {
  int values;  // weights per block (G)
  int nbytes;  // bytes per block
  bool min;    // has a minimum term (dm * mn)
};

inline bool known_kind(int kind) {
  return kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q8_0 || kind == Q4_K ||
         kind == Q6_K || kind == Q4_0X8 || kind == Q4_1X8 || kind == Q5_0X8 || kind == Q8_0X8;
}

// the GGUF type of a kind (an interleaved kind's blocks are of its base type)
inline int base_kind(int kind) { return kind >= X8 ? kind - X8 : kind; }

inline BlockTraits traits(int kind) {
  switch (base_kind(kind)) {
    case Q4_0: return {32, 18, false};
    case Q4_1: return {32, 20, true};
    case Q5_0: return {32, 22, false};
    case Q8_0: return {32, 34, false};
    case Q4_K: return {256, 144, true};
    default: return {256, 210, false};  // Q6_K
  }
}

// One decoded row (see the top of the file); buffers sized for K values.
struct Decoded {
  int8_t* q;
  float* d;
  float* dm;
  int32_t* sc;
  int32_t* mn;
};

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ggml's packing of Q4_K's 6-bit scales and minimums: sub-block j of 8
inline void q4k_scale_min(const uint8_t* s, int j, int32_t* sc, int32_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if KVK_AVX2
// 16 bytes of nibbles -> 32 codes: the low nibbles first, then the high ones (ggml's order)
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// bit i of 32 -> byte i: 16 where set, 0 elsewhere (Q5_0's fifth bits)
inline __m256i bits32_to_16s(uint32_t bits) {
  const __m256i idx = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                        0x0101010101010101, 0x0000000000000000);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), idx);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(16));
}

inline void store32(int8_t* q, __m256i v) { _mm256_storeu_si256((__m256i*)q, v); }
#endif

template <int KIND>
constexpr int block_values() {
  return KIND == Q4_K || KIND == Q6_K ? 256 : 32;
}

template <int KIND>
constexpr int block_bytes() {
  return KIND == Q4_0 ? 18 : KIND == Q4_1 ? 20 : KIND == Q5_0 ? 22 : KIND == Q8_0 ? 34
                        : KIND == Q4_K ? 144 : 210;
}

// A block's factors (src: its bytes) into o at block b: d, and dm, sc, mn where it has them.
template <int KIND>
inline void block_scalars(const uint8_t* src, int64_t b, const Decoded& o) {
  if constexpr (KIND == Q4_0 || KIND == Q4_1 || KIND == Q5_0 || KIND == Q8_0) {
    o.d[b] = half_to_float(load16(src));
    if constexpr (KIND == Q4_1) {
      o.dm[b] = half_to_float(load16(src + 2));
      o.mn[b] = 1;
    }
  } else if constexpr (KIND == Q4_K) {
    o.d[b] = half_to_float(load16(src));
    o.dm[b] = -half_to_float(load16(src + 2));
    for (int j = 0; j < 8; ++j) {
      int32_t sc, m;
      q4k_scale_min(src + 4, j, &sc, &m);
      o.sc[b * 16 + 2 * j] = o.sc[b * 16 + 2 * j + 1] = sc;
      o.mn[b * 8 + j] = m;
    }
  } else {  // Q6_K: ql [128], qh [64], scales int8 [16], d
    const int8_t* s = reinterpret_cast<const int8_t*>(src + 192);
    o.d[b] = half_to_float(load16(src + 208));
    for (int j = 0; j < 16; ++j) o.sc[b * 16 + j] = s[j];
  }
}

#if KVK_AVX2
// Codes c * 32 .. c * 32 + 31 of a block (src: its bytes), in registers: what the kernels dot
// and what block_codes stores, from one expression per layout (Q6_K's: block_codes, whose
// loop shares its loads between four runs; qlinear stages Q6_K rows).
template <int KIND>
inline __m256i codes32(const uint8_t* src, int c) {
  if constexpr (KIND == Q8_0) {
    return _mm256_loadu_si256((const __m256i*)(src + 2));
  } else if constexpr (KIND == Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    const __m256i five = _mm256_or_si256(nibbles16(src + 6), bits32_to_16s(qh));
    return _mm256_sub_epi8(five, _mm256_set1_epi8(16));
  } else if constexpr (KIND == Q4_0) {
    return _mm256_sub_epi8(nibbles16(src + 2), _mm256_set1_epi8(8));
  } else if constexpr (KIND == Q4_1) {
    return nibbles16(src + 4);
  } else {  // Q4_K: 32 bytes of nibbles per 64 codes, low then high
    static_assert(KIND == Q4_K, "Q6_K's codes are unpacked by block_codes");
    const __m256i v = _mm256_loadu_si256((const __m256i*)(src + 16 + 32 * (c / 2)));
    const __m256i m4 = _mm256_set1_epi8(15);
    return _mm256_and_si256(c % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
  }
}
#endif

// A block's codes (src: its bytes) into q [G]; the vector and the plain unpacking give the
// same codes (the dequantizer's tests check both builds against gguf).
template <int KIND>
inline void block_codes(const uint8_t* src, int8_t* q) {
#if KVK_AVX2
  if constexpr (KIND == Q6_K) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    const __m256i m2_2 = _mm256_set1_epi8(12), m2_4 = _mm256_set1_epi8(48);
    const __m256i bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {  // the plain loop's four 32-value runs, 32 lanes at a time
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + h * 64));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + h * 64 + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + h * 32));
      const __m256i hi0 = _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4);
      const __m256i hi1 = _mm256_slli_epi16(_mm256_and_si256(hb, m2_2), 2);
      const __m256i hi2 = _mm256_and_si256(hb, m2_4);
      const __m256i hi3 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2_4);
      const __m256i n0 = _mm256_and_si256(l0, m4), n1 = _mm256_and_si256(l1, m4);
      const __m256i n2 = _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4);
      const __m256i n3 = _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4);
      int8_t* o6 = q + h * 128;
      store32(o6, _mm256_sub_epi8(_mm256_or_si256(n0, hi0), bias));
      store32(o6 + 32, _mm256_sub_epi8(_mm256_or_si256(n1, hi1), bias));
      store32(o6 + 64, _mm256_sub_epi8(_mm256_or_si256(n2, hi2), bias));
      store32(o6 + 96, _mm256_sub_epi8(_mm256_or_si256(n3, hi3), bias));
    }
  } else {
    KVK_UNROLL
    for (int c = 0; c < block_values<KIND>() / 32; ++c) store32(q + 32 * c, codes32<KIND>(src, c));
  }
#else
  if constexpr (KIND == Q8_0) {
    std::memcpy(q, src + 2, 32);
  } else if constexpr (KIND == Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    const uint8_t* qs = src + 6;
    for (int j = 0; j < 16; ++j) {
      q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  } else if constexpr (KIND == Q4_0 || KIND == Q4_1) {
    const uint8_t* qs = src + (KIND == Q4_1 ? 4 : 2);
    const int off = KIND == Q4_1 ? 0 : 8;
    for (int j = 0; j < 16; ++j) {
      q[j] = (int8_t)((qs[j] & 15) - off);
      q[j + 16] = (int8_t)((qs[j] >> 4) - off);
    }
  } else if constexpr (KIND == Q4_K) {
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        q[64 * c + l] = (int8_t)(qs[32 * c + l] & 15);
        q[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
      }
  } else {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    for (int h = 0; h < 2; ++h)  // 128 values a half: 2 nibbles of ql, 4 bit pairs of qh
      for (int i = 0; i < 32; ++i) {
        const int l0 = ql[h * 64 + i], l1 = ql[h * 64 + 32 + i], hb = qh[h * 32 + i];
        q[h * 128 + i] = (int8_t)(((l0 & 15) | ((hb & 3) << 4)) - 32);
        q[h * 128 + 32 + i] = (int8_t)(((l1 & 15) | (((hb >> 2) & 3) << 4)) - 32);
        q[h * 128 + 64 + i] = (int8_t)(((l0 >> 4) | (((hb >> 4) & 3) << 4)) - 32);
        q[h * 128 + 96 + i] = (int8_t)(((l1 >> 4) | (((hb >> 6) & 3) << 4)) - 32);
      }
  }
#endif
}

// Decode a row of K weights (K a multiple of the block's values).
template <int KIND>
inline void decode_row_t(const uint8_t* src, int64_t K, const Decoded& o) {
  constexpr int G = block_values<KIND>(), NBYTES = block_bytes<KIND>();
  for (int64_t b = 0; b < K / G; ++b) {
    block_scalars<KIND>(src + b * NBYTES, b, o);
    block_codes<KIND>(src + b * NBYTES, o.q + b * G);
  }
}

inline void decode_row(int kind, const uint8_t* src, int64_t K, const Decoded& o) {
  switch (kind) {
    case Q4_0: return decode_row_t<Q4_0>(src, K, o);
    case Q4_1: return decode_row_t<Q4_1>(src, K, o);
    case Q5_0: return decode_row_t<Q5_0>(src, K, o);
    case Q8_0: return decode_row_t<Q8_0>(src, K, o);
    case Q4_K: return decode_row_t<Q4_K>(src, K, o);
    default: return decode_row_t<Q6_K>(src, K, o);
  }
}

}  // namespace kvk
