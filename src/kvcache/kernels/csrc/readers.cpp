// Codec readers (readers.h): what every codec family reads the same way (fp16 window rows,
// runs of cells, per-cell fields, the line stream), a Reader made from a Layout, and decode(),
// the one switch over kinds into each family's unit (codecs/).
#include "codecs/family.h"

namespace kvk {

namespace {
// The stored row of cell c that the kernel reads (all H heads): its fp16 window row or its code
// row, and its length in bytes; nullptr for a cell with neither (what touch() and the line
// stream fetch)
inline const char* stored_row(const Reader& r, int64_t c, int64_t* bytes) {
  if (in_window(r, c)) {
    const int32_t slot = r.window[c];
    if (slot < 0 || slot >= r.residual_rows) return nullptr;  // half_rows reports it
    *bytes = r.H * r.D * 2;
    return reinterpret_cast<const char*>(r.residual + (int64_t)slot * r.H * r.D);
  }
  if (c >= r.rows) return nullptr;
  *bytes = r.data_cell;
  return reinterpret_cast<const char*>(r.data + c * r.data_cell);
}
}  // namespace

// Whether cells[0:n] are consecutive ids (cells[j] == cells[0] + j): a sequence's cells are
// handed out in runs, and a run's window slots, codes and fields are contiguous.
bool is_run(const int32_t* cells, int n) {
  if (n == 0) return false;
  const int32_t c0 = cells[0];
  if ((int64_t)cells[n - 1] - c0 != n - 1) return false;
  int j = 0;
#if KVK_AVX512
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; j + 16 <= n; j += 16)
    if (_mm512_cmpneq_epi32_mask(_mm512_loadu_si512(cells + j),
                                 _mm512_add_epi32(_mm512_set1_epi32(c0 + j), iota)))
      return false;
#elif KVK_AVX2
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j + 8 <= n; j += 8) {
    const __m256i want = _mm256_add_epi32(_mm256_set1_epi32(c0 + j), iota);
    const __m256i got = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cells + j));
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(got, want)) != -1) return false;
  }
#endif
  for (; j < n; ++j)
    if (cells[j] != c0 + j) return false;
  return true;
}

namespace {
#if KVK_AVX512
// The field `inner` of 16 consecutive records of `stride` <= 8 fp16 fields (16 * stride words
// from p): the records loaded whole (masked loads: never past them) and the field picked out
// by word permutes, no gather (a gather of 16 took ~40 cycles here, the permutes a few).
struct FieldPick {
  __m512i idx, idx_hi;  // words of the first / second 64 of the block
  __mmask32 upper;      // lanes whose word is in the second 64
  int words;

  FieldPick(int64_t stride, int64_t inner) : words((int)(16 * stride)) {
    // lane k: inner + k * stride, built in registers (a table written to the stack and read
    // back as one vector waits on store forwarding)
    const __m512i k = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 14,
                                       13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    idx = _mm512_add_epi16(_mm512_set1_epi16((int16_t)inner),
                           _mm512_mullo_epi16(k, _mm512_set1_epi16((int16_t)stride)));
    idx_hi = _mm512_sub_epi16(idx, _mm512_set1_epi16(64));
    upper = _mm512_cmpge_epi16_mask(idx, _mm512_set1_epi16(64)) & 0xffffu;
  }
  __m512 operator()(const uint16_t* p) const {
    auto part = [&](int k) {  // words [32 k, 32 k + 32) of the block
      const int n = std::clamp(words - 32 * k, 0, 32);
      return _mm512_maskz_loadu_epi16(n == 32 ? ~0u : (1u << n) - 1, p + 32 * k);
    };
    __m512i r = _mm512_permutex2var_epi16(part(0), idx, part(1));
    if (words > 64)
      r = _mm512_mask_mov_epi16(r, upper, _mm512_permutex2var_epi16(part(2), idx_hi, part(3)));
    return _mm512_cvtph_ps(_mm512_castsi512_si256(r));
  }
};
#endif
}  // namespace

