// Q4_0 / Q4_1 / Q5_0 / Q8_0 rows interleaved by 8 (kinds Q4_0X8, Q4_1X8, Q5_0X8, Q8_0X8): the
// same bytes as the GGUF rows, ordered so that one 32-byte load holds four codes of each of 8
// rows. Rows 8g..8g+7 (group g) take the bytes of those rows, block after block, GB = 8 x the
// type's block bytes each:
//
//   Q4_0X8 block b:  d[8] fp16 (16 B) | qs (128 B: 4 runs)
//   Q4_1X8 block b:  d[8] fp16 (16 B) | m[8] fp16 (16 B) | qs (128 B: 4 runs)
//   Q5_0X8 block b:  d[8] fp16 (16 B) | qh[8] (32 B: row r's 4 bytes at 4r) | qs (128 B: 4 runs)
//   Q8_0X8 block b:  d[8] fp16 (16 B) | qs (256 B: 8 runs)
//   qs: run j of 32 B holds row r's GGUF code bytes 4j..4j+3 at 32j + 4r
//
// A kernel then sums a block of 8 rows in integer lanes (Q4 codes 0..15 times int8 activations
// in int16: eight pair sums stay below 2^15; Q5_0's 0..31 widened to int32 every run; Q8_0's in
// int32), one exact int32 dot a row a block, scaled once; the stored layout changes no
// weight's value (dequantize_rows gives gguf's values of either).
#pragma once

#include <cstdint>

namespace kvk {

inline bool interleaved(int kind) {
  return kind == Q4_0X8 || kind == Q4_1X8 || kind == Q5_0X8 || kind == Q8_0X8;
}

// bytes of 8 rows' block, where their codes start, and the code bytes of one row's block
inline int x8_block_bytes(int kind) {
  return kind == Q4_1X8 ? 160 : kind == Q5_0X8 ? 176 : kind == Q8_0X8 ? 272 : 144;
}
inline int x8_codes_at(int kind) { return kind == Q4_1X8 ? 32 : kind == Q5_0X8 ? 48 : 16; }
inline int x8_code_bytes(int kind) { return kind == Q8_0X8 ? 32 : 16; }

// row `row`'s GGUF bytes (K / 32 blocks of the base type) gathered from interleaved `data`
void x8_gather_row(int kind, const uint8_t* data, int64_t row, int64_t row_bytes, int64_t K,
                   uint8_t* out);

// y[m * ldy + n] = W's row n . x's row m for every row of an interleaved part (rows % 8 == 0),
// x quantized per 32 (codes xq [M, K], scales xd [M, K / 32], sums xs [M, K / 32])
void x8_rows(int kind, const uint8_t* data, int64_t rows, int64_t row_bytes, const int8_t* xq,
             const float* xd, const int32_t* xs, int64_t M, int64_t K, float* y, int64_t ldy);

}  // namespace kvk
