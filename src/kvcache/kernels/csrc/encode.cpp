// Encoders of the integer codecs: float32 rows -> codes, written straight into a buffer's
// cells (the torch expressions of src/kvcache/codecs/ints.py took ~20 small ops a call, and a
// decode step that seals a sequence's rows calls one per layer and K/V).
//
// For finite rows each equals its torch expression bit for bit: the same float32 operations in
// the same order (true division, never a reciprocal), round half to even, fp16 by round to
// nearest even (NaN rows, which no model should store, may code differently).
//   int8:   scale = fp16(max|x| / 127); q = clamp(round(x / max(scale, tiny)), -127, 127)
//   affine: per group of channels lo, hi = min, max; low = fp16(lo);
//           scale = fp16((hi - low) / levels); q = clamp(round((x - low) / max(scale, tiny)),
//           0, levels), packed little end first (kvcache.codecs.pack); with refits > 0 the
//           (low, scale) grid of least squared error among that one and its least-squares
//           refits, each kept within half a step of every value
//           (kvcache.codecs.ints.affine_ranges)
//   channels (KIVI keys, src/kvcache/codecs/kivi.py): a record's per-channel range over its
//           rows, lo, hi = min, max over rows; scale = fp16((hi - lo) / levels), low = fp16(lo);
//           a row's codes against its record: q = clamp(round((x - low) / max(scale, tiny)),
//           0, levels), packed as above
//   turbo (src/kvcache/codecs/quantizer.py, HeadStack): the mse path of a head's rotation and
//           codebook, every sum in a fixed order (pairwise halving of a zero-padded row, the
//           rotation as radix-2 butterflies) and no fused multiply-adds, so that the torch
//           expressions, which run the same elementwise operations, give the same bits
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "api.h"

namespace kvk {

namespace {

constexpr float HALF_TINY = 6.103515625e-05f;  // torch.finfo(torch.float16).tiny
constexpr int64_t GRAIN = 1024;                // rows (cell x head) a thread takes at least

float to_half(float v, c10::Half* out) {
  *out = c10::Half(v);
  return static_cast<float>(*out);
}

// v's affine code on the grid of lowest level ``low`` and step ``safe`` (>= tiny)
float affine_code(float v, float low, float safe, float levels) {
  return std::min(std::max(std::nearbyint((v - low) / safe), 0.f), levels);
}

// ids [n] int64 (cells or records), each in [0, bound)
void check_ids(const at::Tensor& ids, int64_t n, int64_t bound, const char* name,
               const char* each) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() &&
                  ids.size(0) == n,
              "kvcache encode: ", name, " must be a contiguous int64 [n] tensor");
  const int64_t* v = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(v[i] >= 0 && v[i] < bound, "kvcache encode: ", each, " ", v[i], " outside [0, ",
                bound, ")");
}

// x [n, H, D] float32 and cells [n] int64 < rows checked; returns n
int64_t check_rows(const at::Tensor& x, const at::Tensor& cells, int64_t rows, int64_t H,
                   int64_t D) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous() &&
                  x.size(1) == H && x.size(2) == D,
              "kvcache encode: x must be a contiguous float32 [n, ", H, ", ", D, "] tensor");
  check_ids(cells, x.size(0), rows, "cells", "cell");
  return x.size(0);
}

// codes q [count] (whole numbers < 2^bits, count a multiple of 8 / bits) packed little end
// first into count * bits / 8 bytes (kvcache.codecs.pack)
void pack_codes(const float* q, int64_t count, int64_t bits, uint8_t* out) {
  const int64_t per = 8 / bits;
  for (int64_t j = 0; j < count / per; ++j) {
    uint32_t byte = 0;
    for (int64_t k = 0; k < per; ++k) byte |= (uint32_t)q[j * per + k] << (bits * k);
    out[j] = (uint8_t)byte;
  }
}

