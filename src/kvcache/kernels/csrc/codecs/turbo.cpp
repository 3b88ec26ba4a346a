// Turbo codes: rows rotated by a Walsh-Hadamard transform with sign flips, each channel a
// codebook level times the row's norm; keys scored and values summed in the rotated domain.
#include "family.h"

#include <tuple>
#include <type_traits>

namespace kvk {

namespace {

// turbo's log-coded norms: code 0 = 0, code c = 2^((c - 1) / 8 - 16)
inline float log_scale_value(uint8_t c) {
  return c == 0 ? 0.f : std::exp2((float)(c - 1) / 8.f - 16.f);
}

// a turbo row's norm: entry m (= cell * H + head) of the scales, log-coded or bf16 (the sign
// bit is an unused flag)
inline float turbo_norm(const Reader& r, int64_t m) {
  return r.log_scale ? log_scale_value(reinterpret_cast<const uint8_t*>(r.scale)[m])
                     : bf16_to_float(r.scale[m] & 0x7fff);
}

// ---- turbo -----------------------------------------------------------------------------
#if KVK_AVX2
// levels[codes] for 8 codes: a table of 2^BITS floats, looked up by permutes (no gathers)
template <int BITS>
inline __m256 lookup8(const float* table, __m256i idx) {
  if constexpr (BITS <= 3) {
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), idx);
  } else if constexpr (BITS <= 5) {
    __m256 part[BITS == 4 ? 2 : 4];
    for (int k = 0; k < (BITS == 4 ? 2 : 4); ++k)
      part[k] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8 * k), idx);
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> sign
    __m256 low = _mm256_blendv_ps(part[0], part[1], b3);
    if constexpr (BITS == 4) return low;
    const __m256 high = _mm256_blendv_ps(part[2], part[3], b3);
    const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27));  // bit 4 -> sign
    return _mm256_blendv_ps(low, high, b4);
  } else {
    return _mm256_i32gather_ps(table, idx, 4);
  }
}

// one 8-point Walsh-Hadamard transform (Sylvester order) inside a register
inline __m256 fwht8(__m256 v) {
  __m256 s = _mm256_permute_ps(v, 0xB1);  // len 1: (0,1) (2,3) ...
  v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
  s = _mm256_permute_ps(v, 0x4E);  // len 2
  v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
  s = _mm256_permute2f128_ps(v, v, 1);  // len 4
  return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
}

// 16 codes of B bits (2B bytes; group g of a 64-channel block) -> 16 words in channel order:
// a 16-byte load (clamped to end at the block's end: never past the row) broadcast to both
// lanes, each word gathering the one or two bytes of its code (pshufb), the code moved to
// the word's top bits (a multiply by 2^(16 - B - shift): AVX2 has no per-word shift) and down
template <int B>
struct Codes16 {
  alignas(32) int8_t shuf[4][32];
  alignas(32) int16_t mult[4][16];
  int off[4];
  constexpr Codes16() : shuf(), mult(), off() {
    for (int g = 0; g < 4; ++g) {
      off[g] = 2 * B * g < 8 * B - 16 ? 2 * B * g : 8 * B - 16;
      const int delta = 2 * B * g - off[g];
      for (int c = 0; c < 16; ++c) {
        const int bit = B * c, byte = bit / 8 + delta, shift = bit % 8;
        const bool two = shift + B > 8;
        if (byte + (two ? 1 : 0) > 15) throw "a code outside its 16-byte load";
        shuf[g][16 * (c / 8) + 2 * (c % 8)] = (int8_t)byte;
        shuf[g][16 * (c / 8) + 2 * (c % 8) + 1] = two ? (int8_t)(byte + 1) : (int8_t)-128;
        mult[g][c] = (int16_t)(uint16_t)(1u << (16 - B - shift));
      }
    }
  }
};
template <int B>
inline constexpr Codes16<B> kCodes16{};

template <int B>
inline __m256i codes16(const uint8_t* block, int g) {
  const __m256i raw = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kCodes16<B>.off[g])));
  const __m256i w = _mm256_shuffle_epi8(
      raw, _mm256_load_si256(reinterpret_cast<const __m256i*>(kCodes16<B>.shuf[g])));
  const __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCodes16<B>.mult[g]));
  return _mm256_srli_epi16(_mm256_mullo_epi16(w, m), 16 - B);
}
#endif

template <int BITS>
inline void turbo_levels(const uint8_t* row, const float* table, float* out, int64_t P) {
#if KVK_AVX2
  for (int64_t i = 0; i < P; i += 8)
    _mm256_storeu_ps(out + i, lookup8<BITS>(table, codes8<BITS>(row, i, P * BITS / 8)));
#else
  for (int64_t i = 0; i < P; ++i) out[i] = table[code_at<BITS>(row, i)];
#endif
}

