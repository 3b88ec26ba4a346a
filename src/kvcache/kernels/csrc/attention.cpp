// Attention over a plan of segments, straight from a cell cache's stored codes.
//
// A plan (built by src/kvcache/kernels/plan.py, once per forward, shared by every layer):
//   cells [C] int32, pos [C] int32   cell ids and their positions, each segment's run sorted
//                                    by position (a canonical read order)
//   segs  [S, 4] int64               cell_begin, cell_end, entry_begin, entry_end
//   entries [E, 3] int64             batch row, lowest and highest visible position
//   row_ptr [T + 1], row_entries [E] the entries of each batch row (CSR)
// A segment is a run of cells read once for all its entries: one sequence's cells for its
// rows, or a shared prefix for the rows of every sequence that shares it. Work items are
// segments (every KV head); each keeps, per entry and query head, a running max, sum and
// weighted value sum over tiles of up to BLK cells (cut where a sequence's rows pass from the
// codes to its fp16 window), the next tile's rows fetched into L2 while a tile's math runs
// (LineStream); a second pass merges a row's entries.
//
//   q [T, Hq, D] float32 (query head hq reads KV head hq / G)   ->   out [T, Hq, Dv] float32
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>
#include <vector>

#include "readers.h"
#include "tiles.h"

namespace kvk {

namespace {

struct Plan {
  const int32_t* cells;
  const int32_t* pos;
  const int64_t* segs;
  const int64_t* entries;
  int64_t S, E;
};

struct Partials {
  float* m;     // [E, Hq]
  float* l;     // [E, Hq]
  float* acc;   // [E, Hq, Dv]
  float* accr;  // [E, Hq, Dv] rotated-domain sums (nullptr unless V is rotated)
};

struct Scratch {
  std::vector<float> q, m, l, acc, accr, sc, ktile, vtile;
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

// How a tile's keys or values are read when not decoded into a tile first (see attend_item).
// (HALF_ROPE: fp16 keys stored before RoPE, rotated in registers as they are scored)
enum class Direct { NONE, INT8, AFFINE4, KIVI4, TURBO, HALF, HALF_ROPE };

// 4-bit affine codes read as they are: groups of a multiple of `step` channels
bool affine4_direct(const Reader& r, int64_t step) {
  return r.kind == AFFINE_ROWS && r.bits == 4 && (r.D / r.scale_head) % step == 0;
}

// 4-bit affine keys scored against int16 queries (qk4_rows): blocks of 64 channels whose
// halves each lie in one channel group
bool affine4_keys_direct(const Reader& r) { return affine4_direct(r, 32) && r.D % 64 == 0; }

Direct direct_keys(const Reader& kr, const int32_t* cells, int n) {
  if (!KVK_AVX2) return Direct::NONE;
  if (kr.kind == AFFINE_CHANNELS && kr.bits == 4 && kr.pre_rope && all_codes(kr, cells, n))
    return Direct::KIVI4;
  if (kr.pre_rope) return all_half(kr, cells, n) ? Direct::HALF_ROPE : Direct::NONE;
  if (all_half(kr, cells, n)) return Direct::HALF;
  if (kr.kind == INT8) return all_codes(kr, cells, n) ? Direct::INT8 : Direct::NONE;
  if (affine4_keys_direct(kr) && all_codes(kr, cells, n)) return Direct::AFFINE4;
  if (turbo_keys_direct(kr) && all_codes(kr, cells, n)) return Direct::TURBO;
  return Direct::NONE;
}

Direct direct_values(const Reader& vr, const int32_t* cells, int n) {
  if (!KVK_AVX2) return Direct::NONE;
  if (all_half(vr, cells, n)) return Direct::HALF;  // window rows are never rotated
  if (turbo_values_direct(vr)) return all_codes(vr, cells, n) ? Direct::TURBO : Direct::NONE;
  if (vr.rotated) return Direct::NONE;
  if (vr.kind == INT8) return all_codes(vr, cells, n) ? Direct::INT8 : Direct::NONE;
  if (affine4_direct(vr, 16) && vr.meta_a == nullptr && all_codes(vr, cells, n))
    return Direct::AFFINE4;
  return Direct::NONE;
}

// Scores of head h from 4-bit affine key codes (k = code * scale + low per group of channels,
// plus the sequence's key centre): the codes against the int16 query, each group's part times
// the cells' scales (qk4_rows), plus the cells' minimums times the query's sum over each group;
// then the centre's dot.
void affine4_keys(const Reader& kr, int64_t h, const int32_t* cells, int a, int b, int64_t ne,
                  int64_t G, int64_t D, Scratch& w, LineStream* ls) {
  affine4_rows(kr, h, cells, a, b, w.knib.data(), w.kscale.data(), w.klow.data());
  const int64_t groups = kr.scale_head, width = D / groups;
  for (int64_t e = 0; e < ne; ++e) {
    const int ja = w.ja[e], jb = w.jb[e];
    if (ja >= jb) continue;
    const int64_t r0 = (h * ne + e) * G;
    const float* q0 = w.q.data() + r0 * D;
    float* sc0 = w.sc.data() + e * G * BLK;
#if KVK_AVX2  // direct_keys picks this path only where AVX2 is
    qk4_rows(w.q16.data() + r0 * D, w.qscale.data() + r0, (int)G, (int)D, w.knib.data(), ja, jb,
             w.kscale.data(), (int)width, sc0, ls);
#endif
    for (int64_t gr = 0; gr < groups; ++gr) {
      const float* lo = w.klow.data() + gr * BLK;
      for (int64_t g = 0; g < G; ++g) {
        const float qs = w.qsum[(r0 + g) * groups + gr];
        float* sc = sc0 + g * BLK;
        for (int j = ja; j < jb; ++j) sc[j] += lo[j] * qs;
      }
    }
    if (kr.meta_a != nullptr)
      add_centre_scores(kr, h, cells, ja, jb, q0, (int)G, w.dots.data(), sc0);
  }
}

// Values of head h from 4-bit affine codes (x = code * scale + low per group of channels):
// per group, the weights times the cells' scales through the tile math (the packed codes read
// as they are, NibbleRows: no staged copy; docs/design/kernels.md), plus the weighted sum of
// the cells' minimums.
void affine4_values(const Reader& vr, int64_t h, const int32_t* cells, int a, int b,
                    int64_t ne, int64_t G, int64_t Dv, Scratch& w, LineStream* ls) {
  affine4_rows(vr, h, cells, a, b, w.vnib.data(), w.vscale.data(), w.vlow.data());
  const int64_t groups = vr.scale_head, width = Dv / groups;
  for (int64_t e = 0; e < ne; ++e) {
    const int ja = w.ja[e], jb = w.jb[e];
    if (ja >= jb) continue;
    const float* p0 = w.sc.data() + e * G * BLK;
    float* acc = w.acc.data() + (h * ne + e) * G * Dv;
    for (int64_t gr = 0; gr < groups; ++gr) {
      for (int64_t g = 0; g < G; ++g) {
        const float bias =
            scaled_weights(p0 + g * BLK + ja, w.vscale.data() + gr * BLK + ja,
                           w.vlow.data() + gr * BLK + ja, w.pw.data() + g * BLK + ja, jb - ja);
        add_const(bias, acc + g * Dv + gr * width, (int)width);
      }
      pv_rows<NibbleRows>(w.pw.data(), (int)G, w.vnib.data(), ja, jb, (int)Dv, acc,
                          (int)(gr * width), (int)((gr + 1) * width), ls);
    }
  }
}

// One segment, every KV head: per tile of cells, each head's keys (decoded), scores, softmax
// update, values. Heads inside the tile loop read each cell's row [H, D] in one stream.
// flatten: every call inside is inlined (with the 4-bit branch GCC stopped inlining the int8
// tile math here, and the int8 calls got slower: docs/design/kernels.md)
__attribute__((flatten)) void attend_item(const Plan& plan, int64_t s, const float* q,
                                          int64_t Hq, int64_t H, const Reader& kr,
                                          const Reader& vr, const Rope& rope, float scale,
                                          const Partials& out, Scratch& w) {
  const int64_t* seg = plan.segs + s * 4;
  const int64_t c0 = seg[0], c1 = seg[1], e0 = seg[2], e1 = seg[3];
  const int64_t G = Hq / H, ne = e1 - e0, R = ne * G, D = kr.D, Dv = vr.D;
  // state of head h, entry e, group head g at row (h * ne + e) * G + g
  w.q.resize(H * R * D);
  w.m.assign(H * R, -std::numeric_limits<float>::infinity());
  w.l.assign(H * R, 0.f);
  w.acc.assign(H * R * Dv, 0.f);
  if (vr.rotated) w.accr.assign(H * R * Dv, 0.f);
  w.sc.resize(R * BLK);
  w.pw.resize(G * BLK);
  w.dots.resize(G);
  w.ja.resize(ne);
  w.jb.resize(ne);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t e = 0; e < ne; ++e) {
      const int64_t row = plan.entries[(e0 + e) * 3];
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q + (row * Hq + h * G + g) * D;
        float* dst = w.q.data() + ((h * ne + e) * G + g) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = src[i] * scale;
      }
    }
  }
  // 4-bit affine and int8 keys: the query rounded to int16 steps (for every tile), in the
  // order qk4_rows / qk8_rows read it; 4-bit keys also need its sums over each channel group
  const bool keys4 = KVK_AVX2 && affine4_keys_direct(kr), keys8 = KVK_AVX2 && kr.kind == INT8;
  if (keys4 || keys8) {
    const int64_t groups = keys4 ? kr.scale_head : 0, width = keys4 ? D / groups : 0;
    w.qsum.resize(H * R * groups);
    w.q16.resize(H * R * D);
    w.qscale.resize(H * R);
    for (int64_t r = 0; r < H * R; ++r) {
      w.qscale[r] = quantize_query16(w.q.data() + r * D, (int)D, w.q16.data() + r * D, keys4);
      for (int64_t gr = 0; gr < groups; ++gr) {
        float qs = 0.f;
        for (int64_t i = gr * width; i < (gr + 1) * width; ++i) qs += w.q[r * D + i];
        w.qsum[r * groups + gr] = qs;
      }
    }
  }
  // turbo keys: each query row in the codes' domain, in int16 steps where the codes meet
  // them in int16 products (turbo_keys16; the row then scores as those steps rotated back,
  // whichever path a tile takes), else as floats
  if (turbo_keys16(kr)) {
    w.q16.resize(H * R * D);
    w.qscale.resize(H * R);
    w.qrot.resize(H * R * D);
    for (int64_t r = 0; r < H * R; ++r)
      w.qscale[r] = turbo_query16(kr, r / R, w.q.data() + r * D, w.qrot.data() + r * D,
                                  w.q16.data() + r * D);
  } else if (turbo_keys_direct(kr)) {
    w.qrot.resize(H * R * D);
    for (int64_t r = 0; r < H * R; ++r)
      turbo_query(kr, r / R, w.q.data() + r * D, w.qrot.data() + r * D);
  }
  // cells of the tile from b0: at most BLK, cut where rows change from window to codes
  auto tile_len = [&](int64_t b0) {
    const int32_t* cells = plan.cells + b0;
    const int n = (int)std::min<int64_t>(BLK, c1 - b0);
    return std::min(uniform_prefix(kr, cells, n), uniform_prefix(vr, cells, n));
  };
  bool fetched = false;  // this tile's code rows were fetched during the tile before
  int n = 0;
  for (int64_t b0 = c0; b0 < c1; b0 += n) {
    const int32_t* cells = plan.cells + b0;
    n = tile_len(b0);
    // a tile of no cell would never move b0 on: a bookkeeping bug stops here, not in a hang
    TORCH_CHECK(n > 0, "kvcache kernel: an empty tile at cell ", b0, " of segment ", s);
    const int32_t* pos = plan.pos + b0;
    int a = n, b = 0;
    for (int64_t e = 0; e < ne; ++e) {  // visible cells of each entry: a run (sorted positions)
      const int64_t* ent = plan.entries + (e0 + e) * 3;
      const int32_t lo = (int32_t)std::max<int64_t>(ent[1], INT32_MIN);
      const int32_t hi = (int32_t)std::min<int64_t>(ent[2], INT32_MAX);
      const int ja = (int)(std::lower_bound(pos, pos + n, lo) - pos);
      const int jb = (int)(std::upper_bound(pos, pos + n, hi) - pos);
      w.ja[e] = ja;
      w.jb[e] = std::max(ja, jb);
      if (ja < jb) {
        a = std::min(a, ja);
        b = std::max(b, jb);
      }
    }
    if (a >= b) {
      fetched = false;
      continue;
    }
    if (!fetched) w.sink += touch(kr, cells + a, b - a) + touch(vr, cells + a, b - a);
    // the next tile is fetched while this one's math runs
    LineStream* ls = nullptr;
    fetched = b0 + n < c1;
    if (fetched) {
      const int32_t* nc = cells + n;
      const int m = tile_len(b0 + n);
      w.stream.reset();
      stream_fields(kr, nc, m, w.stream);
      stream_fields(vr, nc, m, w.stream);
      stream_rows(kr, nc, m, w.stream);
      stream_rows(vr, nc, m, w.stream);
      w.stream.start();
      ls = &w.stream;
    }
    // Rows read as stored, without a decoded tile: fp16 rows (fp16 storage or the recent
    // window; converted as loaded, keys stored before RoPE rotated in registers as they are
    // scored), and when every row of the tile is in the codes: int8 keys
    // after RoPE (scores times the key scales), 4-bit affine keys after RoPE (affine4_keys),
    // 4-bit KIVI keys before RoPE (decoded and rotated in registers as they are scored),
    // int8 values (weights times the value scales), 4-bit affine values (weights times each
    // group's scale, plus the weighted sum of the group minimums)
    const Direct kd = direct_keys(kr, cells + a, b - a);
    const Direct vd = direct_values(vr, cells + a, b - a);
    for (int64_t h = 0; h < H; ++h) {
      if (kd == Direct::INT8)
        int8_rows(kr, h, cells, a, b, w.kcodes.data(), w.kscale.data());
      else if (kd == Direct::AFFINE4)
        affine4_keys(kr, h, cells, a, b, ne, G, D, w, ls);
      else if (kd == Direct::HALF)
        half_rows(kr, h, cells, a, b, w.khalf.data());
      else if (kd == Direct::KIVI4)
        kivi4_keys(kr, h, cells, pos, a, b, rope, w.ranges.data(), w.kivi);
      else if (kd == Direct::HALF_ROPE)
        rope_half_keys(kr, h, cells, pos, a, b, rope, w.kivi);
      else if (kd == Direct::TURBO)
        turbo_keys(kr, h, cells, pos, a, b, rope, w.q.data() + h * R * D, (int)R, w.turbo);
      else
        decode(kr, h, cells, pos, a, b, w.ktile.data(), w.krows.data(), w.kdom.data(), rope);
      for (int64_t e = 0; e < ne; ++e) {
        const int ja = w.ja[e], jb = w.jb[e];
        if (ja >= jb) continue;
        const int64_t r0 = (h * ne + e) * G;
        float* sc0 = w.sc.data() + e * G * BLK;
        if (kd == Direct::INT8) {
#if KVK_AVX2
          qk8_rows(w.q16.data() + r0 * D, w.qscale.data() + r0, (int)G, (int)D, w.kcodes.data(),
                   ja, jb, sc0, ls);
#endif
          for (int64_t g = 0; g < G; ++g)
            mul_rows(w.kscale.data() + ja, sc0 + g * BLK + ja, jb - ja);
        } else if (kd == Direct::KIVI4 || kd == Direct::HALF_ROPE) {
#if KVK_AVX2
          qk_kivi_rows(w.q.data() + r0 * D, (int)G, w.kivi, ja, jb, (int)D, sc0, ls,
                       kd == Direct::HALF_ROPE);
#endif
        } else if (kd == Direct::TURBO) {
          if (KVK_AVX2 && turbo_keys16(kr) && w.turbo.exact16)
            qk_turbo16_rows(kr, w.q16.data() + r0 * D, w.qscale.data() + r0, (int)G,
                            (int)(e * G), w.turbo, ja, jb, sc0, ls);
          else  // float levels (off the int16 grid, or other bits)
            qk_turbo_rows(kr, w.qrot.data() + r0 * D, (int)G, (int)(e * G), w.turbo, ja, jb,
                          sc0, ls);
          if (kr.meta_a != nullptr && !kr.centre_rope)  // a centre as it is
            add_centre_scores(kr, h, cells, ja, jb, w.q.data() + r0 * D, (int)G, w.dots.data(),
                              sc0);
        } else if (kd == Direct::HALF) {
          qk_rows<HalfRows>(w.q.data() + r0 * D, (int)G, w.khalf.data(), ja, jb, (int)D, sc0, 0,
                            -1, ls);
        } else if (kd == Direct::NONE) {
          qk_rows(w.q.data() + r0 * D, (int)G, w.krows.data(), ja, jb, (int)D, sc0, 0, -1, ls);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = r0 + g;
          float* sc = w.sc.data() + (e * G + g) * BLK;
          const float bm = row_max(sc + ja, jb - ja, w.m[r]);
          if (bm > w.m[r]) {
            const float f = std::exp(w.m[r] - bm);  // 0 when the old max is -inf
            w.l[r] *= f;
            scale_row(f, w.acc.data() + r * Dv, (int)Dv);
            if (vr.rotated) scale_row(f, w.accr.data() + r * Dv, (int)Dv);
            w.m[r] = bm;
          }
          w.l[r] += exp_shift_sum(sc + ja, jb - ja, bm);
        }
      }
      if (vd == Direct::INT8) {
        int8_rows(vr, h, cells, a, b, w.vcodes.data(), w.vscale.data());
        for (int64_t e = 0; e < ne; ++e) {
          const int ja = w.ja[e], jb = w.jb[e];
          if (ja >= jb) continue;
          float* p0 = w.sc.data() + e * G * BLK;
          for (int64_t g = 0; g < G; ++g)
            mul_rows(w.vscale.data() + ja, p0 + g * BLK + ja, jb - ja);
          pv_rows<Int8Rows>(p0, (int)G, w.vcodes.data(), ja, jb, (int)Dv,
                            w.acc.data() + (h * ne + e) * G * Dv, 0, -1, ls);
        }
        continue;
      }
      if (vd == Direct::TURBO) {  // rotated-domain sums: weights times the norms, then levels
        turbo_values(vr, h, cells, a, b, w.turbov);
        for (int64_t e = 0; e < ne; ++e) {
          const int ja = w.ja[e], jb = w.jb[e];
          if (ja >= jb) continue;
          float* p0 = w.sc.data() + e * G * BLK;
          for (int64_t g = 0; g < G; ++g) mul_rows(w.turbov.s + ja, p0 + g * BLK + ja, jb - ja);
          pv_turbo_rows(vr, p0, (int)G, w.turbov, ja, jb, w.accr.data() + (h * ne + e) * G * Dv,
                        ls);
        }
        continue;
      }
      if (vd == Direct::HALF) {
        half_rows(vr, h, cells, a, b, w.vhalf.data());
        for (int64_t e = 0; e < ne; ++e)
          if (w.ja[e] < w.jb[e])
            pv_rows<HalfRows>(w.sc.data() + e * G * BLK, (int)G, w.vhalf.data(), w.ja[e], w.jb[e],
                              (int)Dv, w.acc.data() + (h * ne + e) * G * Dv, 0, -1, ls);
        continue;
      }
      if (vd == Direct::AFFINE4) {
        affine4_values(vr, h, cells, a, b, ne, G, Dv, w, ls);
        continue;
      }
      decode(vr, h, cells, pos, a, b, w.vtile.data(), w.vrows.data(), w.vdom.data(), rope);
      int rotated = 0;  // turbo values summed in the rotated domain: all a tile's rows or none
      for (int j = a; j < b; ++j) rotated += w.vdom[j] != 0;
      for (int64_t e = 0; e < ne; ++e) {
        const int ja = w.ja[e], jb = w.jb[e];
        if (ja >= jb) continue;
        const int64_t r0 = (h * ne + e) * G;
        if (rotated == 0 || rotated == b - a) {
          float* acc = (rotated ? w.accr.data() : w.acc.data()) + r0 * Dv;
          pv_rows(w.sc.data() + e * G * BLK, (int)G, w.vrows.data(), ja, jb, (int)Dv, acc, 0, -1,
                  ls);
          continue;
        }
        for (int j = ja; j < jb; ++j) {  // a mix (not cut by uniform_prefix): row by row
          float* dst = (w.vdom[j] ? w.accr.data() : w.acc.data()) + r0 * Dv;
          for (int64_t g = 0; g < G; ++g)
            axpy(w.sc[(e * G + g) * BLK + j], w.vrows[j], dst + g * Dv, (int)Dv);
        }
      }
    }
    if (ls != nullptr) ls->finish();  // the next tile's lines the math did not reach
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t e = 0; e < ne; ++e) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (h * ne + e) * G + g, o = (e0 + e) * Hq + h * G + g;
        out.m[o] = w.m[r];
        out.l[o] = w.l[r];
        std::memcpy(out.acc + o * Dv, w.acc.data() + r * Dv, (size_t)Dv * 4);
        if (out.accr != nullptr) std::memcpy(out.accr + o * Dv, w.accr.data() + r * Dv, (size_t)Dv * 4);
      }
    }
  }
}