// out[j] = the fp16 field `inner` of cells[j]'s record as a float, for j in [a, b): records of
// `stride` fp16 fields, one a cell (`rows` cells). With AVX-512, 16 cells a step: runs of 16
// consecutive cells (a sequence's cells are handed out in runs) read their records whole
// (FieldPick); other cells a gather of the 32 bits holding the field and its neighbour in the
// same record (the field before it for a record's last field), so that no read leaves the
// array. With AVX2 only, 8 cells a step: a run of 8 cells loads its fields one by one into a
// vector (faster than AVX2's gather there: docs/design/kernels.md), other cells that gather;
// a scalar tail.
void half_fields(const uint16_t* fields, int64_t rows, int64_t stride, int64_t inner,
                 const int32_t* cells, int a, int b, float* out) {
  const uint16_t* base = fields + inner;
  int j = a;
#if KVK_AVX512
  if (stride >= 2 && rows * stride < (int64_t{1} << 31)) {
    const bool last = inner + 1 == stride;
    const int* words = reinterpret_cast<const int*>(last ? base - 1 : base);
    const __m512i vs = _mm512_set1_epi32((int)stride);
    const bool pick = stride <= 8;
    const FieldPick picker(pick ? stride : 1, pick ? inner : 0);
    for (; j + 16 <= b; j += 16) {
      if (pick && is_run(cells + j, 16)) {
        _mm512_storeu_ps(out + j, picker(fields + (int64_t)cells[j] * stride));
        continue;
      }
      const __m512i at = _mm512_mullo_epi32(_mm512_loadu_si512(cells + j), vs);
      __m512i d = _mm512_i32gather_epi32(at, words, 2);
      if (last) d = _mm512_srli_epi32(d, 16);
      _mm512_storeu_ps(out + j, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));
    }
  }
#elif KVK_AVX2
  if (stride >= 2 && rows * stride < (int64_t{1} << 31)) {  // the same gather, 8 cells a step
    const bool last = inner + 1 == stride;
    const int* words = reinterpret_cast<const int*>(last ? base - 1 : base);
    const __m256i vs = _mm256_set1_epi32((int)stride), low16 = _mm256_set1_epi32(0xffff);
    for (; j + 8 <= b; j += 8) {
      if (is_run(cells + j, 8)) {  // 8 records in a row: the fields loaded one by one
        const uint16_t* f = base + (int64_t)cells[j] * stride;
        const __m128i h = _mm_setr_epi16(
            (short)f[0], (short)f[stride], (short)f[2 * stride], (short)f[3 * stride],
            (short)f[4 * stride], (short)f[5 * stride], (short)f[6 * stride], (short)f[7 * stride]);
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(h));
        continue;
      }
      const __m256i at = _mm256_mullo_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cells + j)), vs);
      __m256i d = _mm256_i32gather_epi32(words, at, 2);
      d = last ? _mm256_srli_epi32(d, 16) : _mm256_and_si256(d, low16);
      const __m128i h =
          _mm_packus_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
      _mm256_storeu_ps(out + j, _mm256_cvtph_ps(h));
    }
  }
#endif
  for (; j < b; ++j) out[j] = half_to_float(base[cells[j] * stride]);
}

namespace {
// For a run of n cells from c0: the length of its prefix whose cells are all in the fp16
// window (open) or all not, the window slots read as a span
int run_prefix(const Reader& r, int64_t c0, int n, bool open) {
  const int inside = (int)std::clamp<int64_t>(r.window_len - c0, 0, n);  // cells in the map
  const int32_t* w = r.window + c0;
  int j = 0;
#if KVK_AVX512
  const __m512i zero = _mm512_setzero_si512();
  for (; j + 16 <= inside; j += 16) {
    const __mmask16 in = _mm512_cmpge_epi32_mask(_mm512_loadu_si512(w + j), zero);
    const __mmask16 differ = open ? (__mmask16)~in : in;
    if (differ) return j + __builtin_ctz(differ);
  }
#elif KVK_AVX2
  const __m256i none = _mm256_set1_epi32(-1);
  for (; j + 8 <= inside; j += 8) {
    const __m256i slots = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j));
    const unsigned in =
        (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(slots, none)));
    const unsigned differ = (open ? ~in : in) & 0xffu;
    if (differ) return j + __builtin_ctz(differ);
  }