void check_out(const at::Tensor& t, at::ScalarType type, int64_t rows, int64_t H, int64_t width,
               const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 3 && t.is_contiguous() && t.size(0) == rows &&
                  t.size(1) == H && t.size(2) == width,
              "kvcache encode: ", name, " must be a contiguous ", c10::toString(type), " [",
              rows, ", ", H, ", ", width, "] tensor");
}

// Codes [count] (each < 2^bits, bits 1..8) packed little end first into ceil(count * bits / 8)
// bytes (kvcache.codecs.pack's layout for any width)
void pack_bits(const uint8_t* q, int64_t count, int64_t bits, uint8_t* out) {
  uint64_t acc = 0;
  int64_t have = 0;
  for (int64_t i = 0; i < count; ++i) {
    acc |= (uint64_t)q[i] << have;
    for (have += bits; have >= 8; have -= 8, acc >>= 8) *out++ = (uint8_t)acc;
  }
  if (have > 0) *out = (uint8_t)acc;
}

constexpr int64_t MAX_PADDED = 1024;  // turbo rows of at most this many padded coordinates
constexpr int64_t TURBO_GRAIN = 64;   // turbo rows (cell x head) a thread takes at least

// v[0] + ... + v[P-1], P a power of two, by halving: v[i] += v[i + P/2], ... (the order of
// quantizer.fixed_sum), float32 roundings, never fused
__attribute__((optimize("fp-contract=off"))) float halving_sum(float* v, int64_t P) {
  for (int64_t h = P / 2; h >= 1; h /= 2)
    for (int64_t i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
  return v[0];
}

struct TurboTables {
  int64_t D, P, bits, width, grid_cells;
  float root, unit, grid, offset;  // sqrt(P), 1 / sqrt(P), 2^g, -GRID_LO * 2^g
  const uint8_t* cell_codes;       // [grid_cells]
  const float* cell_squares;       // [grid_cells]
};

// One row x [D] of head h (signs [P], offset o [D] or null) -> packed codes [width] and the
// flagged bf16 scale, as HeadStack._chunk's torch expressions compute them
__attribute__((optimize("fp-contract=off"))) void turbo_row(const float* x, const float* o,
                                                            const float* signs,
                                                            const TurboTables& t, uint8_t* out,
                                                            c10::BFloat16* scale) {
  const int64_t D = t.D, P = t.P;
  float v[MAX_PADDED], w[MAX_PADDED];
  bool flag = false;
  if (o != nullptr) {  // subtract the offset where that shrinks the row: 2 <x, o> > ||o||^2
    for (int64_t i = 0; i < P; ++i) v[i] = i < D ? x[i] * o[i] : 0.f;
    for (int64_t i = 0; i < P; ++i) w[i] = i < D ? o[i] * o[i] : 0.f;
    const float dots = halving_sum(v, P);
    flag = dots * 2.f > halving_sum(w, P);
  }
  for (int64_t i = 0; i < P; ++i) v[i] = (i < D ? (flag ? x[i] - o[i] : x[i]) : 0.f) * signs[i];
  for (int64_t h = 1; h < P; h *= 2)  // radix-2 butterflies, stage by stage
    for (int64_t j = 0; j < P; j += 2 * h)
      for (int64_t i = j; i < j + h; ++i) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
  for (int64_t i = 0; i < P; ++i) v[i] = v[i] * t.unit;
  for (int64_t i = 0; i < P; ++i) w[i] = v[i] * v[i];
  float norm = std::sqrt(halving_sum(w, P));  // IEEE sqrt: correctly rounded
  if (!std::isfinite(norm)) {  // squares past float32's range: at 2^-80 of the size (exact)
    for (int64_t i = 0; i < P; ++i) {
      const float small = v[i] * 0x1p-80f;
      w[i] = small * small;
    }
    norm = std::sqrt(halving_sum(w, P)) * 0x1p80f;
  }
  const float inv = 1.f / std::max(norm, 1e-30f);
  const float factor = inv * t.root * t.grid;
  uint8_t q[MAX_PADDED];
  const float last = (float)(t.grid_cells - 1) - t.offset;
  for (int64_t i = 0; i < P; ++i) {
    float cell = std::floor(v[i] * factor);
    if (!(cell >= -t.offset)) cell = -t.offset;  // NaN too (a row no model should store)
    if (cell > last) cell = last;
    const int64_t at = (int64_t)cell + (int64_t)t.offset;
    q[i] = t.cell_codes[at];
    w[i] = t.cell_squares[at];
  }
  const float length = std::max(std::sqrt(halving_sum(w, P)), 1e-30f);
  const float s = norm * t.root / length;
  *scale = c10::BFloat16(flag ? -s : s);
  pack_bits(q, P, t.bits, out);
}

}  // namespace