// out[row] = sum_e exp(m_e - M) acc_e / sum_e exp(m_e - M) l_e over the row's entries; where
// the value sums have a rotated-domain part (p.accr), it is merged alike and rotated back into
// out by `rotation` [Hkv, Dv, Dv] (out += rotation[hq / G] @ merged accr)
void merge_rows(const Partials& p, const int64_t* row_ptr, const int64_t* row_entries, int64_t T,
                int64_t Hq, int64_t Dv, float* out, const float* rotation, int64_t G) {
  at::parallel_for(0, T * Hq, 16, [&](int64_t begin, int64_t end) {
    float orot[kMaxDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hq, hq = item % Hq;
      float* o = out + item * Dv;
      const bool rot = p.accr != nullptr;
      std::fill(o, o + Dv, 0.f);
      if (rot) std::fill(orot, orot + Dv, 0.f);
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t k = row_ptr[t]; k < row_ptr[t + 1]; ++k)
        M = std::max(M, p.m[row_entries[k] * Hq + hq]);
      if (M == -std::numeric_limits<float>::infinity()) continue;  // sees nothing: zeros
      float L = 0.f;
      for (int64_t k = row_ptr[t]; k < row_ptr[t + 1]; ++k) {
        const int64_t i = row_entries[k] * Hq + hq;
        const float f = std::exp(p.m[i] - M);
        if (f == 0.f) continue;
        L += f * p.l[i];
        axpy(f, p.acc + i * Dv, o, (int)Dv);
        if (rot) axpy(f, p.accr + i * Dv, orot, (int)Dv);
      }
      scale_row(1.f / L, o, (int)Dv);
      if (rot) {
        scale_row(1.f / L, orot, (int)Dv);
        const float* back = rotation + hq / G * Dv * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] += dot(back + d * Dv, orot, (int)Dv);
      }
    }
  });
}