// y <- fwht(y) (unnormalised) for P a power of two >= 8
inline void fwht(float* y, int64_t P) {
#if KVK_AVX2
  for (int64_t i = 0; i < P; i += 8) _mm256_storeu_ps(y + i, fwht8(_mm256_loadu_ps(y + i)));
  for (int64_t len = 8; len < P; len <<= 1) {
    for (int64_t i = 0; i < P; i += 2 * len) {
      for (int64_t j = i; j < i + len; j += 8) {
        const __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + len);
        _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(y + j + len, _mm256_sub_ps(a, b));
      }
    }
  }
#else
  for (int64_t len = 1; len < P; len <<= 1) {
    for (int64_t i = 0; i < P; i += 2 * len) {
      for (int64_t j = i; j < i + len; ++j) {
        const float a = y[j], b = y[j + len];
        y[j] = a + b;
        y[j + len] = a - b;
      }
    }
  }
#endif
}

#if KVK_AVX2
// A turbo key row of 64 channels in registers, the same operations as turbo_levels, fwht,
// the norm / sign / centre pass and apply_rope one after another (bit-identical), the row
// written once: levels, the transform, times s * signs, plus centre (nullable), then RoPE
// from the position's cos / sin rows (cs nullable: keys stored after RoPE)
template <int BITS>
inline void turbo_key64(const uint8_t* row, const float* table, float s, const float* signs,
                        const float* centre, const float* cs, const float* sn, float* out) {
  __m256 v[8];
  for (int k = 0; k < 8; ++k)
    v[k] = fwht8(lookup8<BITS>(table, codes8<BITS>(row, 8 * k, 64 * BITS / 8)));
  for (int len = 1; len < 8; len <<= 1)
    for (int i = 0; i < 8; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        const __m256 a = v[j], b = v[j + len];
        v[j] = _mm256_add_ps(a, b);
        v[j + len] = _mm256_sub_ps(a, b);
      }
  const __m256 sv = _mm256_set1_ps(s);
  for (int k = 0; k < 8; ++k) {
    v[k] = _mm256_mul_ps(v[k], _mm256_mul_ps(sv, _mm256_loadu_ps(signs + 8 * k)));
    if (centre != nullptr) v[k] = _mm256_add_ps(v[k], _mm256_loadu_ps(centre + 8 * k));
  }
  if (cs == nullptr) {
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + 8 * k, v[k]);
    return;
  }
  for (int k = 0; k < 4; ++k) {
    const __m256 x1 = v[k], x2 = v[k + 4];
    const __m256 cv = _mm256_loadu_ps(cs + 8 * k), sv2 = _mm256_loadu_ps(sn + 8 * k);
    _mm256_storeu_ps(out + 8 * k, _mm256_fnmadd_ps(x2, sv2, _mm256_mul_ps(x1, cv)));
    _mm256_storeu_ps(out + 32 + 8 * k, _mm256_fmadd_ps(x1, sv2, _mm256_mul_ps(x2, cv)));
  }
}
#endif

// Turbo: levels of the codes times the row's norm; keys rotated back (and centred), values
// left in the rotated domain (dom = 1)
template <int BITS>
void decode_turbo_bits(const Tile& t, int a, int b) {
  const Reader& r = t.r;
  const int64_t D = r.D;
  Record centre;
  float rotated[kMaxDim];  // CENTRE_ROPE: the centre rotated to a cell's position
  float signs[kMaxDim];  // the head's sign flips times 1/sqrt(P): the inverse rotation's diagonal
  const float norm = 1.f / std::sqrt((float)D);
  for (int64_t i = 0; i < D; ++i) signs[i] = r.signs[t.h * D + i] * norm;
  each_row(t, a, b, [&](int j, int64_t c, float* out) {
    const uint8_t* row = code_row(r, c, t.h);
    const int64_t m = c * r.H + t.h;
    const float s = turbo_norm(r, m);
    if (r.rotated) {
      turbo_levels<BITS>(row, r.centroids, out, D);
      scale_row(s, out, (int)D);
      t.dom[j] = 1;
      return false;  // values: summed in the rotated domain, rotated back once
    }
    const float* cen = nullptr;
    if (r.meta_a != nullptr) {
      centre.load(r, c, t.h, r.meta_a, nullptr);
      cen = centre.a;
      if (r.centre_rope) {  // the centre as this cell's position has it
        std::memcpy(rotated, centre.a, (size_t)D * 4);
        apply_rope(t.rope, t.pos[j], rotated, D);
        cen = rotated;
      }
    }
#if KVK_AVX2
    if (D == 64) {  // one pass in registers (SmolLM2's and Llama's common head size)
      const float *cs = nullptr, *sn = nullptr;
      if (r.pre_rope) std::tie(cs, sn) = rope_rows(t.rope, t.pos[j], D);
      turbo_key64<BITS>(row, r.centroids, s, signs, cen, cs, sn, out);
      return false;  // RoPE applied already
    }
#endif
    turbo_levels<BITS>(row, r.centroids, out, D);
    fwht(out, D);
#if KVK_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t i = 0; i < D; i += 8) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(sv, _mm256_loadu_ps(signs + i)));
      if (cen != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(cen + i));
      _mm256_storeu_ps(out + i, v);
    }
#else
    for (int64_t i = 0; i < D; ++i) out[i] = out[i] * s * signs[i] + (cen != nullptr ? cen[i] : 0.f);
#endif
    return true;
  });
}

