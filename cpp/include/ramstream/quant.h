// Blockwise quantization on the host: NF4 (4-bit, bitsandbytes' format) and symmetric int8, with
// one float32 absmax per block. The formats are specified in ramstream/quant_format.h.
//
// Buffers are flat: element i of x belongs to block i / block. Every function runs on `pool`
// (blocks split between its threads), needs no GIL, is thread-safe for disjoint outputs, and
// gives the same bytes for every ISA and thread count. Block size: even and >= 2.
#pragma once
#include <cstdint>

#include "ramstream/dtype.h"
#include "ramstream/quant_format.h"
#include "ramstream/status.h"
#include "ramstream/thread_pool.h"

namespace ramstream {

// Bytes of packed NF4 codes for n elements: ceil(n / 2).
inline std::int64_t nf4_packed_size(std::int64_t n) { return (n + 1) / 2; }
// Blocks (absmax entries) for n elements: ceil(n / block).
inline std::int64_t quant_num_blocks(std::int64_t n, std::int64_t block) {
  return block > 0 ? (n + block - 1) / block : 0;
}
// kInvalidArgument naming block_size unless block is even and >= 2.
Status validate_block_size(std::int64_t block);

// x: n elements (float32/bfloat16/float16) -> packed: nf4_packed_size(n) bytes,
// absmax: quant_num_blocks(n, block) floats.
Status quantize_nf4(const void* x, DType x_dtype, std::int64_t n, int block, std::uint8_t* packed,
                    float* absmax, ThreadPool& pool);
// packed + absmax (as written by quantize_nf4) -> out: n elements of out_dtype
// (float32/bfloat16/float16).
Status dequantize_nf4(const std::uint8_t* packed, const float* absmax, std::int64_t n, int block,
                      void* out, DType out_dtype, ThreadPool& pool);
// x: n elements (float32/bfloat16/float16) -> codes: n int8 in [-127, 127],
// absmax: quant_num_blocks(n, block) floats.
Status quantize_int8(const void* x, DType x_dtype, std::int64_t n, int block, std::int8_t* codes,
                     float* absmax, ThreadPool& pool);
// codes + absmax -> out: n elements of out_dtype (float32/bfloat16/float16).
Status dequantize_int8(const std::int8_t* codes, const float* absmax, std::int64_t n, int block,
                       void* out, DType out_dtype, ThreadPool& pool);

}  // namespace ramstream