void check_int(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == dim && t.is_contiguous(), "kvcache kernel: ",
              name, " must be a contiguous ", dim, "-d ", c10::toString(type), " tensor");
}

void check_float(const at::Tensor& t, std::vector<int64_t> shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == shape,
              "kvcache kernel: ", name, " must be a contiguous float32 tensor of shape ", shape);
}

Rope rope_of(const Reader& kr, const at::Tensor& cos, const at::Tensor& sin) {
  Rope rope;
  if (!kr.pre_rope && !kr.centre_rope) return rope;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == kr.D / 2 &&
                  sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "kvcache kernel: RoPE tables must be float32 [P, D/2]");
  rope.cos = cos.data_ptr<float>();
  rope.sin = sin.data_ptr<float>();
  rope.count = cos.size(0);
  return rope;
}


// Everything a partial-sums pass needs, validated once.
struct Pass {
  Plan plan;
  Reader kr, vr;
  Rope rope;
  const float* q;
  int64_t T, Hq, D, H;
  float scale;
};

Pass prepare(const at::Tensor& q, const at::Tensor& cells, const at::Tensor& pos,
             const at::Tensor& segs, const at::Tensor& entries,
             const std::vector<at::Tensor>& k_tensors, const std::vector<int64_t>& k_ints,
             const std::vector<at::Tensor>& v_tensors, const std::vector<int64_t>& v_ints,
             int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "kvcache kernel: q must be a contiguous float32 [T, Hq, D] tensor");
  check_int(cells, at::kInt, 1, "cells");
  check_int(pos, at::kInt, 1, "pos");
  check_int(segs, at::kLong, 2, "segs");
  check_int(entries, at::kLong, 2, "entries");
  TORCH_CHECK(cells.size(0) == pos.size(0), "kvcache kernel: cells and pos differ in length");
  const int64_t Hq = q.size(1), D = q.size(2), E = entries.size(0), S = segs.size(0);
  TORCH_CHECK(kv_heads > 0 && Hq % kv_heads == 0, "kvcache kernel: Hq % kv_heads != 0");
  const int64_t* sg = segs.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(sg[s * 4] >= 0 && sg[s * 4] <= sg[s * 4 + 1] && sg[s * 4 + 1] <= cells.size(0) &&
                    sg[s * 4 + 2] >= 0 && sg[s * 4 + 2] <= sg[s * 4 + 3] && sg[s * 4 + 3] <= E,
                "kvcache kernel: segment ", s, " out of range");
  const int64_t* en = entries.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(en[e * 3] >= 0 && en[e * 3] < q.size(0), "kvcache kernel: entry row out of range");
  Pass p;
  p.plan = Plan{cells.data_ptr<int32_t>(), pos.data_ptr<int32_t>(), sg, en, S, E};
  p.kr = make_reader(k_tensors, k_ints, kv_heads, D);
  p.vr = make_reader(v_tensors, v_ints, kv_heads, D);  // values: the same head_dim
  p.rope = rope_of(p.kr, cos, sin);
  p.q = q.data_ptr<float>();
  p.T = q.size(0), p.Hq = Hq, p.D = D, p.H = kv_heads;
  p.scale = (float)scale;
  return p;
}