#endif
  for (; j < inside; ++j)
    if ((w[j] >= 0) != open) return j;
  return open ? inside : n;  // past the slot map: no cell is open
}

// Whether every cell of the run cells[0:n] (is_run) has its row in the codes
bool run_in_codes(const Reader& r, const int32_t* cells, int n) {
  return cells[n - 1] < r.rows &&
         (r.window == nullptr ||
          (cells[n - 1] < r.window_len && run_prefix(r, cells[0], n, false) == n));
}
}  // namespace

bool all_codes(const Reader& r, const int32_t* cells, int n) {
  if (is_run(cells, n)) return run_in_codes(r, cells, n);
  for (int j = 0; j < n; ++j) {
    const int64_t c = cells[j];
    if (c >= r.rows) return false;
    if (r.window != nullptr && (c >= r.window_len || r.window[c] >= 0)) return false;
  }
  return true;
}

int uniform_prefix(const Reader& r, const int32_t* cells, int n) {
  if (r.window == nullptr || n == 0) return n;
  const bool first = in_window(r, cells[0]);
  if (is_run(cells, n)) return run_prefix(r, cells[0], n, first);
  int j = 1;
  while (j < n && in_window(r, cells[j]) == first) ++j;
  return j;
}

bool all_half(const Reader& r, const int32_t* cells, int n) {
  for (int j = 0; j < n; ++j) {
    const int64_t c = cells[j];
    if (!in_window(r, c) && !(r.kind == F16 && c < r.rows)) return false;
  }
  return true;
}

void add_centre_scores(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
                       const float* q, int rows, float* dots, float* sc) {
  Record centre;
  for (int j = a, k; j < b; j = k) {  // runs of cells sharing a record
    const int32_t m = r.meta_of[cells[j]];
    for (k = j + 1; k < b && r.meta_of[cells[k]] == m;) ++k;
    if (m != centre.meta || m < 0) {  // load fails on a cell without a record
      centre.load(r, cells[j], h, r.meta_a, nullptr);
      for (int g = 0; g < rows; ++g) dots[g] = dot(q + (int64_t)g * r.D, centre.a, (int)r.D);
    }
    for (int g = 0; g < rows; ++g) add_const(dots[g], sc + g * BLK + j, k - j);
  }
}

float touch(const Reader& r, const int32_t* cells, int n) {
#if KVK_AVX2
  __m256 any = _mm256_setzero_ps();
  for (int j = 0; j < n; ++j) {
    int64_t bytes = 0;
    const float* row = reinterpret_cast<const float*>(stored_row(r, cells[j], &bytes));
    if (row == nullptr) continue;
    const int64_t words = bytes / 4;
    int64_t i = 0;
    for (; i + 16 <= words; i += 16)  // every 64-byte line, as two 32-byte loads
      any = _mm256_or_ps(any, _mm256_or_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(row + i + 8)));
    if (i < words) any = _mm256_or_ps(any, _mm256_castps128_ps256(_mm_load_ss(row + i)));
  }
  return _mm256_cvtss_f32(any);
#else
  (void)r, (void)cells, (void)n;
  return 0.f;
#endif
}

void stream_rows(const Reader& r, const int32_t* cells, int n, LineStream& ls) {
  if (is_run(cells, n) && run_in_codes(r, cells, n)) {  // one span of codes
    ls.add(reinterpret_cast<const char*>(r.data + cells[0] * r.data_cell), n * r.data_cell);
    return;
  }
  for (int j = 0; j < n; ++j) {
    int64_t bytes = 0;
    const char* row = stored_row(r, cells[j], &bytes);
    if (row != nullptr) ls.add(row, bytes);
  }
}