// codes int8 [N', H, D], scale fp16 [N', H, 1]: row i of x into cell cells[i]
void encode_int8(const at::Tensor& x, const at::Tensor& cells, at::Tensor& codes,
                 at::Tensor& scale) {
  const int64_t rows = codes.size(0), H = codes.size(1), D = codes.size(2);
  check_out(codes, at::kChar, rows, H, D, "codes");
  check_out(scale, at::kHalf, rows, H, 1, "scale");
  const int64_t n = check_rows(x, cells, rows, H, D);
  const float* xp = x.data_ptr<float>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  int8_t* qp = codes.data_ptr<int8_t>();
  c10::Half* sp = scale.data_ptr<c10::Half>();
  at::parallel_for(0, n * H, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * D;
      const int64_t at_ = cp[r / H] * H + r % H;
      float m = 0.f;
      for (int64_t i = 0; i < D; ++i) m = std::max(m, std::fabs(row[i]));
      const float safe = std::max(to_half(m / 127.f, sp + at_), HALF_TINY);
      int8_t* q = qp + at_ * D;
      for (int64_t i = 0; i < D; ++i)
        q[i] = (int8_t)std::min(std::max(std::nearbyint(row[i] / safe), -127.f), 127.f);
    }
  });
}

// A group's codes q [group] against (low, scale), and their squared error as decoded,
// (q * scale + low - v)^2 summed by halving over w [width] (zero-padded)
__attribute__((optimize("fp-contract=off"))) float affine_error(const float* v, int64_t group,
                                                                int64_t width, float levels,
                                                                float low, float scale, float* q,
                                                                float* w) {
  const float safe = std::max(scale, HALF_TINY);
  for (int64_t i = 0; i < group; ++i) {
    q[i] = affine_code(v[i], low, safe, levels);
    const float e = q[i] * scale + low - v[i];
    w[i] = e * e;
  }
  for (int64_t i = group; i < width; ++i) w[i] = 0.f;
  return halving_sum(w, width);
}

// sum of a[i] * b[i] (b null: of a[i]) over a group, by halving over w [width]
__attribute__((optimize("fp-contract=off"))) float group_sum(const float* a, const float* b,
                                                             int64_t group, int64_t width,
                                                             float* w) {
  for (int64_t i = 0; i < group; ++i) w[i] = b ? a[i] * b[i] : a[i];
  for (int64_t i = group; i < width; ++i) w[i] = 0.f;
  return halving_sum(w, width);
}

// Least-squares refits of a group's grid from (low, scale), both fp16 values, within the
// grids that keep every value within half a step of a level: the grid of least squared error
// is left in them (ints.affine_ranges, operation for operation)
__attribute__((optimize("fp-contract=off"))) void refit_range(const float* v, int64_t group,
                                                              float levels, int64_t refits,
                                                              float lo, float hi, float& low,
                                                              float& scale) {
  float q[256], w[256];
  int64_t width = 1;
  while (width < group) width *= 2;
  const float n = (float)group, sx = group_sum(v, nullptr, group, width, w);
  const float finest = (hi - lo) / (levels + 1.f), widest = (hi - lo) / levels;
  float best = affine_error(v, group, width, levels, low, scale, q, w);
  float best_low = low, best_scale = scale;
  for (int64_t k = 0; k < refits; ++k) {
    const float sq = group_sum(q, nullptr, group, width, w);
    const float sqq = group_sum(q, q, group, width, w);
    const float sqx = group_sum(q, v, group, width, w);
    const float det = n * sqq - sq * sq;  // exact: integer sums below 2^24
    if (!(det > 0.f)) break;              // codes all equal: no other grid (torch repeats this one)
    const float step = std::min(std::max((n * sqx - sq * sx) / det, finest), widest);
    const float base =
        std::min(std::max((sx - step * sq) / n, hi - (levels + 0.5f) * step), lo + 0.5f * step);
    scale = static_cast<float>(c10::Half(step));
    low = static_cast<float>(c10::Half(base));
    const float err = affine_error(v, group, width, levels, low, scale, q, w);
    if (err < best) {  // NaN never is
      best = err;
      best_low = low;
      best_scale = scale;
    }
  }
  low = best_low;
  scale = best_scale;
}

