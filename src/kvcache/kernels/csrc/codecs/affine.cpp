// Affine codes: b-bit codes with a scale and minimum per group of a row's channels
// (AFFINE_ROWS: int4, int2) or per channel of a group of rows (AFFINE_CHANNELS: KIVI keys).
#include "family.h"

#include <tuple>

namespace kvk {

namespace {

// x = q * scale + low per group of channels (+ the sequence's key centre)
template <int BITS>
void decode_affine_rows(const Tile& t, int a, int b) {
  const Reader& r = t.r;
  const int64_t D = r.D, groups = r.scale_head, width = D / groups;
  Record centre;
  each_row(t, a, b, [&](int, int64_t c, float* out) {
    unpack_row<BITS>(code_row(r, c, t.h), out, D);
    const uint16_t* sp = r.scale + (c * r.H + t.h) * groups;
    const uint16_t* lp = r.low + (c * r.H + t.h) * groups;
    if (r.meta_a != nullptr) centre.load(r, c, t.h, r.meta_a, nullptr);
    for (int64_t g = 0; g < groups; ++g) {
      const float s = half_to_float(sp[g]), m = half_to_float(lp[g]);
      float* x = out + g * width;
#if KVK_AVX2
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
      for (int64_t i = 0; i < width; i += 8) {
        __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), sv, mv);
        if (r.meta_a != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(centre.a + g * width + i));
        _mm256_storeu_ps(x + i, v);
      }
#else
      for (int64_t i = 0; i < width; ++i)
        x[i] = x[i] * s + m + (r.meta_a != nullptr ? centre.a[g * width + i] : 0.f);
#endif
    }
    return true;
  });
}

// KIVI keys: x = q * scale[channel] + low[channel] of the cell's group record (then RoPE)
template <int BITS>
void decode_affine_channels(const Tile& t, int a, int b) {
  const Reader& r = t.r;
  const int64_t D = r.D;
  Record range;
  each_row(t, a, b, [&](int j, int64_t c, float* out) {
    const uint8_t* row = code_row(r, c, t.h);
    range.load(r, c, t.h, r.meta_a, r.meta_b);
#if KVK_AVX2
    if (BITS == 4 && r.pre_rope && D % 16 == 0) {
      // 4-bit keys before RoPE in one pass: the same operations as the three passes below
      // (codes, range, rotation), the row written once, bit-identical and faster
      // (docs/design/kernels.md)
      const int64_t half = D / 2;
      const auto [cs, sn] = rope_rows(t.rope, t.pos[j], D);
      for (int64_t i = 0; i < half; i += 8) {
        __m256 r1, r2;
        kivi_rotated<Vec8>(row, range.a, range.b, cs, sn, i, half, &r1, &r2);
        _mm256_storeu_ps(out + i, r1);
        _mm256_storeu_ps(out + half + i, r2);
      }
      return false;  // rotated already
    }
#endif
    unpack_row<BITS>(row, out, D);
    fma_rows(out, range.a, range.b, out, (int)D);
    return true;
  });
}

}  // namespace

void decode_affine(const Tile& t, int a, int b) {
  if (t.r.kind == AFFINE_ROWS)
    return t.r.bits == 4 ? decode_affine_rows<4>(t, a, b) : decode_affine_rows<2>(t, a, b);
  return t.r.bits == 4 ? decode_affine_channels<4>(t, a, b) : decode_affine_channels<2>(t, a, b);
}

void affine4_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
                  const uint8_t** rows, float* scale, float* low) {
  TORCH_CHECK(r.kind == AFFINE_ROWS && r.bits == 4, "kvcache kernel: affine4_rows of another codec");
  const int64_t groups = r.scale_head, H = r.H;
  code_rows(r, h, cells, a, b, rows);
  for (int64_t g = 0; g < groups; ++g) {
    half_fields(r.scale, r.rows, H * groups, h * groups + g, cells, a, b, scale + g * BLK);
    half_fields(r.low, r.rows, H * groups, h * groups + g, cells, a, b, low + g * BLK);
  }
}

void kivi4_keys(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a,
                int b, const Rope& rope, float* ranges, KiviKeys& t) {
  TORCH_CHECK(r.kind == AFFINE_CHANNELS && r.bits == 4 && r.pre_rope,
              "kvcache kernel: kivi4_keys of another codec");
  const int64_t D = r.D;
  code_rows(r, h, cells, a, b, t.rows);
  int32_t meta = -1;
  float* range = nullptr;
  for (int j = a; j < b; ++j) {
    const int32_t m = r.meta_of[cells[j]];
    if (m != meta || m < 0) {  // a new record: its rows converted once
      range = range == nullptr ? ranges : range + 2 * D;
      record_rows(r, cells[j], m, h, r.meta_a, r.meta_b, range, range + D);
      meta = m;
    }
    t.a[j] = range;
    t.b[j] = range + D;
    std::tie(t.cs[j], t.sn[j]) = rope_rows(rope, pos[j], D);
  }
}

}  // namespace kvk
