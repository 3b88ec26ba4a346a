// Codec readers: decode a block of cells' rows of one KV head into float rows, straight from
// the stored codes (what a Reader is made from: contract.h; one unit per codec family in
// codecs/).
//
// decode() fills rows[j] (a pointer to D floats) for j in [a, b) of a block of cells:
//   * fp32 storage without RoPE to apply hands back pointers into the storage itself;
//   * everything else is dequantized into the caller's tile [BLK, D] first;
//   * a cell whose row lives in the fp16 recent window (slot >= 0) is read from there;
//   * keys stored before RoPE are rotated by their cell's position from the cos/sin tables;
//   * turbo keys centred in the rotary frame (CENTRE_ROPE) get their centre rotated so;
//   * dom[j] = 1 marks a row left in turbo's rotated domain (values only: the caller sums
//     those apart and rotates the sum back once).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "contract.h"
#include "simd.h"
#include "tiles.h"

namespace kvk {

struct Rope {
  const float* cos = nullptr;  // [P, D/2]
  const float* sin = nullptr;  // [P, D/2]
  int64_t count = 0;
  // [D, BLK]: the rows of positions 0 .. BLK-1 transposed, cos(j theta_i) at [i, j] and
  // sin(j theta_i) at [D/2 + i, j] (rope_offsets; nullptr: none built)
  const float* offsets = nullptr;
};

// Rope::offsets of tables cos / sin [count, D/2] (count >= BLK) into out [D * BLK]
void rope_offsets(const float* cos, const float* sin, int64_t D, float* out);

struct Reader {
  int64_t kind = F32;
  int64_t H = 0, D = 0;
  const uint8_t* data = nullptr;
  int64_t data_cell = 0, data_head = 0;  // bytes per cell / per head row
  int64_t rows = 0;                 // cells with codes (data's first dimension)
  const uint16_t* scale = nullptr;  // fp16 (bf16 / uint8 for turbo) [rows, H, scale_head]
  const uint16_t* low = nullptr;
  int64_t scale_head = 0;
  const int32_t* meta_of = nullptr;  // [N] metadata record of a cell (-1: none)
  const uint16_t* meta_a = nullptr;  // fp16 [M, H, D]: key centre / channel scale
  const uint16_t* meta_b = nullptr;  // fp16 [M, H, D]: channel minimum
  int64_t meta_rows = 0;
  const int32_t* window = nullptr;   // [N] cell -> fp16 slot, -1 = codes
  int64_t window_len = 0;
  const uint16_t* residual = nullptr;    // fp16 [rows, H, D]
  int64_t residual_rows = 0;
  const float* centroids = nullptr;      // turbo: codebook levels at unit scale
  const float* signs = nullptr;          // turbo: [H, P] sign flips of the rotation
  int64_t bits = 0, group = 0;
  bool log_scale = false, pre_rope = false, rotated = false;
  bool centre_rope = false;  // CENTRE_ROPE: the centre of cell c is rotated by its position
  bool direct = false;  // fp32 rows handed out as pointers into storage
};

Reader make_reader(const std::vector<at::Tensor>& t, const std::vector<int64_t>& ints, int64_t H,
                   int64_t D);

// Decode rows [a, b) of a block: cells[j], pos[j]; rows[j] -> D floats; dom[j] as above.
void decode(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a, int b,
            float* tile, const float** rows, uint8_t* dom, const Rope& rope);

// Whether every cell of cells[0:n] has its row in the codes (none in an fp16 window).
bool all_codes(const Reader& r, const int32_t* cells, int n);

// Length of the longest prefix of cells[0:n] whose rows are all in the fp16 window or all
// in the codes (n without a window): the kernel cuts tiles there, so that a tile's rows are
// all read one way.
int uniform_prefix(const Reader& r, const int32_t* cells, int n);

// Whether every cell of cells[0:n] has an fp16 row: in the recent window, or fp16 storage.
bool all_half(const Reader& r, const int32_t* cells, int n);

// fp16 readers: rows[j] -> the fp16 row of head h of cells[j] (window or storage), for j in
// [a, b) (all_half); the tile math converts as it loads: no decoded copy.
void half_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
               const uint16_t** rows);