// f(std::integral_constant<int, bits>) for turbo's 1..8 bits: one switch for every kernel
// templated on the width of the codes
template <typename F>
decltype(auto) with_turbo_bits(int64_t bits, F f) {
  switch (bits) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: TORCH_CHECK(false, "kvcache kernel: turbo bits ", bits, " not in 1..8");
  }
}

// ---- turbo keys after RoPE, scored from the codes (readers.h) ---------------------------
#if KVK_AVX512
// 16 codes of BITS bits (2 * BITS bytes from channel i) -> 16 int32: the bytes broadcast to
// the four 128-bit lanes, each code's two bytes shuffled into its lane, shifted and masked
template <int BITS>
struct Unpack16 {
  alignas(64) int8_t shuf[64];
  alignas(64) int32_t shift[16];
  constexpr Unpack16() : shuf(), shift() {
    for (int j = 0; j < 16; ++j) {
      const int bit = BITS * j, byte = bit / 8;
      shuf[4 * j] = (int8_t)byte;
      shuf[4 * j + 1] = byte + 1 < 16 ? (int8_t)(byte + 1) : (int8_t)-128;  // -128: zero
      shuf[4 * j + 2] = shuf[4 * j + 3] = (int8_t)-128;
      shift[j] = bit % 8;
    }
  }
};
template <int BITS>
inline constexpr Unpack16<BITS> kUnpack16{};

template <int BITS>
inline __m512i unpack16(const uint8_t* row, int64_t i) {
  // a masked load reads only the 2 * BITS bytes (never past the row)
  const __m128i raw = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * BITS)) - 1), row + i * BITS / 8);
  const __m512i b = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw),
                                        _mm512_load_si512(kUnpack16<BITS>.shuf));
  return _mm512_and_si512(_mm512_srlv_epi32(b, _mm512_load_si512(kUnpack16<BITS>.shift)),
                          _mm512_set1_epi32((1 << BITS) - 1));
}

// levels[codes] for 16 codes from a zero-padded table of >= 32 floats
template <int BITS>
inline __m512 lookup16(const float* table, __m512i idx) {
  if constexpr (BITS <= 4) {
    return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(table));
  } else if constexpr (BITS == 5) {
    return _mm512_permutex2var_ps(_mm512_loadu_ps(table), idx, _mm512_loadu_ps(table + 16));
  } else {
    return _mm512_i32gather_ps(idx, table, 4);
  }
}

#endif  // KVK_AVX512

// The vector the turbo kernels below compute in: tiles.h's Vec16 where the CPU has AVX-512,
// else Vec8 (lookup8's permutes); levels(): the codebook levels of W codes of a row from
// channel i
#if KVK_AVX512
struct TurboVec : Vec16 {
  template <int BITS>
  static V levels(const float* table, const uint8_t* row, int i, int /*width*/) {
    return lookup16<BITS>(table, unpack16<BITS>(row, i));
  }
};
#elif KVK_AVX2
struct TurboVec : Vec8 {
  template <int BITS>
  static V levels(const float* table, const uint8_t* row, int i, int width) {
    return lookup8<BITS>(table, codes8<BITS>(row, i, width));
  }
};
#endif

#if KVK_AVX2
using TV = TurboVec;

// sc[r * BLK + j + c] += <A | B of row r, cos | sin of cell j + c> for NR rows and NC cells
// whose A | B blocks are ab [NR, D] (CENTRE_ROPE; cells of one record share them): channels
// outer, so that the NR x NC sums are independent FMA chains, the A | B rows read from L1 by
// each cell's FMAs (a register for each would spill the sums)
template <int NR, int NC>
inline void centre_rope_cells(int D, const float* ab, const TurboRows& t, int j, float* sc) {
  const int half = D / 2;
  __m256 acc[NR][NC];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int i = 0; i < half; i += 8) {
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) {
      const __m256 cv = _mm256_loadu_ps(t.cs[j + c] + i), sv = _mm256_loadu_ps(t.sn[j + c] + i);
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + r * D + i), cv, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + r * D + half + i), sv, acc[r][c]);
      }
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r) {
    if constexpr (NC == 4) {
      const __m128 add = sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      _mm_storeu_ps(sc + r * BLK + j, _mm_add_ps(_mm_loadu_ps(sc + r * BLK + j), add));
    } else {
      KVK_UNROLL
      for (int c = 0; c < NC; ++c) sc[r * BLK + j + c] += hsum8(acc[r][c]);
    }
  }
}

