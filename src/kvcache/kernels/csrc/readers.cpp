// Codec readers (see readers.h and src/kvcache/kernels/layout.py for the layouts).
#include "readers.h"

#include <cmath>

namespace kvk {

namespace {

template <typename T>
const T* ptr(const at::Tensor& t) {
  return t.numel() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

// turbo's log-coded norms: code 0 = 0, code c = 2^((c - 1) / 8 - 16)
inline float log_scale_value(uint8_t c) {
  return c == 0 ? 0.f : std::exp2((float)(c - 1) / 8.f - 16.f);
}

inline void apply_rope(const Rope& rope, int64_t pos, float* x, int64_t D) {
  TORCH_CHECK(pos >= 0 && pos < rope.count, "kvcache kernel: position ", pos,
              " outside the RoPE tables (", rope.count, ")");
  const int64_t half = D / 2;
  const float* c = rope.cos + pos * half;
  const float* s = rope.sin + pos * half;
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

// fp16 window row of a cell, or nullptr when the cell is stored as codes
inline const uint16_t* window_row(const Reader& r, int64_t c, int64_t h) {
  if (r.window == nullptr) return nullptr;
  TORCH_CHECK(c < r.window_len, "kvcache kernel: cell ", c, " outside the window map");
  const int32_t slot = r.window[c];
  if (slot < 0) return nullptr;
  TORCH_CHECK(slot < r.residual_rows, "kvcache kernel: window slot ", slot, " out of range");
  return r.residual + ((int64_t)slot * r.H + h) * r.D;
}

// fp16 record row [D] of a cell's metadata (centre / channel scale), or nullptr
inline const uint16_t* meta_row(const Reader& r, const uint16_t* table, int64_t c, int64_t h) {
  if (table == nullptr) return nullptr;
  const int64_t m = r.meta_of[c];
  TORCH_CHECK(m >= 0 && m < r.meta_rows, "kvcache kernel: cell ", c, " has no metadata (", m, ")");
  return table + (m * r.H + h) * r.D;
}

inline void add_half(const uint16_t* src, float* x, int64_t D) {
  float tmp[256];
  half_row(src, tmp, (int)D);
  for (int64_t i = 0; i < D; ++i) x[i] += tmp[i];
}

void decode_int8(const Reader& r, const uint8_t* codes, uint16_t scale_bits, float* out) {
  const int8_t* q = reinterpret_cast<const int8_t*>(codes);
  const float s = half_to_float(scale_bits);
#if KVK_AVX2
  const __m256 sv = _mm256_set1_ps(s);
  for (int64_t i = 0; i < r.D; i += 8) {
    __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sv));
  }
#else
  for (int64_t i = 0; i < r.D; ++i) out[i] = (float)q[i] * s;
#endif
}

// 4-bit codes (low nibble = even index) -> floats q in 0..15
inline void unpack4(const uint8_t* codes, float* out, int64_t D) {
#if KVK_AVX2
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int64_t i = 0; i < D; i += 16) {
    __m128i b = _mm_loadl_epi64((const __m128i*)(codes + i / 2));  // 8 bytes = 16 codes
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m128i q = _mm_unpacklo_epi8(lo, hi);  // 16 codes in order
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)));
    _mm256_storeu_ps(out + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))));
  }
#else
  for (int64_t i = 0; i < D; i += 2) {
    out[i] = (float)(codes[i / 2] & 15);
    out[i + 1] = (float)(codes[i / 2] >> 4);
  }
#endif
}

// 2-bit codes (4 per byte, little end first) -> floats q in 0..3
inline void unpack2(const uint8_t* codes, float* out, int64_t D) {
  for (int64_t i = 0; i < D; ++i) out[i] = (float)((codes[i / 4] >> (2 * (i % 4))) & 3);
}

inline void unpack_bits(const uint8_t* codes, int64_t bits, float* out, int64_t D) {
  if (bits == 4) {
    unpack4(codes, out, D);
  } else {
    unpack2(codes, out, D);
  }
}

// out = q * scale + low with one (scale, low) per group of `group` channels (fp16 metadata)
inline void affine_groups(float* x, const uint16_t* scale, const uint16_t* low, int64_t group,
                          int64_t D) {
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    const float s = half_to_float(scale[g0 / group]), m = half_to_float(low[g0 / group]);
#if KVK_AVX2
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
    for (int64_t i = g0; i < g0 + group; i += 8)
      _mm256_storeu_ps(x + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), sv, mv));