// codes uint8 [N', H, D * bits / 8], scale and low fp16 [N', H, D / group]
void encode_affine(const at::Tensor& x, const at::Tensor& cells, int64_t bits, int64_t group,
                   at::Tensor& codes, at::Tensor& scale, at::Tensor& low, int64_t refits) {
  TORCH_CHECK(bits == 2 || bits == 4, "kvcache encode: affine codes of 2 or 4 bits");
  TORCH_CHECK(refits >= 0 && refits <= 64, "kvcache encode: refits must be in 0..64");
  const int64_t rows = codes.size(0), H = codes.size(1), per = 8 / bits;
  const int64_t D = codes.size(2) * per;
  TORCH_CHECK(group > 0 && group <= 256 && D % group == 0 && group % per == 0,
              "kvcache encode: group must divide head_dim in whole bytes (at most 256 channels)");
  const int64_t groups = D / group;
  check_out(codes, at::kByte, rows, H, D / per, "codes");
  check_out(scale, at::kHalf, rows, H, groups, "scale");
  check_out(low, at::kHalf, rows, H, groups, "low");
  const int64_t n = check_rows(x, cells, rows, H, D);
  const float levels = (float)((1 << bits) - 1);
  const float* xp = x.data_ptr<float>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  uint8_t* qp = codes.data_ptr<uint8_t>();
  c10::Half* sp = scale.data_ptr<c10::Half>();
  c10::Half* lp = low.data_ptr<c10::Half>();
  at::parallel_for(0, n * H, GRAIN, [&](int64_t begin, int64_t end) {
    float q[256];  // one group's codes (group <= 256, checked above)
    for (int64_t r = begin; r < end; ++r) {
      const int64_t at_ = cp[r / H] * H + r % H;
      for (int64_t g = 0; g < groups; ++g) {
        const float* v = xp + r * D + g * group;
        float lo = v[0], hi = v[0];
        for (int64_t i = 1; i < group; ++i) {
          lo = std::min(lo, v[i]);
          hi = std::max(hi, v[i]);
        }
        float lowf = to_half(lo, lp + at_ * groups + g);
        float scalef = to_half((hi - lowf) / levels, sp + at_ * groups + g);
        if (refits > 0) {
          refit_range(v, group, levels, refits, lo, hi, lowf, scalef);
          lp[at_ * groups + g] = c10::Half(lowf);  // fp16 values: exact
          sp[at_ * groups + g] = c10::Half(scalef);
        }
        const float safe = std::max(scalef, HALF_TINY);
        for (int64_t i = 0; i < group; ++i)
          q[i] = affine_code(v[i], lowf, safe, levels);
        pack_codes(q, group, bits, qp + (at_ * D + g * group) / per);
      }
    }
  });
}