// The same for a run of cells at consecutive positions p0, p0 + 1, ... over one record, from
// the angle sums: cos((p0 + j) t) = cos(p0 t) cos(j t) - sin(p0 t) sin(j t) (and sin alike), so
// sum_i cos_i(p0 + j) A_i + sin_i(p0 + j) B_i = sum_i cos_i(j) A'_i + sin_i(j) B'_i with
// A' = A cos(p0) + B sin(p0), B' = B cos(p0) - A sin(p0) once per row and run: the cells' sums
// are then the lanes of FMAs against the offsets table (Rope::offsets, [D, BLK], in L1), one
// cell a lane, no horizontal sum, and no cos / sin row of the cells' positions read (those
// came from L2 or memory, for every head). NC blocks of 8 cells; U partial sums over the
// channels per accumulator, so that NR * NC * U = 12 FMA chains run in flight.
template <int NR, int NC>
inline void centre_offsets_cols(int D, const float* w, const float* offsets, int o, int valid,
                                float* sc) {
  constexpr int U = 4 / NC;
  __m256 acc[NR][NC][U];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c)
      KVK_UNROLL
      for (int u = 0; u < U; ++u) acc[r][c][u] = _mm256_setzero_ps();
  for (int i = 0; i < D; i += U) {
    KVK_UNROLL
    for (int u = 0; u < U; ++u) {
      const float* row = offsets + (int64_t)(i + u) * BLK + o;
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) {
        const __m256 b = _mm256_set1_ps(w[r * kMaxDim + i + u]);
        KVK_UNROLL
        for (int c = 0; c < NC; ++c)
          acc[r][c][u] = _mm256_fmadd_ps(b, _mm256_loadu_ps(row + 8 * c), acc[r][c][u]);
      }
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) {
      __m256 v = acc[r][c][0];
      for (int u = 1; u < U; ++u) v = _mm256_add_ps(v, acc[r][c][u]);
      float* dst = sc + r * BLK + o + 8 * c;
      if (valid - 8 * c >= 8) {
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), v));
      } else {
        alignas(32) float part[8];
        _mm256_store_ps(part, v);
        for (int k = 0; k < valid - 8 * c; ++k) dst[k] += part[k];
      }
    }
}

// cells [j0, j0 + n) (n <= BLK) at consecutive positions over the A | B block ab of NR rows
template <int NR>
inline void centre_rope_run(int D, const float* ab, const TurboRows& t, int j0, int n, float* sc) {
  const int half = D / 2;
  alignas(32) float w[NR * kMaxDim];
  const float *c0 = t.cs[j0], *s0 = t.sn[j0];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < half; ++i) {
      const float a = ab[r * D + i], b = ab[r * D + half + i];
      w[r * kMaxDim + i] = a * c0[i] + b * s0[i];
      w[r * kMaxDim + half + i] = b * c0[i] - a * s0[i];
    }
  float* s = sc + j0;  // cell j0 + o: offset o
  int o = 0;
  for (; o + 32 <= n; o += 32) centre_offsets_cols<NR, 4>(D, w, t.offsets, o, n - o, s);
  for (; o + 16 <= n; o += 16) centre_offsets_cols<NR, 2>(D, w, t.offsets, o, n - o, s);
  for (; o < n; o += 8) centre_offsets_cols<NR, 1>(D, w, t.offsets, o, n - o, s);
}

template <int NR>
inline void centre_rope_cells_of(int D, int row0, const TurboRows& t, int ja, int jb, float* sc) {
  int j = ja;
  for (; j + 4 <= jb; j += 4)
    if (t.ab[j] == t.ab[j + 3])  // one record: one A | B block
      centre_rope_cells<NR, 4>(D, t.ab[j] + (int64_t)row0 * D, t, j, sc);
    else
      for (int c = 0; c < 4; ++c)
        centre_rope_cells<NR, 1>(D, t.ab[j + c] + (int64_t)row0 * D, t, j + c, sc);
  for (; j < jb; ++j) centre_rope_cells<NR, 1>(D, t.ab[j] + (int64_t)row0 * D, t, j, sc);
}

// Runs of 8 cells or more at consecutive positions over one record take centre_rope_run, other
// cells centre_rope_cells
template <int NR>
inline void centre_rope_tile(int D, int row0, const TurboRows& t, int ja, int jb, float* sc) {
  if (t.offsets == nullptr || D > kMaxDim) return centre_rope_cells_of<NR>(D, row0, t, ja, jb, sc);
  const int half = D / 2;
  for (int j = ja, k; j < jb; j = k) {
    for (k = j + 1; k < jb && t.ab[k] == t.ab[j] && t.cs[k] == t.cs[j] + (int64_t)(k - j) * half;)
      ++k;
    if (k - j >= 8) centre_rope_run<NR>(D, t.ab[j] + (int64_t)row0 * D, t, j, k - j, sc);
    else centre_rope_cells_of<NR>(D, row0, t, j, k, sc);
  }
}

