// Decode-sized linear layers over GGUF weight blocks: y [M, N] = f(x) [M, K] @ W [N, K]^T, few
// rows (M <= 32 from kernels/qlinear.py), W as stored.
//
// As ggml does, the activations are quantized per block (q8_0: 32 values, q8_K: 256) to int8
// with a float32 scale amax / 127, and each block's product is an integer dot product of the
// codes (blocks.h's decoded form), scaled in float32:
//   y[m, n] = sum_b  d_w[b] * d_x[b] * sum_16 sc * (q_w . q_x)  +  dm_w[b] * d_x[b] * sum_32 mn * s_x
// (s_x: the sum of 32 activation codes). An item is a run of weight rows; each row is decoded
// once into L1 and met by every input row (one input row meets Q4_0 / Q4_1 / Q5_0 / Q4_K rows
// straight from their blocks), so the weights are read once a call. Every output
// is the same sums in the same order whatever M, the row's place in the batch or the thread
// count: a row's result does not depend on the rows decoded beside it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "blocks.h"
#include "interleaved.h"
#include "weights.h"

#if KVK_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVK_VNNI 1
#define KVK_DPBUSD _mm256_dpbusd_epi32
#elif KVK_AVX2 && defined(__AVXVNNI__)
#define KVK_VNNI 1
#define KVK_DPBUSD _mm256_dpbusd_avx_epi32
#else
#define KVK_VNNI 0
#endif

namespace kvk {

std::string weights_isa() { return KVK_VNNI ? "vnni" : KVK_AVX2 ? "avx2" : "none"; }

namespace {

// Activations quantized per block of G: codes [M, K], scales [M, K / G], sums [M, K / 32].
struct Quantized {
  at::Tensor q, d, s;
};

// one row: q = round(x * 127 / amax) (to nearest, ties to even), d = amax / 127 per block
void quantize_row(const float* x, int64_t K, int G, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < K / G; ++b) {
    const float* xb = x + b * G;
    float amax = 0.f;
    for (int i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xb[i]));
    d[b] = amax / 127.f;
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < G; ++i) {
      const float v = std::nearbyint(xb[i] * id);
      q[b * G + i] = (int8_t)std::min(127.f, std::max(-127.f, v));
    }
  }
  for (int64_t j = 0; j < K / 32; ++j) {
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += q[j * 32 + i];
    s[j] = sum;
  }
}

Quantized quantize(const float* x, int64_t M, int64_t K, int G) {
  const auto opts = at::TensorOptions();
  Quantized a{at::empty({M, K}, opts.dtype(at::kChar)), at::empty({M, K / G}, opts.dtype(at::kFloat)),
              at::empty({M, K / 32}, opts.dtype(at::kInt))};
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, G, a.q.data_ptr<int8_t>() + m * K, a.d.data_ptr<float>() + m * (K / G),
                 a.s.data_ptr<int32_t>() + m * (K / 32));
  return a;
}

