// Per-ISA entry points of the blockwise quantization kernels; cpp/src/cpu/quant_kernels.cpp is
// compiled once per ISA into ramstream::cpu::<isa>. Each call processes blocks [b0, b1) of a
// buffer of n elements (the block that ends past n is the final partial block). Arguments are
// validated by cpp/src/quant.cpp; kernels never fail. Only the DType enum of dtype.h is used.
#pragma once
#include <cstdint>

#include "ramstream/dtype.h"

#define RAMSTREAM_QUANT_KERNEL_DECLS                                                            \
  void quantize_nf4_blocks(const void* x, ::ramstream::DType x_dtype, std::int64_t n,           \
                           std::int64_t block, std::int64_t b0, std::int64_t b1,                \
                           std::uint8_t* packed, float* absmax);                                \
  void dequantize_nf4_blocks(const std::uint8_t* packed, const float* absmax, std::int64_t n,   \
                             std::int64_t block, std::int64_t b0, std::int64_t b1, void* out,   \
                             ::ramstream::DType out_dtype);                                     \
  void quantize_int8_blocks(const void* x, ::ramstream::DType x_dtype, std::int64_t n,          \
                            std::int64_t block, std::int64_t b0, std::int64_t b1,               \
                            std::int8_t* codes, float* absmax);                                 \
  void dequantize_int8_blocks(const std::int8_t* codes, const float* absmax, std::int64_t n,    \
                              std::int64_t block, std::int64_t b0, std::int64_t b1, void* out,  \
                              ::ramstream::DType out_dtype);

namespace ramstream::cpu {
namespace scalar {
RAMSTREAM_QUANT_KERNEL_DECLS
}  // namespace scalar
#if defined(RAMSTREAM_HAVE_X86_ISAS) || (defined(RAMSTREAM_ISA_LEVEL) && RAMSTREAM_ISA_LEVEL > 0)
namespace avx2 {
RAMSTREAM_QUANT_KERNEL_DECLS
}  // namespace avx2
namespace avx512 {
RAMSTREAM_QUANT_KERNEL_DECLS
}  // namespace avx512
#endif
}  // namespace ramstream::cpu

#undef RAMSTREAM_QUANT_KERNEL_DECLS