void run(const Pass& p, const Partials& part) {
  // Work items go to whichever thread is free next (an atomic counter), not in fixed chunks:
  // pieces of memory-bound work finish at uneven times, and a thread waiting at the end of a
  // static split is time lost on every layer.
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), p.plan.S);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local Scratch w;  // kept between calls: no allocation in a decode step
    w.ktile.resize(BLK * p.D);
    w.vtile.resize(BLK * p.D);
    w.krows.resize(BLK);
    w.vrows.resize(BLK);
    w.kcodes.resize(BLK);
    w.vcodes.resize(BLK);
    w.knib.resize(BLK);
    w.khalf.resize(BLK);
    w.vhalf.resize(BLK);
    w.vnib.resize(BLK);
    w.kscale.resize(BLK * p.D);  // [groups, BLK] for 4-bit rows (groups <= D)
    w.klow.resize(BLK * p.D);
    w.vscale.resize(BLK * p.D);
    w.vlow.resize(BLK * p.D);
    w.ranges.resize(BLK * 2 * p.D);
    w.kdom.resize(BLK);
    w.vdom.resize(BLK);
    for (int64_t item = next++; item < p.plan.S; item = next++)
      attend_item(p.plan, item, p.q, p.Hq, p.H, p.kr, p.vr, p.rope, p.scale, part, w);
  });
}