#else
    for (int64_t i = g0; i < g0 + group; ++i) x[i] = x[i] * s + m;
#endif
  }
}

// turbo: packed b-bit codes (code i at bits [i*b, (i+1)*b), little-endian) -> centroids
void turbo_levels(const uint8_t* codes, int64_t bits, const float* centroids, float* out,
                  int64_t P) {
  uint8_t buf[80] = {0};
  const int64_t width = (P * bits + 7) / 8;
  std::memcpy(buf, codes, (size_t)width);
  const uint64_t mask = (1u << bits) - 1;
#if KVK_AVX2
  if (bits >= 3) {
    // 8 codes per `bits` bytes: broadcast the 64-bit word, shift each lane by its offset
    const __m256i sh_lo = _mm256_set_epi64x(3 * bits, 2 * bits, bits, 0);
    const __m256i sh_hi = _mm256_set_epi64x(7 * bits, 6 * bits, 5 * bits, 4 * bits);
    const __m256i m64 = _mm256_set1_epi64x((long long)mask);
    const __m256i pack = _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0);
    for (int64_t i = 0; i < P; i += 8) {
      uint64_t w;
      std::memcpy(&w, buf + i / 8 * bits, 8);
      __m256i wv = _mm256_set1_epi64x((long long)w);
      __m256i a = _mm256_and_si256(_mm256_srlv_epi64(wv, sh_lo), m64);
      __m256i b = _mm256_and_si256(_mm256_srlv_epi64(wv, sh_hi), m64);
      // low 32 bits of each 64-bit lane: a0 a1 a2 a3 b0 b1 b2 b3
      __m256i ab = _mm256_permutevar8x32_epi32(
          _mm256_blend_epi32(a, _mm256_slli_epi64(b, 32), 0xAA), pack);
      _mm256_storeu_ps(out + i, _mm256_i32gather_ps(centroids, ab, 4));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < P; ++i) {
    uint64_t w;
    std::memcpy(&w, buf + (i * bits) / 8, 8);
    out[i] = centroids[(w >> ((i * bits) % 8)) & mask];
  }
}

}  // namespace

