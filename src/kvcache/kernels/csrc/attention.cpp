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

#include "api.h"
#include "paths.h"
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

// One segment, every KV head: per tile of cells, the tile's key path scores every head and
// updates its softmax, then its value path sums every head (paths.h). flatten: the calls
// inside are inlined, but the paths' rows, each flattened itself (docs/design/kernels.md).
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
  w.sc.resize(H * R * BLK);  // each head's scores apart: a path scores every head, then sums
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
    // the first row of each path table (paths.h) that fits the tile's visible cells
    const KeyPath& kp = first_fit(KEY_PATHS, kr, cells + a, b - a);
    const ValuePath& vp = first_fit(VALUE_PATHS, vr, cells + a, b - a);
    const TileCtx t{kr, vr, rope, cells, pos, a, b, ne, G, R, D, Dv, w, ls};
    kp.scores(t);  // every head's scores and softmax update, then every head's values
    vp.add(t);
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

// The key path and the value path (paths.h) that would read a tile of `cells` (at most BLK,
// all one way: uniform_prefix) of buffers with these layouts: what a test or a user asks to
// see which path a codec takes.
std::vector<std::string> tile_paths(const at::Tensor& cells,
                                    const std::vector<at::Tensor>& k_tensors,
                                    const std::vector<int64_t>& k_ints,
                                    const std::vector<at::Tensor>& v_tensors,
                                    const std::vector<int64_t>& v_ints, int64_t heads,
                                    int64_t dim) {
  check_int(cells, at::kInt, 1, "cells");
  const int n = (int)cells.size(0);
  TORCH_CHECK(n > 0 && n <= BLK, "kvcache kernel: a tile holds 1 to ", BLK, " cells");
  const Reader kr = make_reader(k_tensors, k_ints, heads, dim);
  const Reader vr = make_reader(v_tensors, v_ints, heads, dim);
  const int32_t* c = cells.data_ptr<int32_t>();
  TORCH_CHECK(uniform_prefix(kr, c, n) == n && uniform_prefix(vr, c, n) == n,
              "kvcache kernel: a tile's rows are all in the window or all in the codes");
  return {first_fit(KEY_PATHS, kr, c, n).name, first_fit(VALUE_PATHS, vr, c, n).name};
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
// products of a rounded query (paths.h); plain loops score decoded keys with the query.
std::string isa() { return KVK_AVX512 ? "avx512" : KVK_AVX2 ? "avx2" : "none"; }

}  // namespace kvk