std::vector<at::Tensor> partial_tensors(const Pass& p) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  const int64_t E = p.plan.E;
  return {at::empty({E, p.Hq}, opts), at::empty({E, p.Hq}, opts), at::empty({E, p.Hq, p.D}, opts),
          p.vr.rotated ? at::zeros({E, p.Hq, p.D}, opts) : at::empty({0}, opts)};
}

Partials partials_of(std::vector<at::Tensor>& t) {
  return Partials{t[0].data_ptr<float>(), t[1].data_ptr<float>(), t[2].data_ptr<float>(),
                  t[3].numel() ? t[3].data_ptr<float>() : nullptr};
}

}  // namespace

// Partial sums (m, l [E, Hq], acc [E, Hq, D], accr: rotated-domain value sums, empty unless
// the value codec sums there) of every segment's entries; the caller adds the partial sums of
// prompt tiles and merges (merge below).
std::vector<at::Tensor> partials(const at::Tensor& q, const at::Tensor& cells,
                                 const at::Tensor& pos, const at::Tensor& segs,
                                 const at::Tensor& entries,
                                 const std::vector<at::Tensor>& k_tensors,
                                 const std::vector<int64_t>& k_ints,
                                 const std::vector<at::Tensor>& v_tensors,
                                 const std::vector<int64_t>& v_ints, int64_t kv_heads,
                                 const at::Tensor& cos, const at::Tensor& sin, double scale) {
  Pass p = prepare(q, cells, pos, segs, entries, k_tensors, k_ints, v_tensors, v_ints, kv_heads,
                   cos, sin, scale);
  // turbo keys centred in the rotary frame: the offsets table of their centres' scores, built
  // once per call (64 KB at most)
  std::vector<float> offsets;
  if (p.kr.centre_rope && p.rope.count >= BLK && p.D <= kMaxDim) {
    offsets.resize(p.D * BLK);
    rope_offsets(p.rope.cos, p.rope.sin, p.D, offsets.data());
    p.rope.offsets = offsets.data();
  }
  std::vector<at::Tensor> t = partial_tensors(p);
  run(p, partials_of(t));
  return t;
}