// int8 readers: rows[j] -> the int8 codes of head h of cells[j], scales[j] their row scale,
// for j in [a, b) (cells all in the codes: all_codes). The tile math reads the codes as they
// are and applies the scales to scores and weights: no decoded copy.
void int8_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
               const int8_t** rows, float* scales);

// 4-bit affine readers (codes in groups of D / groups channels): rows[j] -> the packed codes of
// head h of cells[j], scale[g * BLK + j] and low[g * BLK + j] its group g's scale and minimum
// (x = code * scale + low, plus the sequence's key centre when the codec has one: see
// add_centre_scores), for j in [a, b) (cells all in the codes).
void affine4_rows(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
                  const uint8_t** rows, float* scale, float* low);

// KIVI 4-bit keys stored before RoPE, read as they are (cells all in the codes): t.rows[j] ->
// the packed codes of head h of cells[j], t.a / t.b its group record's channel scale and
// minimum (converted to float once per record, into `ranges` [b - a, 2, D]), t.cs / t.sn the
// cos / sin rows of pos[j]; for j in [a, b).
void kivi4_keys(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a,
                int b, const Rope& rope, float* ranges, KiviKeys& t);

// Keys stored before RoPE whose rows are fp16 (a tile of window rows, or fp16 storage):
// t.half[j] -> the row of head h of cells[j], t.cs / t.sn its position's cos / sin rows, for
// j in [a, b) (all_half); scored rotated in registers (qk_kivi_rows with half_rows)
void rope_half_keys(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a,
                    int b, const Rope& rope, KiviKeys& t);

// ---- turbo keys after RoPE, scored from their codes ------------------------------------
// A key row decodes to k = s * fwht(L[codes]) * signs / sqrt(D) + centre (L: the codebook
// levels at unit scale, s: the row's norm), so <q, k> = s * <qrot, L[codes]> + <q, centre>
// with qrot = fwht(q * signs / sqrt(D)) computed once per query row (turbo_query): each key
// costs a table lookup per channel and no transform. With CENTRE_ROPE the centre c is
// rotated to the cell's position p, and <q, R_p c> = sum_i cos_i(p) A_i + sin_i(p) B_i over
// the D/2 rotation pairs (i, i + D/2), A_i = q_i c_i + q_{i+D/2} c_{i+D/2},
// B_i = q_{i+D/2} c_i - q_i c_{i+D/2}: A | B once per query row and record, then a dot with
// the position's cos | sin rows per cell.
struct TurboRows {
  const uint8_t* rows[BLK];     // packed codes of the cells' rows
  float s[BLK];                 // their norms
  const float* ab[BLK];         // [rows, D] A | B of each query row for the cell's record
  const float *cs[BLK], *sn[BLK];  // the cos and sin rows [D/2] of the cell's position
  const float* offsets = nullptr;  // Rope::offsets (CENTRE_ROPE; nullptr: none)
  float table[256];             // the codebook levels, zero-padded to 32 at least
  std::vector<float> abs;       // the records' A | B blocks
  // the levels as int16 steps of lstep (up to 32 levels): low bytes of levels 0-15, 16-31,
  // high bytes of 0-15, 16-31 (pshufb tables); exact16: every level is such a step
  alignas(16) uint8_t lut[4][16];
  float lstep = 0.f;
  bool exact16 = false;
  int levels = 0;  // the codebook the tables hold (2^bits levels; 0: none yet)
};

// Turbo keys scored in int16 products (keys16): 2 to 5 bits, after RoPE (or centred with
// CENTRE_ROPE), D a multiple of 64, no padding. The codebook's levels lie on steps of
// max |level| / 8191 (codecs/codebook.py), the query rotated into the codes' domain is
// rounded to int16 steps (turbo_query16), and <qrot, L[codes]> is summed exactly in int32
// (8 products a lane: 8 * 8191 * 32767 < 2^31).
bool turbo_keys16(const Reader& r);