// the centre part of the scores of rows [r0, r0 + nr) (nr <= 3), sc their first row's
inline void centre_rope_rows(int nr, int D, int r0, const TurboRows& t, int ja, int jb,
                             float* sc) {
  if (nr == 1) centre_rope_tile<1>(D, r0, t, ja, jb, sc);
  else if (nr == 2) centre_rope_tile<2>(D, r0, t, ja, jb, sc);
  else centre_rope_tile<3>(D, r0, t, ja, jb, sc);
}

// Scores of NR query rows against NC (kCells or 1) cells from j: per step, the levels of W codes
// of each half of the row times the cell's norm meet the rotated query rows; the next tile
// fetched one step per 16 channels
template <int BITS, int NR, int NC>
inline void qk_turbo_cells(const float* qrot, int D, const TurboRows& t, int j, float* sc,
                           Steps& st) {
  const int half = D / 2, width = D * BITS / 8;
  TV::V acc[NR][NC];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) acc[r][c] = TV::zero();
  for (int i = 0; i < half; i += TV::W) {
    if (i % 16 == 0) st.step();
    for (int part = i; part < D; part += half) {
      TV::V qv[NR];
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) qv[r] = TV::load(qrot + r * D + part);
      KVK_UNROLL
      for (int c = 0; c < NC; ++c) {
        const TV::V lv = TV::mul(TV::levels<BITS>(t.table, t.rows[j + c], part, width),
                                 TV::set1(t.s[j + c]));
        KVK_UNROLL
        for (int r = 0; r < NR; ++r) acc[r][c] = TV::fma(qv[r], lv, acc[r][c]);
      }
    }
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r) store_sums<TV, NC>(acc[r], sc + r * BLK + j);
}

// Column registers of pv_turbo_cols: 4 (NR x 4 accumulators) with AVX-512's 32 vector
// registers, 2 with AVX2's 16
constexpr int kPvRegs = KVK_AVX512 ? 4 : 2;

// acc[r] += sum_j p[r][j] * levels of row j, for NR rows, kPvRegs * W channels from c0 in
// registers; the next tile fetched one step per two cells of 64 channels
template <int BITS, int NR>
inline void pv_turbo_cols(const float* p, int D, const TurboRows& t, int ja, int jb, int c0,
                          float* acc, LineStream* ls) {
  Steps st(ls);
  [[maybe_unused]] const int width = D * BITS / 8;  // (the 16-channel path reads groups)
  constexpr int every = 64 / (kPvRegs * TV::W) * 2 - 1;  // 64 channels: every other cell
  TV::V a[NR][kPvRegs];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int k = 0; k < kPvRegs; ++k) a[r][k] = TV::load(acc + r * D + c0 + TV::W * k);
  for (int j = ja; j < jb; ++j) {
    if ((j & every) == 0) st.step();
    TV::V pv[NR], lv[kPvRegs];
    KVK_UNROLL
    for (int r = 0; r < NR; ++r) pv[r] = TV::set1(p[r * BLK + j]);
#if !KVK_AVX512
    if constexpr (BITS >= 2 && BITS <= 5) {  // the 16 channels: one group of codes16
      const __m256i w = codes16<BITS>(t.rows[j] + c0 / 64 * 8 * BITS, c0 % 64 / 16);
      lv[0] = lookup8<BITS>(t.table, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)));
      lv[1] = lookup8<BITS>(t.table, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)));
    } else
#endif
    {
      KVK_UNROLL
      for (int k = 0; k < kPvRegs; ++k)
        lv[k] = TV::levels<BITS>(t.table, t.rows[j], c0 + TV::W * k, width);
    }
    KVK_UNROLL
    for (int k = 0; k < kPvRegs; ++k)
      KVK_UNROLL
      for (int r = 0; r < NR; ++r) a[r][k] = TV::fma(pv[r], lv[k], a[r][k]);
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int k = 0; k < kPvRegs; ++k) TV::store(acc + r * D + c0 + TV::W * k, a[r][k]);
}
constexpr int kPvCols = kPvRegs * TurboVec::W;

template <int BITS>
void pv_turbo_tile(const float* p, int rows, int D, const TurboRows& t, int ja, int jb,
                   float* acc, LineStream* ls) {
  for (int r = 0; r < rows; r += 3) {
    const float* pr = p + r * BLK;
    float* ar = acc + (int64_t)r * D;
    const int nr = rows - r < 3 ? rows - r : 3;
    for (int c0 = 0; c0 < D; c0 += kPvCols) {
      if (nr == 1) pv_turbo_cols<BITS, 1>(pr, D, t, ja, jb, c0, ar, ls);
      else if (nr == 2) pv_turbo_cols<BITS, 2>(pr, D, t, ja, jb, c0, ar, ls);
      else pv_turbo_cols<BITS, 3>(pr, D, t, ja, jb, c0, ar, ls);
    }
  }
}

