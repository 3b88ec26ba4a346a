// The attention kernel's tile paths: how a tile's keys are scored and its values summed,
// one row of a table per path (as ggml reaches each type through type_traits_cpu). A row says
// which tiles it fits (a codec kind, its bits, where its rows are: all in the codes, all fp16),
// how a head's rows are loaded for the tile, and how they are scored or summed. attend_item
// (attention.cpp) takes the first row of each table that fits a tile; the last row, decoded
// rows, fits every tile. Rows that read codes as they are exist only where AVX2 is: the plain
// build decodes every tile. Why each path exists and what it measured: docs/design/kernels.md.
#pragma once

#include <cmath>
#include <vector>

#include "readers.h"
#include "tiles.h"

namespace kvk {

// A worker thread's buffers, kept between calls (no allocation in a decode step); rows of a
// work item are (h * ne + e) * G + g: head h, entry e, query head g of the group.
struct Scratch {
  std::vector<float> q, m, l, acc, accr, ktile, vtile;
  std::vector<float> sc;  // [H * R, BLK]: each row's scores, then its softmax weights
  std::vector<const float*> krows, vrows;
  std::vector<const int8_t*> kcodes, vcodes;  // int8 tiles read from the codes
  std::vector<const uint8_t*> knib, vnib;     // 4-bit rows read from the codes
  std::vector<const uint16_t*> khalf, vhalf;  // fp16 rows (window or fp16 storage)
  std::vector<float> kscale, klow, vscale, vlow, pw, dots;
  std::vector<float> qsum;  // [H * R, groups]: the scaled query's sums over key channel groups
  std::vector<int16_t> q16;   // [H * R, D]: the scaled query in int16 steps, for 4-bit keys
  std::vector<float> qscale;  // [H * R]: ... their size (tiles.h, quantize_query16)
  KiviKeys kivi;               // KIVI key rows read as they are
  TurboRows turbo, turbov;     // turbo key and value rows read as they are
  std::vector<float> qrot;     // [H * R, D]: the scaled query in turbo's codes' domain
  std::vector<float> ranges;   // [BLK, 2, D]: their records' channel ranges as floats
  std::vector<uint8_t> kdom, vdom;
  std::vector<int> ja, jb;
  LineStream stream;  // the next tile's rows and fields, fetched while this tile's math runs
  float sink = 0.f;  // keeps touch()'s loads
};

// One tile of a work item as the paths see it: the readers, the tile's cells [a, b) and their
// positions, the item's shapes (ne entries, G query heads per KV head, R = ne * G rows per KV
// head), its scratch (w.ja / w.jb: each entry's visible cells) and the next tile's stream.
struct TileCtx {
  const Reader& kr;
  const Reader& vr;
  const Rope& rope;
  const int32_t* cells;
  const int32_t* pos;
  int a, b;
  int64_t ne, G, R, D, Dv;
  Scratch& w;
  LineStream* ls;
};

// A key path: fits(reader, the tile's cells, their count); scores(tile): for every head, its
// rows loaded, each entry's scores sc[g * BLK + j] of its cells, and the softmax update of its
// rows (key_tile below: one call a tile through the table, not one per head and entry).
struct KeyPath {
  const char* name;
  bool (*fits)(const Reader& kr, const int32_t* cells, int n);
  void (*scores)(const TileCtx& t);
};

// A value path: fits as above; add(tile): every head's entries' weighted value rows (the
// weights the softmax update left in sc) added to their sums.
struct ValuePath {
  const char* name;
  bool (*fits)(const Reader& vr, const int32_t* cells, int n);
  void (*add)(const TileCtx& t);
};

// 4-bit affine codes read as they are: groups of a multiple of `step` channels
inline bool affine4_direct(const Reader& r, int64_t step) {
  return r.kind == AFFINE_ROWS && r.bits == 4 && (r.D / r.scale_head) % step == 0;
}

// 4-bit affine keys scored against int16 queries (qk4_rows): blocks of 64 channels whose
// halves each lie in one channel group
inline bool affine4_keys_direct(const Reader& r) {
  return affine4_direct(r, 32) && r.D % 64 == 0;
}

namespace paths {

// the first query row of entry e of head h, and its scores [G, BLK] (every head's apart)
inline int64_t first_row(const TileCtx& t, int64_t h, int64_t e) { return (h * t.ne + e) * t.G; }
inline float* scores(const TileCtx& t, int64_t h, int64_t e) {
  return t.w.sc.data() + first_row(t, h, e) * BLK;
}

// ---- keys ------------------------------------------------------------------------------

// KIVI 4-bit keys stored before RoPE, all in the codes: decoded and rotated in registers as
// they are scored
inline bool kivi4_fits(const Reader& kr, const int32_t* cells, int n) {
  return KVK_AVX2 && kr.kind == AFFINE_CHANNELS && kr.bits == 4 && kr.pre_rope &&
         all_codes(kr, cells, n);
}
__attribute__((flatten)) inline void kivi4_load(const TileCtx& t, int64_t h) {
  kivi4_keys(t.kr, h, t.cells, t.pos, t.a, t.b, t.rope, t.w.ranges.data(), t.w.kivi);
}
template <bool HALF>
__attribute__((flatten)) inline void rope_score(const TileCtx& t, int64_t h, int64_t e) {
#if KVK_AVX2
  qk_kivi_rows(t.w.q.data() + first_row(t, h, e) * t.D, (int)t.G, t.w.kivi, t.w.ja[e], t.w.jb[e],
               (int)t.D, scores(t, h, e), t.ls, HALF);
#else
  (void)t, (void)h, (void)e;
#endif
}

// fp16 keys stored before RoPE (a window tile, or fp16 storage): rotated in registers as
// they are scored
inline bool half_rope_fits(const Reader& kr, const int32_t* cells, int n) {
  return KVK_AVX2 && kr.pre_rope && all_half(kr, cells, n);
}
__attribute__((flatten)) inline void half_rope_load(const TileCtx& t, int64_t h) {
  rope_half_keys(t.kr, h, t.cells, t.pos, t.a, t.b, t.rope, t.w.kivi);
}

// fp16 keys after RoPE (a window tile, or fp16 storage): converted as the tile math loads them
inline bool half_keys_fits(const Reader& kr, const int32_t* cells, int n) {
  return KVK_AVX2 && !kr.pre_rope && all_half(kr, cells, n);
}
__attribute__((flatten)) inline void half_keys_load(const TileCtx& t, int64_t h) {
  half_rows(t.kr, h, t.cells, t.a, t.b, t.w.khalf.data());
}
__attribute__((flatten)) inline void half_keys_score(const TileCtx& t, int64_t h, int64_t e) {
  qk_rows<HalfRows>(t.w.q.data() + first_row(t, h, e) * t.D, (int)t.G, t.w.khalf.data(),
                    t.w.ja[e], t.w.jb[e], (int)t.D, scores(t, h, e), 0, -1, t.ls);
}

// int8 keys after RoPE, all in the codes: the codes against the int16 query, times the scales
inline bool int8_keys_fits(const Reader& kr, const int32_t* cells, int n) {
  return KVK_AVX2 && !kr.pre_rope && kr.kind == INT8 && all_codes(kr, cells, n);
}
__attribute__((flatten)) inline void int8_keys_load(const TileCtx& t, int64_t h) {
  int8_rows(t.kr, h, t.cells, t.a, t.b, t.w.kcodes.data(), t.w.kscale.data());
}
__attribute__((flatten)) inline void int8_keys_score(const TileCtx& t, int64_t h, int64_t e) {
  const int ja = t.w.ja[e], jb = t.w.jb[e];
  const int64_t r0 = first_row(t, h, e);
  float* sc0 = scores(t, h, e);
#if KVK_AVX2
  qk8_rows(t.w.q16.data() + r0 * t.D, t.w.qscale.data() + r0, (int)t.G, (int)t.D,
           t.w.kcodes.data(), ja, jb, sc0, t.ls);
#endif
  for (int64_t g = 0; g < t.G; ++g) mul_rows(t.w.kscale.data() + ja, sc0 + g * BLK + ja, jb - ja);
}

// 4-bit affine keys after RoPE, all in the codes (k = code * scale + low per group of
// channels, plus the sequence's key centre): the codes against the int16 query, each group's
// part times the cells' scales (qk4_rows), plus the cells' minimums times the query's sum over
// each group; then the centre's dot
inline bool affine4_keys_fits(const Reader& kr, const int32_t* cells, int n) {
  return KVK_AVX2 && !kr.pre_rope && affine4_keys_direct(kr) && all_codes(kr, cells, n);
}
__attribute__((flatten)) inline void affine4_keys_load(const TileCtx& t, int64_t h) {
  affine4_rows(t.kr, h, t.cells, t.a, t.b, t.w.knib.data(), t.w.kscale.data(), t.w.klow.data());
}
__attribute__((flatten)) inline void affine4_keys_score(const TileCtx& t, int64_t h, int64_t e) {
  Scratch& w = t.w;
  const int ja = w.ja[e], jb = w.jb[e];
  const int64_t groups = t.kr.scale_head, width = t.D / groups, r0 = first_row(t, h, e);
  const float* q0 = w.q.data() + r0 * t.D;
  float* sc0 = scores(t, h, e);
#if KVK_AVX2
  qk4_rows(w.q16.data() + r0 * t.D, w.qscale.data() + r0, (int)t.G, (int)t.D, w.knib.data(), ja,
           jb, w.kscale.data(), (int)width, sc0, t.ls);
#endif
  for (int64_t gr = 0; gr < groups; ++gr) {
    const float* lo = w.klow.data() + gr * BLK;
    for (int64_t g = 0; g < t.G; ++g) {
      const float qs = w.qsum[(r0 + g) * groups + gr];
      float* sc = sc0 + g * BLK;
      for (int j = ja; j < jb; ++j) sc[j] += lo[j] * qs;
    }
  }
  if (t.kr.meta_a != nullptr)
    add_centre_scores(t.kr, h, t.cells, ja, jb, q0, (int)t.G, w.dots.data(), sc0);
}

// turbo keys after RoPE, all in the codes: the query in the codes' domain against the codebook
// levels (int16 products where the levels lie on int16 steps, else floats), plus the centre
inline bool turbo_keys_fits(const Reader& kr, const int32_t* cells, int n) {
  return turbo_keys_direct(kr) && all_codes(kr, cells, n);
}
__attribute__((flatten)) inline void turbo_keys_load(const TileCtx& t, int64_t h) {
  turbo_keys(t.kr, h, t.cells, t.pos, t.a, t.b, t.rope, t.w.q.data() + h * t.R * t.D, (int)t.R,
             t.w.turbo);
}
__attribute__((flatten)) inline void turbo_keys_score(const TileCtx& t, int64_t h, int64_t e) {
  Scratch& w = t.w;
  const int ja = w.ja[e], jb = w.jb[e];
  const int64_t r0 = first_row(t, h, e);
  float* sc0 = scores(t, h, e);
  if (KVK_AVX2 && turbo_keys16(t.kr) && w.turbo.exact16)
    qk_turbo16_rows(t.kr, w.q16.data() + r0 * t.D, w.qscale.data() + r0, (int)t.G,
                    (int)(e * t.G), w.turbo, ja, jb, sc0, t.ls);
  else  // float levels (off the int16 grid, or other bits)
    qk_turbo_rows(t.kr, w.qrot.data() + r0 * t.D, (int)t.G, (int)(e * t.G), w.turbo, ja, jb, sc0,
                  t.ls);
  if (t.kr.meta_a != nullptr && !t.kr.centre_rope)  // a centre as it is
    add_centre_scores(t.kr, h, t.cells, ja, jb, w.q.data() + r0 * t.D, (int)t.G, w.dots.data(),
                      sc0);
}

// any keys, decoded into the tile first (RoPE applied where they were stored before it)
inline bool any_fits(const Reader&, const int32_t*, int) { return true; }
__attribute__((flatten)) inline void decoded_keys_load(const TileCtx& t, int64_t h) {
  decode(t.kr, h, t.cells, t.pos, t.a, t.b, t.w.ktile.data(), t.w.krows.data(), t.w.kdom.data(),
         t.rope);
}
__attribute__((flatten)) inline void decoded_keys_score(const TileCtx& t, int64_t h, int64_t e) {
  qk_rows(t.w.q.data() + first_row(t, h, e) * t.D, (int)t.G, t.w.krows.data(), t.w.ja[e],
          t.w.jb[e], (int)t.D, scores(t, h, e), 0, -1, t.ls);
}

// ---- values ----------------------------------------------------------------------------

// fp16 values (a window tile, or fp16 storage): converted as the tile math loads them
inline bool half_values_fits(const Reader& vr, const int32_t* cells, int n) {
  return KVK_AVX2 && all_half(vr, cells, n);  // window rows are never rotated
}
__attribute__((flatten)) inline void half_values_add(const TileCtx& t, int64_t h) {
  Scratch& w = t.w;
  half_rows(t.vr, h, t.cells, t.a, t.b, w.vhalf.data());
  for (int64_t e = 0; e < t.ne; ++e)
    if (w.ja[e] < w.jb[e])
      pv_rows<HalfRows>(scores(t, h, e), (int)t.G, w.vhalf.data(), w.ja[e], w.jb[e], (int)t.Dv,
                        w.acc.data() + (h * t.ne + e) * t.G * t.Dv, 0, -1, t.ls);
}

// turbo values, all in the codes: rotated-domain sums of the weights times the norms against
// the levels (rotated back once per output row, in the merge)
inline bool turbo_values_fits(const Reader& vr, const int32_t* cells, int n) {
  return turbo_values_direct(vr) && all_codes(vr, cells, n);
}
__attribute__((flatten)) inline void turbo_values_add(const TileCtx& t, int64_t h) {
  Scratch& w = t.w;
  turbo_values(t.vr, h, t.cells, t.a, t.b, w.turbov);
  for (int64_t e = 0; e < t.ne; ++e) {
    const int ja = w.ja[e], jb = w.jb[e];
    if (ja >= jb) continue;
    float* p0 = scores(t, h, e);
    for (int64_t g = 0; g < t.G; ++g) mul_rows(w.turbov.s + ja, p0 + g * BLK + ja, jb - ja);
    pv_turbo_rows(t.vr, p0, (int)t.G, w.turbov, ja, jb,
                  w.accr.data() + (h * t.ne + e) * t.G * t.Dv, t.ls);
  }
}

// int8 values, all in the codes: the weights times the value scales against the codes
inline bool int8_values_fits(const Reader& vr, const int32_t* cells, int n) {
  return KVK_AVX2 && !vr.rotated && vr.kind == INT8 && all_codes(vr, cells, n);
}
__attribute__((flatten)) inline void int8_values_add(const TileCtx& t, int64_t h) {
  Scratch& w = t.w;
  int8_rows(t.vr, h, t.cells, t.a, t.b, w.vcodes.data(), w.vscale.data());
  for (int64_t e = 0; e < t.ne; ++e) {
    const int ja = w.ja[e], jb = w.jb[e];
    if (ja >= jb) continue;
    float* p0 = scores(t, h, e);
    for (int64_t g = 0; g < t.G; ++g) mul_rows(w.vscale.data() + ja, p0 + g * BLK + ja, jb - ja);
    pv_rows<Int8Rows>(p0, (int)t.G, w.vcodes.data(), ja, jb, (int)t.Dv,
                      w.acc.data() + (h * t.ne + e) * t.G * t.Dv, 0, -1, t.ls);
  }
}

// 4-bit affine values, all in the codes, without a centre (x = code * scale + low per group of
// channels): per group, the weights times the cells' scales against the packed codes as they
// are (NibbleRows: no staged copy), plus the weighted sum of the cells' minimums
inline bool affine4_values_fits(const Reader& vr, const int32_t* cells, int n) {
  return KVK_AVX2 && !vr.rotated && affine4_direct(vr, 16) && vr.meta_a == nullptr &&
         all_codes(vr, cells, n);
}
__attribute__((flatten)) inline void affine4_values_add(const TileCtx& t, int64_t h) {
  Scratch& w = t.w;
  affine4_rows(t.vr, h, t.cells, t.a, t.b, w.vnib.data(), w.vscale.data(), w.vlow.data());
  const int64_t groups = t.vr.scale_head, width = t.Dv / groups;
  for (int64_t e = 0; e < t.ne; ++e) {
    const int ja = w.ja[e], jb = w.jb[e];
    if (ja >= jb) continue;
    const float* p0 = scores(t, h, e);
    float* acc = w.acc.data() + (h * t.ne + e) * t.G * t.Dv;
    for (int64_t gr = 0; gr < groups; ++gr) {
      for (int64_t g = 0; g < t.G; ++g) {
        const float bias =
            scaled_weights(p0 + g * BLK + ja, w.vscale.data() + gr * BLK + ja,
                           w.vlow.data() + gr * BLK + ja, w.pw.data() + g * BLK + ja, jb - ja);
        add_const(bias, acc + g * t.Dv + gr * width, (int)width);
      }
      pv_rows<NibbleRows>(w.pw.data(), (int)t.G, w.vnib.data(), ja, jb, (int)t.Dv, acc,
                          (int)(gr * width), (int)((gr + 1) * width), t.ls);
    }
  }
}

// any values, decoded into the tile first; turbo rows decoded in their rotated domain are
// summed apart (all a tile's rows or none; a mix row by row)
__attribute__((flatten)) inline void decoded_values_add(const TileCtx& t, int64_t h) {
  Scratch& w = t.w;
  const int a = t.a, b = t.b;
  const int64_t G = t.G, Dv = t.Dv;
  decode(t.vr, h, t.cells, t.pos, a, b, w.vtile.data(), w.vrows.data(), w.vdom.data(), t.rope);
  int rotated = 0;
  for (int j = a; j < b; ++j) rotated += w.vdom[j] != 0;
  for (int64_t e = 0; e < t.ne; ++e) {
    const int ja = w.ja[e], jb = w.jb[e];
    if (ja >= jb) continue;
    const int64_t r0 = first_row(t, h, e);
    if (rotated == 0 || rotated == b - a) {
      float* acc = (rotated ? w.accr.data() : w.acc.data()) + r0 * Dv;
      pv_rows(scores(t, h, e), (int)G, w.vrows.data(), ja, jb, (int)Dv, acc, 0, -1, t.ls);
      continue;
    }
    for (int j = ja; j < jb; ++j) {  // a mix (not cut by uniform_prefix): row by row
      float* dst = (w.vdom[j] ? w.accr.data() : w.acc.data()) + r0 * Dv;
      for (int64_t g = 0; g < G; ++g)
        axpy(w.sc[(r0 + g) * BLK + j], w.vrows[j], dst + g * Dv, (int)Dv);
    }
  }
}

// the online softmax update of entry e of head h from its scores: each row's running max,
// sum and value sums rescaled where the tile raised the max, the scores turned into weights
inline void softmax_update(const TileCtx& t, int64_t h, int64_t e) {
  Scratch& w = t.w;
  const int ja = w.ja[e], jb = w.jb[e];
  const int64_t Dv = t.Dv;
  for (int64_t r = first_row(t, h, e), end = r + t.G; r < end; ++r) {
    float* sc = w.sc.data() + r * BLK;
    const float bm = row_max(sc + ja, jb - ja, w.m[r]);
    if (bm > w.m[r]) {
      const float f = std::exp(w.m[r] - bm);  // 0 when the old max is -inf
      w.l[r] *= f;
      scale_row(f, w.acc.data() + r * Dv, (int)Dv);
      if (t.vr.rotated) scale_row(f, w.accr.data() + r * Dv, (int)Dv);
      w.m[r] = bm;
    }
    w.l[r] += exp_shift_sum(sc + ja, jb - ja, bm);
  }
}

// a key path's one call a tile: per head, LOAD its rows, then per entry SCORE and update
template <void (*LOAD)(const TileCtx&, int64_t), void (*SCORE)(const TileCtx&, int64_t, int64_t)>
void key_tile(const TileCtx& t) {
  for (int64_t h = 0; h < t.kr.H; ++h) {
    LOAD(t, h);
    for (int64_t e = 0; e < t.ne; ++e) {
      if (t.w.ja[e] >= t.w.jb[e]) continue;
      SCORE(t, h, e);
      softmax_update(t, h, e);
    }
  }
}

// a value path's one call a tile: ADD per head
template <void (*ADD)(const TileCtx&, int64_t)>
void value_tile(const TileCtx& t) {
  for (int64_t h = 0; h < t.vr.H; ++h) ADD(t, h);
}

}  // namespace paths

// The tables, in the order they are tried: the first row that fits a tile reads it.
inline constexpr KeyPath KEY_PATHS[] = {
    {"kivi4 before RoPE", paths::kivi4_fits,
     paths::key_tile<paths::kivi4_load, paths::rope_score<false>>},
    {"fp16 before RoPE", paths::half_rope_fits,
     paths::key_tile<paths::half_rope_load, paths::rope_score<true>>},
    {"fp16", paths::half_keys_fits, paths::key_tile<paths::half_keys_load, paths::half_keys_score>},
    {"int8", paths::int8_keys_fits, paths::key_tile<paths::int8_keys_load, paths::int8_keys_score>},
    {"affine4", paths::affine4_keys_fits,
     paths::key_tile<paths::affine4_keys_load, paths::affine4_keys_score>},
    {"turbo", paths::turbo_keys_fits,
     paths::key_tile<paths::turbo_keys_load, paths::turbo_keys_score>},
    {"decoded", paths::any_fits,
     paths::key_tile<paths::decoded_keys_load, paths::decoded_keys_score>},
};
inline constexpr ValuePath VALUE_PATHS[] = {
    {"fp16", paths::half_values_fits, paths::value_tile<paths::half_values_add>},
    {"turbo", paths::turbo_values_fits, paths::value_tile<paths::turbo_values_add>},
    {"int8", paths::int8_values_fits, paths::value_tile<paths::int8_values_add>},
    {"affine4", paths::affine4_values_fits, paths::value_tile<paths::affine4_values_add>},
    {"decoded", paths::any_fits, paths::value_tile<paths::decoded_values_add>},
};

template <typename Path, size_t N>
const Path& first_fit(const Path (&table)[N], const Reader& r, const int32_t* cells, int n) {
  for (const Path& p : table)
    if (p.fits(r, cells, n)) return p;
  return table[N - 1];  // decoded rows fit every tile
}

}  // namespace kvk