// qrot [D] = the codes' domain query of q [D] (scaled) for head h rounded to int16 steps
// (q16; returned: the step), and q rewritten as the query those steps rotate back to, the
// query every score of the row uses (window rows and centres too). As attend.py's
// turbo_steps.
float turbo_query16(const Reader& r, int64_t h, float* q, float* qrot, int16_t* q16);

// Whether turbo values can be summed from their codes (in the rotated domain): D a multiple
// of 64, no padding.
bool turbo_values_direct(const Reader& r);

// Whether turbo keys can be scored from their codes: stored after RoPE, D a multiple of 64.
bool turbo_keys_direct(const Reader& r);

// out [D] = fwht(q * signs[h] / sqrt(D)): query row q in the codes' domain of head h
void turbo_query(const Reader& r, int64_t h, const float* q, float* out);

// t for cells [a, b) of head h (all in the codes): code rows, norms, and with CENTRE_ROPE the
// A | B blocks of the `rows` query rows q [rows, D] (scaled) and the cos / sin rows.
void turbo_keys(const Reader& r, int64_t h, const int32_t* cells, const int32_t* pos, int a,
                int b, const Rope& rope, const float* q, int rows, TurboRows& t);

// t for the value rows of cells [a, b) of head h (all in the codes): code rows, norms, levels
void turbo_values(const Reader& r, int64_t h, const int32_t* cells, int a, int b, TurboRows& t);

// acc[g * D + c] += sum_j p[g * BLK + j] * levels of value j's code c (rotated domain; the
// caller has multiplied p by the cells' norms), g < rows, j in [ja, jb)
void pv_turbo_rows(const Reader& r, const float* p, int rows, const TurboRows& t, int ja, int jb,
                   float* acc, LineStream* ls);

// The scores of qk_turbo_rows (below) from int16 query steps: q16 [rows, D] and their steps
// qstep [rows] (turbo_query16); needs turbo_keys16(r), t.exact16 and AVX2.
void qk_turbo16_rows(const Reader& r, const int16_t* q16, const float* qstep, int rows,
                     int row0, const TurboRows& t, int ja, int jb, float* sc, LineStream* ls);

// sc[g * BLK + j] = <query row g, key j> for g < rows, j in [ja, jb): qrot [rows, D] the rows
// in the codes' domain, row0 the first row's index in t's A | B blocks.
void qk_turbo_rows(const Reader& r, const float* qrot, int rows, int row0, const TurboRows& t,
                   int ja, int jb, float* sc, LineStream* ls);

// sc[g * BLK + j] += <q[g], centre of cells[j]> for g < rows, j in [a, b): the key-centre part
// of scores read from centred codes. A record's dots are computed once while consecutive cells
// share it (dots: rows floats of scratch).
void add_centre_scores(const Reader& r, int64_t h, const int32_t* cells, int a, int b,
                       const float* q, int rows, float* dots, float* sc);

// Load the stored rows [H, *] (fp16 window rows or code rows) of cells[0:n] (the tile about
// to be computed) in one tight pass, every line once, and return a value that depends on them
// (so the loads are kept): a tile's math keeps few cache misses in flight, this pass many.
// The math then reads the tile from cache. Used for a work item's first tile only: the tiles
// after it are fetched during the math of the tile before (LineStream, its prefetches spread
// over the inner loops). Why and what it bought: docs/design/kernels.md.
float touch(const Reader& r, const int32_t* cells, int n);

// The stored rows of cells[0:n] that touch() would read (fp16 window rows or code rows), added
// to the line stream: the kernel fetches the next tile's rows while it computes this one.
void stream_rows(const Reader& r, const int32_t* cells, int n, LineStream& ls);

// The per-cell fields the readers look up for cells[0:n] (fp16 window slots, metadata record
// ids, scales, minimums), added to the line stream as a span each over the cells' range; none
// when the cells are scattered (their range over 4 n).
void stream_fields(const Reader& r, const int32_t* cells, int n, LineStream& ls);

// Inverse turbo rotation in place: y [P] -> x [D] (fwht(y) * signs, first D entries).
void turbo_unrotate(const float* signs, float* y, int64_t P);

}  // namespace kvk