template <int BITS, bool CENTRE>
void qk_turbo_tile(const float* qrot, int rows, int D, int row0, const TurboRows& t, int ja,
                   int jb, float* sc, LineStream* ls) {
  Steps st(ls);
  for (int r = 0; r < rows; r += 3) {
    const float* qr = qrot + (int64_t)r * D;
    float* s = sc + r * BLK;
    const int nr = rows - r < 3 ? rows - r : 3, r0 = row0 + r;
    int j = ja;
    for (; j + kCells <= jb; j += kCells) {
      if (nr == 1) qk_turbo_cells<BITS, 1, kCells>(qr, D, t, j, s, st);
      else if (nr == 2) qk_turbo_cells<BITS, 2, kCells>(qr, D, t, j, s, st);
      else qk_turbo_cells<BITS, 3, kCells>(qr, D, t, j, s, st);
    }
    for (; j < jb; ++j) {
      if (nr == 1) qk_turbo_cells<BITS, 1, 1>(qr, D, t, j, s, st);
      else if (nr == 2) qk_turbo_cells<BITS, 2, 1>(qr, D, t, j, s, st);
      else qk_turbo_cells<BITS, 3, 1>(qr, D, t, j, s, st);
    }
    if constexpr (CENTRE) centre_rope_rows(nr, D, r0, t, ja, jb, s);
  }
}

// ---- turbo keys in int16 products (turbo_keys16) ---------------------------------------
// the int16 levels of two groups' codes (words 0..31), each in channel order: the codes
// packed to bytes, looked up as low and high bytes (pshufb: 16 entries; with 5 bits codes
// 16-31 index the second table: +0x70 sets bit 7, which zeroes a pshufb lane, for codes >= 16,
// and ^0x80 flips that), interleaved back into words
template <int B>
inline void levels32(const __m256i lut[4], __m256i ca, __m256i cb, __m256i* la, __m256i* lb) {
  const __m256i p = _mm256_packus_epi16(ca, cb);  // lane L: a's words of lane L, then b's
  __m256i lo, hi;
  if constexpr (B <= 4) {
    lo = _mm256_shuffle_epi8(lut[0], p);
    hi = _mm256_shuffle_epi8(lut[2], p);
  } else {
    const __m256i x0 = _mm256_add_epi8(p, _mm256_set1_epi8(0x70));
    const __m256i x1 = _mm256_xor_si256(x0, _mm256_set1_epi8((char)0x80));
    lo = _mm256_or_si256(_mm256_shuffle_epi8(lut[0], x0), _mm256_shuffle_epi8(lut[1], x1));
    hi = _mm256_or_si256(_mm256_shuffle_epi8(lut[2], x0), _mm256_shuffle_epi8(lut[3], x1));
  }
  *la = _mm256_unpacklo_epi8(lo, hi);
  *lb = _mm256_unpackhi_epi8(lo, hi);
}

// Scores of NR rows against NC cells from j: per 64-channel block the int16 levels meet the
// query steps in vpmaddwd, summed exactly in int32 (8 products a lane), converted once per
// block; times qstep * lstep * the cell's norm
template <int B, int NR, int NC>
inline void qk_turbo16_cells(const int16_t* q16, const float* qstep, int D, const TurboRows& t,
                             const __m256i lut[4], int j, float* sc, Steps& st) {
  __m256 f[NR][NC];
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c) f[r][c] = _mm256_setzero_ps();
  for (int b0 = 0; b0 < D; b0 += 64) {
    st.step();
    __m256i acc[NR][NC];
    KVK_UNROLL
    for (int r = 0; r < NR; ++r)
      KVK_UNROLL
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_si256();
    for (int k = 0; k < 2; ++k) {
      KVK_UNROLL
      for (int c = 0; c < NC; ++c) {
        const uint8_t* block = t.rows[j + c] + b0 / 64 * 8 * B;
        __m256i la, lb;
        levels32<B>(lut, codes16<B>(block, 2 * k), codes16<B>(block, 2 * k + 1), &la, &lb);
        KVK_UNROLL
        for (int r = 0; r < NR; ++r) {
          const __m256i* qv = reinterpret_cast<const __m256i*>(q16 + r * D + b0 + 32 * k);
          acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(_mm256_loadu_si256(qv), la));
          acc[r][c] =
              _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(_mm256_loadu_si256(qv + 1), lb));
        }
      }
    }
    KVK_UNROLL
    for (int r = 0; r < NR; ++r)
      KVK_UNROLL
      for (int c = 0; c < NC; ++c) f[r][c] = _mm256_add_ps(f[r][c], _mm256_cvtepi32_ps(acc[r][c]));
  }
  KVK_UNROLL
  for (int r = 0; r < NR; ++r)
    KVK_UNROLL
    for (int c = 0; c < NC; ++c)
      sc[r * BLK + j + c] = hsum8(f[r][c]) * (qstep[r] * t.lstep * t.s[j + c]);
}