// out [T, Hq, D]: each row's entries merged; a row that sees nothing is zeros. Where the value
// codec sums in a rotated domain (accr given), that part is merged too and rotated back with
// `rotation` [Hkv, D, D] (x = y @ rotation[h]^T, h = hq / (Hq / Hkv)) into out: one matrix-vector
// product per output row, in place of torch's einsum and add (docs/design/kernels.md).
at::Tensor merge(const at::Tensor& pm, const at::Tensor& pl, const at::Tensor& pacc,
                 const at::Tensor& paccr, const at::Tensor& row_ptr,
                 const at::Tensor& row_entries, const at::Tensor& rotation) {
  check_int(row_ptr, at::kLong, 1, "row_ptr");
  check_int(row_entries, at::kLong, 1, "row_entries");
  const int64_t E = pm.size(0), Hq = pm.size(1), D = pacc.size(2), T = row_ptr.size(0) - 1;
  check_float(pl, {E, Hq}, "l");
  check_float(pacc, {E, Hq, D}, "acc");
  TORCH_CHECK(D <= kMaxDim, "kvcache kernel: head_dim above ", kMaxDim);
  const bool rot = paccr.numel() > 0;
  int64_t H = 0;
  if (rot) {
    check_float(paccr, {E, Hq, D}, "accr");
    H = rotation.dim() == 3 ? rotation.size(0) : 0;
    TORCH_CHECK(H > 0 && Hq % H == 0, "kvcache kernel: rotated value sums need rotation [Hkv, D, D]");
    check_float(rotation, {H, D, D}, "rotation");
  }
  const int64_t* rp = row_ptr.data_ptr<int64_t>();
  const int64_t* re = row_entries.data_ptr<int64_t>();
  TORCH_CHECK(rp[0] == 0 && rp[T] == row_entries.size(0), "kvcache kernel: bad row_ptr");
  for (int64_t k = 0; k < row_entries.size(0); ++k)
    TORCH_CHECK(re[k] >= 0 && re[k] < E, "kvcache kernel: row entry out of range");
  Partials part{pm.data_ptr<float>(), pl.data_ptr<float>(), pacc.data_ptr<float>(),
                rot ? paccr.data_ptr<float>() : nullptr};
  at::Tensor out = at::empty({T, Hq, D}, pacc.options());
  merge_rows(part, rp, re, T, Hq, D, out.data_ptr<float>(),
             rot ? rotation.data_ptr<float>() : nullptr, rot ? Hq / H : 1);
  return out;
}