#if KVK_AVX2
// q_w . q_x over 32 codes as 8 int32 lanes (lane i: codes 4i..4i+3), exact: |q_w| as unsigned
// times q_x with q_w's sign (no int16 pair overflows: 2 * 128 * 127 < 2^15)
// (UNSIGNED: codes already 0..15, as Q4_1's and Q4_K's, need no sign moved; the same sums)
template <bool UNSIGNED>
inline __m256i dot32(__m256i wv, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256((const __m256i*)x);
  const __m256i u = UNSIGNED ? wv : _mm256_sign_epi8(wv, wv);
  const __m256i s = UNSIGNED ? xv : _mm256_sign_epi8(xv, wv);
#if KVK_VNNI
  return KVK_DPBUSD(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#if !KVK_AVX2
// the integer sum of block b's code products, times the per-16 scales for G = 256
template <int G>
inline int32_t block_dot(const Decoded& w, const int8_t* xq, int64_t b) {
  const int8_t* wq = w.q + b * G;
  const int8_t* xb = xq + b * G;
  int32_t total = 0;
  for (int c = 0; c < G / 16; ++c) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += (int32_t)wq[16 * c + i] * xb[16 * c + i];
    total += (G == 32 ? 1 : w.sc[b * 16 + c]) * sum;
  }
  return total;
}

// y = W's row . x's row (both quantized), K values
template <int G, bool MIN>
float dot_row(const Decoded& w, const int8_t* xq, const float* xd, const int32_t* xs,
              int64_t K) {
  float acc = 0.f, accm = 0.f;
  for (int64_t b = 0; b < K / G; ++b) {
    acc += (w.d[b] * xd[b]) * (float)block_dot<G>(w, xq, b);
    if constexpr (MIN) {
      int32_t ms = 0;
      for (int j = 0; j < G / 32; ++j) ms += w.mn[b * (G / 32) + j] * xs[b * (G / 32) + j];
      accm += (w.dm[b] * xd[b]) * (float)ms;
    }
  }
  return acc + accm;
}
#endif

constexpr int RB = 4;  // weight rows decoded together and met by each x row

// items of RB weight rows over the threads (~16 K weights an item): f(first, last item)
template <class F>
void over_items(int64_t rows, int64_t K, const F& f) {
  at::parallel_for(0, (rows + RB - 1) / RB, std::max<int64_t>(1, 16384 / (RB * K)), f);
}

#if KVK_AVX2
// weight rows as dot_rows reads them, staged: rows decoded by decode_row
template <int G>
struct StagedRows {
  const Decoded* w;
  void block(int, int64_t) {}
  __m256i codes(int r, int64_t b, int c) const {
    return _mm256_loadu_si256((const __m256i*)(w[r].q + b * G + 32 * c));
  }
  float d(int r, int64_t b) const { return w[r].d[b]; }
  float dm(int r, int64_t b) const { return w[r].dm[b]; }
  const int32_t* sc(int r, int64_t b) const { return w[r].sc + b * 16; }
  const int32_t* mn(int r, int64_t b) const { return w[r].mn + b * (G / 32); }
};

// R weight rows straight from their blocks (src[r]): a block's factors read as it is reached,
// its codes unpacked into registers (codes32), no staged row (a decode step's one x row)
template <int KIND, int R>
struct BlockRows {
  static constexpr int NB = block_bytes<KIND>();
  const uint8_t* const* src;
  float d_[R], dm_[R];
  int32_t sc_[R][16], mn_[R][8];
  void block(int r, int64_t b) {
    block_scalars<KIND>(src[r] + b * NB, 0, Decoded{nullptr, d_ + r, dm_ + r, sc_[r], mn_[r]});
  }
  __m256i codes(int r, int64_t b, int c) const { return codes32<KIND>(src[r] + b * NB, c); }
  float d(int r, int64_t) const { return d_[r]; }
  float dm(int r, int64_t) const { return dm_[r]; }
  const int32_t* sc(int r, int64_t) const { return sc_[r]; }
  const int32_t* mn(int r, int64_t) const { return mn_[r]; }
};

// y[r] = W's rows r < R . x's row: each x vector loaded once for R weight rows; each row's
// float32 sums kept in 8 lanes (a block's 8 integer lanes scaled, then added), summed at the
// end. A row's operations do not depend on R, on the other rows or on where its codes come
// from (staged or straight from the blocks): the same bits in any case.
template <int G, bool MIN, int R, class W>
void dot_rows(W& w, const int8_t* xq, const float* xd, const int32_t* xs, int64_t K, float* y) {
  __m256 acc[R];
  float accm[R];
  KVK_UNROLL
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    accm[r] = 0.f;
  }
  for (int64_t b = 0; b < K / G; ++b) {
    const float dx = xd[b];
    __m256i ia[R];
    KVK_UNROLL
    for (int r = 0; r < R; ++r) {
      w.block(r, b);
      ia[r] = _mm256_setzero_si256();
    }
    KVK_UNROLL
    for (int c = 0; c < G / 32; ++c) {
      const int8_t* xc = xq + b * G + 32 * c;
      KVK_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256i p = dot32<MIN>(w.codes(r, b, c), xc);  // MIN types: 0..15
        if constexpr (G == 32) {
          ia[r] = p;
        } else {
          const int32_t* sc = w.sc(r, b) + 2 * c;
          const __m256i s = _mm256_set_m128i(_mm_set1_epi32(sc[1]), _mm_set1_epi32(sc[0]));
          ia[r] = _mm256_add_epi32(ia[r], _mm256_mullo_epi32(p, s));
        }
      }
    }
    KVK_UNROLL
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_set1_ps(w.d(r, b) * dx), acc[r]);
      if constexpr (MIN) {
        const int32_t* mn = w.mn(r, b);
        int32_t ms = 0;
        KVK_UNROLL
        for (int j = 0; j < G / 32; ++j) ms += mn[j] * xs[b * (G / 32) + j];
        // fused by hand: -ffp-contract=fast may fuse it in one instance and not in another
        accm[r] = std::fma(w.dm(r, b) * dx, (float)ms, accm[r]);
      }
    }
  }
  KVK_UNROLL
  for (int r = 0; r < R; ++r) y[r] = hsum8(acc[r]) + accm[r];
}