void stream_fields(const Reader& r, const int32_t* cells, int n, LineStream& ls) {
  if (n == 0) return;
  int64_t lo = cells[0], hi = cells[0];
  for (int j = 1; j < n; ++j) lo = std::min<int64_t>(lo, cells[j]), hi = std::max<int64_t>(hi, cells[j]);
  if (hi - lo + 1 > 4 * (int64_t)n) return;  // scattered cells: not worth a span
  auto add = [&](const void* base, int64_t count, int64_t per_cell) {
    if (base == nullptr || per_cell <= 0 || lo >= count) return;
    ls.add(reinterpret_cast<const char*>(base) + lo * per_cell,
           (std::min(hi, count - 1) - lo + 1) * per_cell);
  };
  add(r.window, r.window_len, 4);
  add(r.meta_of, hi + 1, 4);
  const int64_t fields = r.H * r.scale_head;
  add(r.scale, r.rows, fields * (r.log_scale ? 1 : 2));
  add(r.low, r.rows, fields * 2);
}

Reader make_reader(const std::vector<at::Tensor>& t, const std::vector<int64_t>& ints, int64_t H,
                   int64_t D) {
  TORCH_CHECK(t.size() == NUM_SLOTS && ints.size() == NUM_INTS, "kvcache kernel: bad layout");
  Reader r;
  r.kind = ints[KIND];
  r.bits = ints[BITS];
  r.group = ints[GROUP];
  r.log_scale = ints[LOG_SCALE] != 0;
  TORCH_CHECK(ints[ROPE_MODE] >= AFTER_ROPE && ints[ROPE_MODE] <= CENTRE_ROPE,
              "kvcache kernel: bad RoPE mode ", ints[ROPE_MODE]);
  r.pre_rope = ints[ROPE_MODE] == BEFORE_ROPE;
  r.centre_rope = ints[ROPE_MODE] == CENTRE_ROPE;
  r.rotated = ints[ROTATED] != 0;
  r.H = H;
  r.D = D;
  TORCH_CHECK(D % kAlign == 0 && D <= kMaxDim, "kvcache kernel: head_dim must be a multiple of ",
              kAlign, ", at most ", kMaxDim);
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
  if (t[SCALE].dim() == 3) {  // [rows, H, groups] (rows may be 0: nothing encoded yet)
    TORCH_CHECK(t[SCALE].size(0) == r.rows && t[SCALE].size(2) > 0, "kvcache kernel: bad scale");
    r.scale_head = t[SCALE].size(2);
  }
  if (r.kind == INT8 || r.kind == AFFINE_ROWS || r.kind == TURBO)
    TORCH_CHECK(r.scale_head > 0 && D % r.scale_head == 0, "kvcache kernel: bad scale groups");
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
  TORCH_CHECK(!r.centre_rope || r.kind == TURBO, "kvcache kernel: rotated centres are turbo's");
  if (r.kind == AFFINE_ROWS || r.kind == AFFINE_CHANNELS)
    TORCH_CHECK(r.bits == 2 || r.bits == 4, "kvcache kernel: affine codes of ", r.bits, " bits");
  if (r.kind == TURBO)
    TORCH_CHECK((D & (D - 1)) == 0 && r.signs != nullptr && r.centroids != nullptr,
                "kvcache kernel: turbo needs a power-of-two head_dim, signs and levels");
  return r;
}

void decode(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a, int b,
            float* tile, const float** rows, uint8_t* dom, const Rope& rope) {
  const Tile t{r, h, cells, pos, tile, rows, dom, rope};
  switch (r.kind) {
    case F32:
    case F16:
    case BF16:
      return decode_float(t, a, b);
    case INT8:
      return decode_int8(t, a, b);
    case AFFINE_ROWS:
    case AFFINE_CHANNELS:
      return decode_affine(t, a, b);
    case TURBO:
      return decode_turbo(t, a, b);
    default:
      TORCH_CHECK(false, "kvcache kernel: unknown codec kind ", r.kind);
  }
}

}  // namespace kvk