// Record ``meta`` of scale and low fp16 [M, H, D]: the channel ranges of rows x [m, H, D]
void range_channels(const at::Tensor& x, int64_t meta, int64_t bits, at::Tensor& scale,
                    at::Tensor& low) {
  TORCH_CHECK(bits >= 1 && bits <= 8, "kvcache encode: channel codes of 1 to 8 bits");
  const int64_t M = scale.size(0), H = scale.size(1), D = scale.size(2);
  check_out(scale, at::kHalf, M, H, D, "scale");
  check_out(low, at::kHalf, M, H, D, "low");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous() &&
                  x.size(0) > 0 && x.size(1) == H && x.size(2) == D,
              "kvcache encode: x must be a contiguous float32 [m > 0, ", H, ", ", D, "] tensor");
  TORCH_CHECK(meta >= 0 && meta < M, "kvcache encode: record ", meta, " outside [0, ", M, ")");
  const int64_t m = x.size(0), HD = H * D;
  const float levels = (float)((1 << bits) - 1);
  const float* xp = x.data_ptr<float>();
  c10::Half* sp = scale.data_ptr<c10::Half>() + meta * HD;
  c10::Half* lp = low.data_ptr<c10::Half>() + meta * HD;
  std::vector<float> lo(xp, xp + HD), hi(xp, xp + HD);
  for (int64_t r = 1; r < m; ++r)
    for (int64_t i = 0; i < HD; ++i) {
      lo[i] = std::min(lo[i], xp[r * HD + i]);
      hi[i] = std::max(hi[i], xp[r * HD + i]);
    }
  for (int64_t i = 0; i < HD; ++i) {
    to_half((hi[i] - lo[i]) / levels, sp + i);
    to_half(lo[i], lp + i);
  }
}

// Rows x [n, H, D] against their records metas [n] (scale, low fp16 [M, H, D]) into the
// packed codes uint8 [N', H, D * bits / 8] of cells [n] (bits 1, 2, 4 or 8)
void encode_channels(const at::Tensor& x, const at::Tensor& cells, const at::Tensor& metas,
                     int64_t bits, at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8,
              "kvcache encode: channel codes of 1, 2, 4 or 8 bits");
  const int64_t per = 8 / bits, rows = codes.size(0), H = codes.size(1);
  const int64_t D = codes.size(2) * per, M = scale.size(0);
  TORCH_CHECK(D <= 256, "kvcache encode: channel codes of at most 256 channels a head");
  check_out(codes, at::kByte, rows, H, D / per, "codes");
  check_out(scale, at::kHalf, M, H, D, "scale");
  check_out(low, at::kHalf, M, H, D, "low");
  const int64_t n = check_rows(x, cells, rows, H, D);
  check_ids(metas, n, M, "metas", "record");
  const int64_t* mp = metas.data_ptr<int64_t>();
  const float levels = (float)((1 << bits) - 1);
  const float* xp = x.data_ptr<float>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  uint8_t* qp = codes.data_ptr<uint8_t>();
  const c10::Half* sp = scale.data_ptr<c10::Half>();
  const c10::Half* lp = low.data_ptr<c10::Half>();
  at::parallel_for(0, n * H, GRAIN, [&](int64_t begin, int64_t end) {
    float q[256];  // one row's codes (D <= 256, checked above)
    for (int64_t r = begin; r < end; ++r) {
      const float* v = xp + r * D;
      const int64_t rec = (mp[r / H] * H + r % H) * D;
      for (int64_t i = 0; i < D; ++i) {
        const float safe = std::max(static_cast<float>(sp[rec + i]), HALF_TINY);
        const float lowf = static_cast<float>(lp[rec + i]);
        q[i] = affine_code(v[i], lowf, safe, levels);
      }
      pack_codes(q, D, bits, qp + (cp[r / H] * H + r % H) * (D / per));
    }
  });
}