template <int B, bool CENTRE>
void qk_turbo16_tile(const int16_t* q16, const float* qstep, int rows, int D, int row0,
                     const TurboRows& t, int ja, int jb, float* sc, LineStream* ls) {
  Steps st(ls);
  __m256i lut[4];
  for (int k = 0; k < 4; ++k)
    lut[k] = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t.lut[k])));
  for (int r = 0; r < rows; r += 3) {
    const int16_t* qr = q16 + (int64_t)r * D;
    const float* qs = qstep + r;
    float* s = sc + r * BLK;
    const int nr = rows - r < 3 ? rows - r : 3, r0 = row0 + r;
    int j = ja;
    for (; j + 2 <= jb; j += 2) {
      if (nr == 1) qk_turbo16_cells<B, 1, 2>(qr, qs, D, t, lut, j, s, st);
      else if (nr == 2) qk_turbo16_cells<B, 2, 2>(qr, qs, D, t, lut, j, s, st);
      else qk_turbo16_cells<B, 3, 2>(qr, qs, D, t, lut, j, s, st);
    }
    for (; j < jb; ++j) {
      if (nr == 1) qk_turbo16_cells<B, 1, 1>(qr, qs, D, t, lut, j, s, st);
      else if (nr == 2) qk_turbo16_cells<B, 2, 1>(qr, qs, D, t, lut, j, s, st);
      else qk_turbo16_cells<B, 3, 1>(qr, qs, D, t, lut, j, s, st);
    }
    if constexpr (CENTRE) centre_rope_rows(nr, D, r0, t, ja, jb, s);
  }
}

#endif

}  // namespace

void decode_turbo(const Tile& t, int a, int b) {
  with_turbo_bits(t.r.bits, [&](auto bits) { decode_turbo_bits<decltype(bits)::value>(t, a, b); });
}

void turbo_unrotate(const float* signs, float* y, int64_t P) {
  fwht(y, P);
  const float norm = 1.f / std::sqrt((float)P);
  for (int64_t i = 0; i < P; ++i) y[i] *= norm * signs[i];
}

bool turbo_keys_direct(const Reader& r) {
  return KVK_AVX2 && r.kind == TURBO && !r.rotated && !r.pre_rope && r.D % 64 == 0 &&
         r.data_head * 8 == r.D * r.bits;  // P == D: no padding
}

void turbo_query(const Reader& r, int64_t h, const float* q, float* out) {
  const float norm = 1.f / std::sqrt((float)r.D);
  const float* signs = r.signs + h * r.D;
  for (int64_t i = 0; i < r.D; ++i) out[i] = q[i] * signs[i] * norm;
  fwht(out, r.D);
}

bool turbo_keys16(const Reader& r) {
  return r.kind == TURBO && !r.rotated && !r.pre_rope && r.D % 64 == 0 && r.bits >= 2 &&
         r.bits <= 5 && r.data_head * 8 == r.D * r.bits;
}

float turbo_query16(const Reader& r, int64_t h, float* q, float* qrot, int16_t* q16) {
  turbo_query(r, h, q, qrot);
  const float step = quantize_query16(qrot, (int)r.D, q16, false);  // qrot: its steps
  std::copy(qrot, qrot + r.D, q);
  turbo_unrotate(r.signs + h * r.D, q, r.D);  // back: fwht(y) / sqrt(D) * signs
  return step;
}

bool turbo_values_direct(const Reader& r) {
  return KVK_AVX2 && r.kind == TURBO && r.rotated && r.D % 64 == 0 &&
         r.data_head * 8 == r.D * r.bits;
}

void turbo_values(const Reader& r, int64_t h, const int32_t* cells, int a, int b, TurboRows& t) {
  code_rows(r, h, cells, a, b, t.rows);
  for (int j = a; j < b; ++j) {
    const int64_t m = cells[j] * r.H + h;
    t.s[j] = turbo_norm(r, m);
    t.ab[j] = nullptr;
  }
  const int levels = 1 << r.bits;  // the lookups read 32 entries at most below 6 bits
  if (t.levels == levels && std::equal(r.centroids, r.centroids + levels, t.table)) return;
  t.levels = levels;  // the tables of a new codebook (once per work item and codec, mostly)
  std::copy(r.centroids, r.centroids + levels, t.table);
  std::fill(t.table + levels, t.table + std::max(levels, 32), 0.f);
  t.exact16 = false;
  if (levels <= 32) {  // int16 steps of max |level| / 8191 (codebook.py's grid)
    float top = 0.f;
    for (int c = 0; c < levels; ++c) top = std::max(top, std::fabs(t.table[c]));
    t.lstep = top / 8191.f;
    t.exact16 = top > 0.f;
    for (int c = 0; c < 32; ++c) {
      const float k = c < levels && top > 0.f ? std::nearbyint(t.table[c] / t.lstep) : 0.f;
      t.exact16 = t.exact16 && std::fabs(k * t.lstep - t.table[c]) <= top * 0x1p-20f;
      const uint16_t word = (uint16_t)(int16_t)k;
      t.lut[c / 16][c % 16] = (uint8_t)(word & 0xff);
      t.lut[2 + c / 16][c % 16] = (uint8_t)(word >> 8);
    }
  }
}