template <int KIND, int R>
void block_dot_rows(const uint8_t* const* src, const int8_t* xq, const float* xd,
                    const int32_t* xs, int64_t K, float* y) {
  BlockRows<KIND, R> w{src, {}, {}, {}, {}};
  dot_rows<block_values<KIND>(), KIND == Q4_1 || KIND == Q4_K, R>(w, xq, xd, xs, K, y);
}

// every row of a part against the one x row, RB rows an item (a tail row by row)
template <int KIND>
void direct_rows(const uint8_t* data, int64_t rows, int64_t row_bytes, const Quantized& a,
                 int64_t K, float* y) {
  const int8_t* xq = a.q.data_ptr<int8_t>();
  const float* xd = a.d.data_ptr<float>();
  const int32_t* xs = a.s.data_ptr<int32_t>();
  over_items(rows, K, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n = blk * RB, c = std::min<int64_t>(RB, rows - n);
      const uint8_t* src[RB];
      for (int64_t r = 0; r < c; ++r) src[r] = data + (n + r) * row_bytes;
      if (c == RB) {
        block_dot_rows<KIND, RB>(src, xq, xd, xs, K, y + n);
      } else {
        for (int64_t r = 0; r < c; ++r) block_dot_rows<KIND, 1>(src + r, xq, xd, xs, K, y + n + r);
      }
    }
  });
}
#endif

// y[m * ldy + r] for the c <= RB decoded rows w and every x row m
template <int G, bool MIN>
void block_rows(int64_t c, const Decoded* w, const int8_t* xq, const float* xd,
                const int32_t* xs, int64_t M, int64_t K, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* q = xq + m * K;
    const float* d = xd + m * (K / G);
    const int32_t* s = xs + m * (K / 32);
    float* out = y + m * ldy;
#if KVK_AVX2
    StagedRows<G> rows{w};
    switch (c) {
      case 4: dot_rows<G, MIN, 4>(rows, q, d, s, K, out); break;
      case 3: dot_rows<G, MIN, 3>(rows, q, d, s, K, out); break;
      case 2: dot_rows<G, MIN, 2>(rows, q, d, s, K, out); break;
      default: dot_rows<G, MIN, 1>(rows, q, d, s, K, out); break;
    }
#else
    for (int64_t r = 0; r < c; ++r) out[r] = dot_row<G, MIN>(w[r], q, d, s, K);
#endif
  }
}

template <int G, bool MIN>
void rows_t(int kind, const uint8_t* data, int64_t rows, int64_t row_bytes, const Quantized& a,
            int64_t M, int64_t K, float* y, int64_t ldy) {
  const int8_t* xq = a.q.data_ptr<int8_t>();
  const float* xd = a.d.data_ptr<float>();
  const int32_t* xs = a.s.data_ptr<int32_t>();
  over_items(rows, K, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> q(RB * K);
    std::vector<float> d(RB * K / 32), dm(RB * K / 32);
    std::vector<int32_t> sc(RB * K / 16), mn(RB * K / 32);
    Decoded w[RB];
    for (int r = 0; r < RB; ++r)
      w[r] = Decoded{q.data() + r * K, d.data() + r * K / 32, dm.data() + r * K / 32,
                     sc.data() + r * K / 16, mn.data() + r * K / 32};
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n = blk * RB, c = std::min<int64_t>(RB, rows - n);
      for (int64_t r = 0; r < c; ++r) decode_row(kind, data + (n + r) * row_bytes, K, w[r]);
      block_rows<G, MIN>(c, w, xq, xd, xs, M, K, y + n, ldy);
    }
  });
}