// Turbo codes of rows x [n, H, D] into cells [n]: codes uint8 [N', H, ceil(P * bits / 8)] and
// scale bf16 [N', H, 1] (sign bit: the offset was subtracted); offsets float32 [n or 1, H, D]
// or an empty tensor (none); signs float32 [H, P]; cell_codes uint8 and cell_squares float32
// [G]: the codebook's grid of step 2^-grid_bits over [-8, 8)
void encode_turbo(const at::Tensor& x, const at::Tensor& cells, const at::Tensor& offsets,
                  const at::Tensor& signs, const at::Tensor& cell_codes,
                  const at::Tensor& cell_squares, int64_t grid_bits, int64_t bits,
                  at::Tensor& codes, at::Tensor& scale) {
  TORCH_CHECK(bits >= 1 && bits <= 8, "kvcache encode: turbo codes of 1 to 8 bits");
  TORCH_CHECK(grid_bits >= 0 && grid_bits <= 20, "kvcache encode: grid_bits outside [0, 20]");
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.dim() == 2 && signs.is_contiguous(),
              "kvcache encode: signs must be a contiguous float32 [H, P] tensor");
  const int64_t H = signs.size(0), P = signs.size(1);
  TORCH_CHECK(P >= 2 && P <= MAX_PADDED && (P & (P - 1)) == 0,
              "kvcache encode: turbo rows pad to a power of two in [2, ", MAX_PADDED, "]");
  const int64_t G = cell_codes.numel();
  TORCH_CHECK(cell_codes.scalar_type() == at::kByte && cell_codes.dim() == 1 &&
                  cell_codes.is_contiguous() && cell_squares.scalar_type() == at::kFloat &&
                  cell_squares.dim() == 1 && cell_squares.is_contiguous() &&
                  cell_squares.numel() == G && G == (int64_t(16) << grid_bits),
              "kvcache encode: cell_codes uint8 and cell_squares float32 must be contiguous [",
              int64_t(16) << grid_bits, "] tensors");
  const int64_t rows = codes.size(0), width = (P * bits + 7) / 8;
  TORCH_CHECK(x.dim() == 3 && x.size(2) >= 1 && x.size(2) <= P && (P == 2 || x.size(2) > P / 2),
              "kvcache encode: rows of ", P == 2 ? 1 : P / 2 + 1, " to ", P,
              " channels pad to ", P);
  const int64_t D = x.size(2);
  check_out(codes, at::kByte, rows, H, width, "codes");
  check_out(scale, at::kBFloat16, rows, H, 1, "scale");
  const int64_t n = check_rows(x, cells, rows, H, D);
  const bool centred = offsets.numel() > 0;
  if (centred)
    TORCH_CHECK(offsets.scalar_type() == at::kFloat && offsets.dim() == 3 &&
                    offsets.is_contiguous() && (offsets.size(0) == n || offsets.size(0) == 1) &&
                    offsets.size(1) == H && offsets.size(2) == D,
                "kvcache encode: offsets must be a contiguous float32 [", n, " or 1, ", H, ", ",
                D, "] tensor");
  const uint8_t* codes_of = cell_codes.data_ptr<uint8_t>();
  if (*std::max_element(codes_of, codes_of + G) >= (1 << bits)) {  // one vectorised pass
    const uint8_t* bad = std::find_if(codes_of, codes_of + G, [&](uint8_t c) { return c >> bits; });
    TORCH_CHECK(false, "kvcache encode: cell code ", (int)*bad, " of more than ", bits, " bits");
  }
  const float grid = std::ldexp(1.f, (int)grid_bits);
  const TurboTables t{D,    P,    bits,   width, G, (float)std::sqrt((double)P),
                      (float)(1.0 / std::sqrt((double)P)), grid, 8.f * grid, codes_of,
                      cell_squares.data_ptr<float>()};
  const float* xp = x.data_ptr<float>();
  const float* op = centred ? offsets.data_ptr<float>() : nullptr;
  const int64_t o_step = centred && offsets.size(0) == n ? H * D : 0;
  const float* sg = signs.data_ptr<float>();
  const int64_t* cp = cells.data_ptr<int64_t>();
  uint8_t* qp = codes.data_ptr<uint8_t>();
  c10::BFloat16* spp = scale.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n * H, TURBO_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / H, h = r % H, at_ = cp[i] * H + h;
      const float* o = op == nullptr ? nullptr : op + i * o_step + h * D;
      turbo_row(xp + r * D, o, sg + h * P, t, qp + at_ * width, spp + at_);
    }
  });
}

}  // namespace kvk