void rope_offsets(const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < BLK; ++j)
    for (int64_t i = 0; i < half; ++i) {
      out[i * BLK + j] = cos[j * half + i];
      out[(half + i) * BLK + j] = sin[j * half + i];
    }
}

void turbo_keys(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a,
                int b, const Rope& rope, const float* q, int rows, TurboRows& t) {
  turbo_values(r, h, cells, a, b, t);  // rows, norms, levels
  if (!r.centre_rope) return;
  t.offsets = rope.offsets;
  const int64_t D = r.D, half = D / 2;
  // the common case first: a run of cells (a sequence's) over one record, its record ids a
  // span compared at once, not cell by cell
  bool one = b > a && is_run(cells + a, b - a);
  if (one) {
    const int32_t* ids = r.meta_of + cells[a];
    int32_t differ = 0;
    for (int k = 1; k < b - a; ++k) differ |= ids[k] ^ ids[0];
    one = differ == 0;
  }
  auto shares = [&](int j) {
    return j > a && (one || r.meta_of[cells[j]] == r.meta_of[cells[j - 1]]);
  };
  int runs = 0;  // runs of cells sharing a record: one A | B block each
  for (int j = a; j < b; ++j) runs += !shares(j);
  t.abs.resize((size_t)runs * rows * D);
  Record centre;
  float* block = t.abs.data();
  for (int j = a; j < b; ++j) {
    if (shares(j)) {
      t.ab[j] = t.ab[j - 1];
    } else {  // a new record: A | B of every query row
      centre.load(r, cells[j], h, r.meta_a, nullptr);
      for (int g = 0; g < rows; ++g) {
        const float* qg = q + (int64_t)g * D;
        float* ab = block + (int64_t)g * D;
        for (int64_t i = 0; i < half; ++i) {
          const float c1 = centre.a[i], c2 = centre.a[half + i];
          ab[i] = qg[i] * c1 + qg[half + i] * c2;
          ab[half + i] = qg[half + i] * c1 - qg[i] * c2;
        }
      }
      t.ab[j] = block;
      block += (int64_t)rows * D;
    }
    std::tie(t.cs[j], t.sn[j]) = rope_rows(rope, pos[j], D);
  }
}

void pv_turbo_rows(const Reader& r, const float* p, int rows, const TurboRows& t, int ja, int jb,
                   float* acc, LineStream* ls) {
#if KVK_AVX2
  with_turbo_bits(r.bits, [&](auto bits) {
    pv_turbo_tile<decltype(bits)::value>(p, rows, (int)r.D, t, ja, jb, acc, ls);
  });
#else
  (void)r, (void)p, (void)rows, (void)t, (void)ja, (void)jb, (void)acc, (void)ls;
  TORCH_CHECK(false, "kvcache kernel: turbo values from codes need AVX2");
#endif
}

void qk_turbo16_rows(const Reader& r, const int16_t* q16, const float* qstep, int rows,
                     int row0, const TurboRows& t, int ja, int jb, float* sc, LineStream* ls) {
#if KVK_AVX2
  TORCH_CHECK(turbo_keys16(r) && t.exact16, "kvcache kernel: turbo keys not in int16 steps");
  const int D = (int)r.D;
  with_turbo_bits(r.bits, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if constexpr (B >= 2 && B <= 5) {  // (turbo_keys16)
      if (r.centre_rope) qk_turbo16_tile<B, true>(q16, qstep, rows, D, row0, t, ja, jb, sc, ls);
      else qk_turbo16_tile<B, false>(q16, qstep, rows, D, row0, t, ja, jb, sc, ls);
    }
  });
#else
  (void)r, (void)q16, (void)qstep, (void)rows, (void)row0, (void)t, (void)ja, (void)jb;
  (void)sc, (void)ls;
  TORCH_CHECK(false, "kvcache kernel: turbo keys in int16 steps need AVX2");
#endif
}

void qk_turbo_rows(const Reader& r, const float* qrot, int rows, int row0, const TurboRows& t,
                   int ja, int jb, float* sc, LineStream* ls) {
#if KVK_AVX2
  with_turbo_bits(r.bits, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if (r.centre_rope) qk_turbo_tile<B, true>(qrot, rows, (int)r.D, row0, t, ja, jb, sc, ls);
    else qk_turbo_tile<B, false>(qrot, rows, (int)r.D, row0, t, ja, jb, sc, ls);
  });
#else
  (void)r, (void)qrot, (void)rows, (void)row0, (void)t, (void)ja, (void)jb, (void)sc, (void)ls;
  TORCH_CHECK(false, "kvcache kernel: turbo keys from codes need AVX2");
#endif
}

}  // namespace kvk