void part_rows(int kind, const at::Tensor& data, const Quantized& a, int64_t M, int64_t K,
               float* y, int64_t ldy) {
  const BlockTraits t = traits(kind);
  const uint8_t* p = data.data_ptr<uint8_t>();
  const int64_t rows = data.size(0), rb = data.size(1);
  if (interleaved(kind))
    return x8_rows(kind, p, rows, rb, a.q.data_ptr<int8_t>(), a.d.data_ptr<float>(),
                   a.s.data_ptr<int32_t>(), M, K, y, ldy);
#if KVK_AVX2
  // a decode step: dots straight from the blocks where that measured faster than a staged
  // row (not Q8_0's or Q6_K's: docs/design/weights.md)
  if (M == 1) {
    switch (kind) {
      case Q4_0: return direct_rows<Q4_0>(p, rows, rb, a, K, y);
      case Q4_1: return direct_rows<Q4_1>(p, rows, rb, a, K, y);
      case Q5_0: return direct_rows<Q5_0>(p, rows, rb, a, K, y);
      case Q4_K: return direct_rows<Q4_K>(p, rows, rb, a, K, y);
      default: break;
    }
  }
#endif
  if (t.values == 32) {
    if (t.min) rows_t<32, true>(kind, p, rows, rb, a, M, K, y, ldy);
    else rows_t<32, false>(kind, p, rows, rb, a, M, K, y, ldy);
  } else {
    if (t.min) rows_t<256, true>(kind, p, rows, rb, a, M, K, y, ldy);
    else rows_t<256, false>(kind, p, rows, rb, a, M, K, y, ldy);
  }
}

}  // namespace

std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kvcache qlinear: x float32 [M, K] contiguous expected");
  TORCH_CHECK(group == 32 || group == 256, "kvcache qlinear: group 32 or 256");
  TORCH_CHECK(x.size(1) % group == 0, "kvcache qlinear: K not a multiple of ", group);
  Quantized a = quantize(x.data_ptr<float>(), x.size(0), x.size(1), (int)group);
  return {a.q, a.d, a.s};
}

// y [M, N] = f(x) @ W^T (+ residual [M, N]); W: the parts' rows stacked (kinds[i], parts[i]).
// f: the rows as they are; with `norm` [K] their RMSNorm (eps); with glu, x is [M, 2K] and
// f(x) = silu(x[:, :K]) * x[:, K:] (the bits of kernels.linear's swiglu).
at::Tensor qlinear_rows(const at::Tensor& x, const std::vector<int64_t>& kinds,
                        const std::vector<at::Tensor>& parts, const at::Tensor& residual,
                        const at::Tensor& norm, double eps, bool glu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kvcache qlinear: x float32 [M, K] contiguous expected");
  TORCH_CHECK(kinds.size() == parts.size() && !parts.empty(),
              "kvcache qlinear: one kind per part, at least one part");
  TORCH_CHECK(!(glu && x.size(1) % 2), "kvcache qlinear: glu takes x [M, 2K]");
  const int64_t M = x.size(0), K = x.size(1) / (glu ? 2 : 1);
  int64_t N = 0;
  bool need32 = false, need256 = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_part(kinds[i], parts[i], K);
    N += parts[i].size(0);
    (traits((int)kinds[i]).values == 32 ? need32 : need256) = true;
  }
  const bool has_res = residual.numel() > 0, has_norm = norm.numel() > 0;
  TORCH_CHECK(!(has_norm && glu), "kvcache qlinear: norm or glu, not both");
  if (has_res)
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                    residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N,
                "kvcache qlinear: residual [M, N] float32, contiguous");
  if (has_norm)
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.dim() == 1 &&
                    norm.numel() == K,
                "kvcache qlinear: norm [K] float32");
  const float* xp = x.data_ptr<float>();
  at::Tensor staged;
  if (has_norm || glu) {
    staged = at::empty({M, K}, x.options());
    float* sp = staged.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      if (has_norm) {
        rms_row(xp + m * K, norm.data_ptr<float>(), K, (float)eps, sp + m * K);
      } else {  // silu(a) * b, torch's formula a / (1 + exp(-a))
        const float* r = xp + m * 2 * K;
        for (int64_t i = 0; i < K; ++i) sp[m * K + i] = r[i] / (1.f + std::exp(-r[i])) * r[K + i];
      }
    }
    xp = sp;
  }
  Quantized a32, a256;
  if (need32) a32 = quantize(xp, M, K, 32);
  if (need256) a256 = quantize(xp, M, K, 256);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  int64_t n0 = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int kind = (int)kinds[i];
    part_rows(kind, parts[i], traits(kind).values == 32 ? a32 : a256, M, K, yp + n0, N);
    n0 += parts[i].size(0);
  }
  if (has_res) {  // residual + product, as torch adds them
    const float* rp = residual.data_ptr<float>();
    for (int64_t i = 0; i < M * N; ++i) yp[i] = rp[i] + yp[i];
  }
  return y;
}

}  // namespace kvk