void prefetch(const Reader& r, int64_t h, const int32_t* cells, int n) {
#if KVK_AVX2
  for (int j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(r.data + cells[j] * r.data_cell + h * r.data_head);
    for (int64_t off = 0; off < r.data_head; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
  }
#else
  (void)r, (void)h, (void)cells, (void)n;
#endif
}

void turbo_unrotate(const float* signs, float* y, int64_t P) {
  // orthonormal Walsh-Hadamard transform (Sylvester order), then the sign flips
  for (int64_t len = 1; len < P; len <<= 1) {
    for (int64_t i = 0; i < P; i += 2 * len) {
      for (int64_t j = i; j < i + len; ++j) {
        const float a = y[j], b = y[j + len];
        y[j] = a + b;
        y[j + len] = a - b;
      }
    }
  }
  const float norm = 1.f / std::sqrt((float)P);
  for (int64_t i = 0; i < P; ++i) y[i] *= norm * signs[i];
}

Reader make_reader(const std::vector<at::Tensor>& t, const std::vector<int64_t>& ints, int64_t H,
                   int64_t D) {
  TORCH_CHECK(t.size() == NUM_SLOTS && ints.size() == NUM_INTS, "kvcache kernel: bad layout");
  Reader r;
  r.kind = ints[KIND];
  r.bits = ints[BITS];
  r.group = ints[GROUP];
  r.log_scale = ints[LOG_SCALE] != 0;
  r.pre_rope = ints[PRE_ROPE] != 0;
  r.rotated = ints[ROTATED] != 0;
  r.H = H;
  r.D = D;
  TORCH_CHECK(D % 16 == 0 && D <= 256, "kvcache kernel: head_dim must be a multiple of 16, <= 256");
  for (const at::Tensor& x : t)
    TORCH_CHECK(!x.numel() || (x.is_contiguous() && x.device().is_cpu()),
                "kvcache kernel: layout tensors must be contiguous CPU tensors");
  const at::Tensor& data = t[DATA];
  TORCH_CHECK(data.dim() == 3 && data.size(1) == H, "kvcache kernel: storage must be [N, H, *]");
  r.data = ptr<uint8_t>(data);
  r.rows = data.size(0);
  r.data_head = data.size(2) * data.element_size();
  r.data_cell = H * r.data_head;
  r.scale = ptr<uint16_t>(t[SCALE]);
  r.low = ptr<uint16_t>(t[LOW]);
  if (t[SCALE].numel()) {
    TORCH_CHECK(t[SCALE].dim() == 3 && t[SCALE].size(0) == r.rows, "kvcache kernel: bad scale");
    r.scale_head = t[SCALE].size(2);
  }
  r.meta_of = ptr<int32_t>(t[META_OF]);
  r.meta_a = ptr<uint16_t>(t[META_A]);
  r.meta_b = ptr<uint16_t>(t[META_B]);
  r.meta_rows = t[META_A].numel() ? t[META_A].size(0) : 0;
  TORCH_CHECK(r.meta_a == nullptr || r.meta_of != nullptr, "kvcache kernel: records need meta_of");
  r.window = ptr<int32_t>(t[WINDOW]);
  r.window_len = t[WINDOW].numel();
  r.residual = ptr<uint16_t>(t[RESIDUAL]);
  r.residual_rows = t[RESIDUAL].numel() ? t[RESIDUAL].size(0) : 0;
  r.centroids = ptr<float>(t[CENTROIDS]);
  r.signs = ptr<float>(t[SIGNS]);
  r.direct = r.kind == F32 && !r.pre_rope;
  return r;
}

void decode(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a, int b,
            float* tile, const float** rows, uint8_t* dom, const Rope& rope) {
  const int64_t D = r.D;
  for (int j = a; j < b; ++j) {
    const int64_t c = cells[j];
    float* out = tile + (int64_t)j * D;
    dom[j] = 0;
    rows[j] = out;
    if (const uint16_t* w = window_row(r, c, h)) {  // a row of its sequence's recent window
      half_row(w, out, (int)D);
      if (r.pre_rope) apply_rope(rope, pos[j], out, D);
      continue;
    }
    TORCH_CHECK(c < r.rows, "kvcache kernel: cell ", c, " has no codes (", r.rows, " rows)");
    const uint8_t* row = r.data + c * r.data_cell + h * r.data_head;
    const int64_t m = (c * r.H + h) * r.scale_head;  // per-row metadata
    switch (r.kind) {
      case F32:
        if (r.direct) {
          rows[j] = reinterpret_cast<const float*>(row);
          continue;
        }
        std::memcpy(out, row, (size_t)D * 4);
        break;
      case F16:
        half_row(reinterpret_cast<const uint16_t*>(row), out, (int)D);
        break;
      case BF16:
        bf16_row(reinterpret_cast<const uint16_t*>(row), out, (int)D);
        break;
      case INT8:
        decode_int8(r, row, r.scale[m], out);
        break;
      case AFFINE_ROWS: {
        unpack_bits(row, r.bits, out, D);
        affine_groups(out, r.scale + m, r.low + m, D / r.scale_head, D);
        if (const uint16_t* centre = meta_row(r, r.meta_a, c, h)) add_half(centre, out, D);
        break;
      }
      case AFFINE_CHANNELS: {
        unpack_bits(row, r.bits, out, D);
        float s[256], lo[256];
        half_row(meta_row(r, r.meta_a, c, h), s, (int)D);
        half_row(meta_row(r, r.meta_b, c, h), lo, (int)D);
        fma_rows(out, s, lo, out, (int)D);
        break;
      }
      case TURBO: {
        turbo_levels(row, r.bits, r.centroids, out, D);
        const float s = r.log_scale
                            ? log_scale_value(reinterpret_cast<const uint8_t*>(r.scale)[m])
                            : bf16_to_float(r.scale[m] & 0x7fff);  // sign bit: QJL flag, unused
        scale_row(s, out, (int)D);
        if (r.rotated) {
          dom[j] = 1;
          continue;  // values: summed in the rotated domain, rotated back once
        }
        turbo_unrotate(r.signs + h * D, out, D);
        if (const uint16_t* centre = meta_row(r, r.meta_a, c, h)) add_half(centre, out, D);
        break;
      }
      default:
        TORCH_CHECK(false, "kvcache kernel: unknown codec kind ", r.kind);
    }
    if (r.pre_rope) apply_rope(rope, pos[j], out, D);
  }
}

}  // namespace kvk