// Partial sums and their merge in one call (a forward without prompt tiles): out.
at::Tensor attend(const at::Tensor& q, const at::Tensor& cells, const at::Tensor& pos,
                  const at::Tensor& segs, const at::Tensor& entries,
                  const std::vector<at::Tensor>& k_tensors, const std::vector<int64_t>& k_ints,
                  const std::vector<at::Tensor>& v_tensors, const std::vector<int64_t>& v_ints,
                  int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin, double scale,
                  const at::Tensor& row_ptr, const at::Tensor& row_entries,
                  const at::Tensor& rotation) {
  std::vector<at::Tensor> t = partials(q, cells, pos, segs, entries, k_tensors, k_ints, v_tensors,
                                       v_ints, kv_heads, cos, sin, scale);
  return merge(t[0], t[1], t[2], t[3], row_ptr, row_entries, rotation);
}

// Decoded rows of `cells` (keys stored before RoPE rotated back): [n, H, D] float32.
at::Tensor gather(const at::Tensor& cells, const at::Tensor& pos,
                  const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints,
                  int64_t heads, int64_t dim, const at::Tensor& cos, const at::Tensor& sin) {
  check_int(cells, at::kInt, 1, "cells");
  check_int(pos, at::kInt, 1, "pos");
  const Reader r = make_reader(tensors, ints, heads, dim);
  const Rope rope = rope_of(r, cos, sin);
  const int64_t n = cells.size(0);
  TORCH_CHECK(pos.size(0) == n, "kvcache kernel: cells and pos differ in length");
  at::Tensor out = at::empty({n, heads, dim}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int32_t* c = cells.data_ptr<int32_t>();
  const int32_t* p = pos.data_ptr<int32_t>();
  at::parallel_for(0, (n + BLK - 1) / BLK * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(BLK * dim);
    std::vector<const float*> rows(BLK);
    std::vector<uint8_t> dom(BLK);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t blk = item / heads, h = item % heads, b0 = blk * BLK;
      const int m = (int)std::min<int64_t>(BLK, n - b0);
      decode(r, h, c + b0, p + b0, 0, m, tile.data(), rows.data(), dom.data(), rope);
      for (int j = 0; j < m; ++j) {
        float* dst = o + ((b0 + j) * heads + h) * dim;
        std::memcpy(dst, rows[j], (size_t)dim * 4);
        if (dom[j]) turbo_unrotate(r.signs + h * dim, dst, dim);  // turbo values: plain rows
      }
    }
  });
  return out;
}

// quantize_query16 over rows q [R, D] float32, as a 4-bit key call (nibble_order, D a multiple
// of 64) or an int8 key call (channel order, D a multiple of 16) rounds its queries: the
// rounded rows, their int16 steps in the kernel's layout (tiles.h) and each row's step. Tests
// hold its rounding to int16_steps' (attend.py), ties included.
std::vector<at::Tensor> query_steps16(const at::Tensor& q, bool nibble_order) {
  const int64_t multiple = nibble_order ? 64 : 16;
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.size(1) % multiple == 0,
              "kvcache kernel: query_steps16 takes float32 rows [R, D], D a multiple of ",
              multiple);
  const int64_t R = q.size(0), D = q.size(1);
  at::Tensor rounded = q.contiguous().clone();
  at::Tensor q16 = at::empty({R, D}, at::TensorOptions().dtype(at::kShort));
  at::Tensor step = at::empty({R}, at::TensorOptions().dtype(at::kFloat));
  float* x = rounded.data_ptr<float>();
  int16_t* y = q16.data_ptr<int16_t>();
  float* s = step.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    s[r] = quantize_query16(x + r * D, (int)D, y + r * D, nibble_order);
  return {rounded, q16, step};
}

// Rows q [R, D] (scaled) as turbo keys score them against a head of sign flips `signs` [D]:
// rotated into the codes' domain and rounded to int16 steps (q16 [R, D], step [R]), and the
// query those steps rotate back to (turbo_query16).
std::vector<at::Tensor> turbo_steps16(const at::Tensor& q, const at::Tensor& signs) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.size(1) % 64 == 0 &&
                  q.size(1) <= kMaxDim,
              "kvcache kernel: turbo_steps16 takes float32 rows [R, D], D a multiple of 64");
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.dim() == 1 && signs.size(0) == q.size(1),
              "kvcache kernel: turbo_steps16 takes float32 signs [D]");
  const int64_t R = q.size(0), D = q.size(1);
  at::Tensor s = signs.contiguous();
  Reader r;
  r.D = D;
  r.signs = s.data_ptr<float>();
  at::Tensor rounded = q.contiguous().clone();
  at::Tensor q16 = at::empty({R, D}, at::TensorOptions().dtype(at::kShort));
  at::Tensor step = at::empty({R}, at::TensorOptions().dtype(at::kFloat));
  std::vector<float> qrot(D);
  for (int64_t i = 0; i < R; ++i)
    step.data_ptr<float>()[i] = turbo_query16(r, 0, rounded.data_ptr<float>() + i * D,
                                              qrot.data(), q16.data_ptr<int16_t>() + i * D);
  return {rounded, q16, step};
}

// Distinct threads that ran the items of an at::parallel_for over n items: torch's thread
// count when the extension is built with OpenMP, 1 when it is not (ATen's parallel_for is a
// header whose `omp parallel` pragma a build without -fopenmp silently ignores).
int64_t parallel_threads(int64_t n) {
  std::vector<int> ran(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ran[i] = at::get_thread_num();
  });
  std::sort(ran.begin(), ran.end());
  return std::unique(ran.begin(), ran.end()) - ran.begin();
}

// The vector paths this build has: "avx512", "avx2" or "none" (plain loops, as on a CPU
// without AVX2 or not x86). Only the vector paths meet int8 and 4-bit affine keys in int16
// products of a rounded query (direct_keys); plain loops score decoded keys with the query.
std::string isa() { return KVK_AVX512 ? "avx512" : KVK_AVX2 ? "avx2" : "none"; }

// linear.cpp
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                       const at::Tensor& residual, const at::Tensor& norm, double eps, bool glu);
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps);
// encode.cpp
void encode_int8(const at::Tensor& x, const at::Tensor& cells, at::Tensor& codes,
                 at::Tensor& scale);
void encode_affine(const at::Tensor& x, const at::Tensor& cells, int64_t bits, int64_t group,
                   at::Tensor& codes, at::Tensor& scale, at::Tensor& low, int64_t refits);
void range_channels(const at::Tensor& x, int64_t meta, int64_t bits, at::Tensor& scale,
                    at::Tensor& low);
void encode_channels(const at::Tensor& x, const at::Tensor& cells, const at::Tensor& metas,
                     int64_t bits, at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& low);
void encode_turbo(const at::Tensor& x, const at::Tensor& cells, const at::Tensor& offsets,
                  const at::Tensor& signs, const at::Tensor& cell_codes,
                  const at::Tensor& cell_squares, int64_t grid_bits, int64_t bits,
                  at::Tensor& codes, at::Tensor& scale);
// rows.cpp
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::vector<at::Tensor> split_heads(const at::Tensor& qkv, int64_t hq, int64_t hkv,
                                    const at::Tensor& cos, const at::Tensor& sin,
                                    bool rotate_keys, const at::Tensor& q_norm,
                                    const at::Tensor& k_norm, double eps);
void put_rows(at::Tensor& dst, const at::Tensor& slots, const at::Tensor& src,
              const at::Tensor& rows);
// dense.cpp
at::Tensor dense_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& windows, double scale);

}  // namespace kvk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &kvk::attend, "attention over plan segments from the codes, merged per row");
  m.def("partials", &kvk::partials, "attention partial sums over plan segments, from the codes");
  m.def("merge", &kvk::merge, "merge each row's partial sums");
  m.def("gather", &kvk::gather, "decoded rows of cells");
  m.def("linear_rows", &kvk::linear_rows,
        "f(x) @ w^T (+ bias) (+ residual) for a few rows of x; f: RMSNorm by `norm`, SwiGLU "
        "(glu), or none",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("residual"), py::arg("norm"),
        py::arg("eps"), py::arg("glu"));
  m.def("rms_norm_rows", &kvk::rms_norm_rows, "RMSNorm of rows times a weight");
  m.def("rope_rows", &kvk::rope_rows, "RoPE (rotate-half) of rows from cos/sin tables");
  m.def("split_heads", &kvk::split_heads,
        "q, k, v of a fused projection's rows: per-head norms (optional) and RoPE");
  m.def("put_rows", &kvk::put_rows, "rows copied into slots of a float32/float16 buffer");
  m.def("dense_attention", &kvk::dense_attention, "unmasked attention over dense windows");
  m.def("query_steps16", &kvk::query_steps16, "queries rounded to int16 steps (4-bit, 8-bit keys)",
        py::arg("q"), py::arg("nibble_order") = true);
  m.def("turbo_steps16", &kvk::turbo_steps16, "queries as turbo keys score them (int16 steps)");
  m.def("encode_int8", &kvk::encode_int8, "int8 codes and scales of rows, into their cells");
  m.def("encode_affine", &kvk::encode_affine, "affine codes, scales, minimums, into cells");
  m.def("range_channels", &kvk::range_channels, "a record's channel ranges over its rows");
  m.def("encode_channels", &kvk::encode_channels, "codes of rows against their records' ranges");
  m.def("encode_turbo", &kvk::encode_turbo, "turbo codes and flagged scales of rows, into cells");
  m.def("parallel_threads", &kvk::parallel_threads, "threads an at::parallel_for ran on");
  m.def("isa", &kvk::isa, "the vector paths of this build: avx512, avx2 or none");
}
