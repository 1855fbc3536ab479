// Blockwise NF4 / int8 quantization: validation, ISA dispatch, blocks split over the thread pool.
#include "ramstream/quant.h"

#include <algorithm>
#include <string>

#include "cpu/quant_kernels.h"
#include "ramstream/cpu_features.h"

namespace ramstream {
namespace {

// Below this many elements per task a range runs on the caller (thread hand-off costs ~µs).
constexpr std::int64_t kMinElemsPerTask = std::int64_t{1} << 16;
constexpr int kTasksPerThread = 8;

struct QuantKernels {
  decltype(&cpu::scalar::quantize_nf4_blocks) quantize_nf4;
  decltype(&cpu::scalar::dequantize_nf4_blocks) dequantize_nf4;
  decltype(&cpu::scalar::quantize_int8_blocks) quantize_int8;
  decltype(&cpu::scalar::dequantize_int8_blocks) dequantize_int8;
};

QuantKernels kernels() {
  switch (active_isa()) {
#ifdef RAMSTREAM_HAVE_X86_ISAS
    case Isa::kAvx512:
      return {cpu::avx512::quantize_nf4_blocks, cpu::avx512::dequantize_nf4_blocks,
              cpu::avx512::quantize_int8_blocks, cpu::avx512::dequantize_int8_blocks};
    case Isa::kAvx2:
      return {cpu::avx2::quantize_nf4_blocks, cpu::avx2::dequantize_nf4_blocks,
              cpu::avx2::quantize_int8_blocks, cpu::avx2::dequantize_int8_blocks};
#endif
    default:
      return {cpu::scalar::quantize_nf4_blocks, cpu::scalar::dequantize_nf4_blocks,
              cpu::scalar::quantize_int8_blocks, cpu::scalar::dequantize_int8_blocks};
  }
}

Status check_args(const char* op, std::int64_t n, int block, const void* in, const char* in_name,
                  const void* out, const char* out_name, const float* absmax, DType float_dtype,
                  const char* float_name) {
  if (Status s = validate_block_size(block); !s.is_ok())
    return Status::invalid(std::string(op) + ": " + s.message());
  if (n < 0) return Status::invalid(std::string(op) + ": n must be >= 0, got " + std::to_string(n));
  if (!is_float_dtype(float_dtype))
    return Status::invalid(std::string(op) + ": " + float_name +
                           " must be float32/bfloat16/float16, got " + dtype_name(float_dtype));
  if (n > 0) {
    if (in == nullptr) return Status::invalid(std::string(op) + ": " + in_name + " is null");
    if (out == nullptr) return Status::invalid(std::string(op) + ": " + out_name + " is null");
    if (absmax == nullptr) return Status::invalid(std::string(op) + ": absmax is null");
  }
  return Status::ok();
}

// Runs kernel(a0, a1, n, block, b0, b1, a2, a3) over the blocks [b0, b1) of n elements on `pool`
// (the argument order every quantize / dequantize kernel shares); returns ok.
template <class Kernel, class A0, class A1, class A2, class A3>
Status run_blocks(Kernel kernel, ThreadPool& pool, A0 a0, A1 a1, std::int64_t n, int block, A2 a2,
                  A3 a3) {
  const std::int64_t blocks = quant_num_blocks(n, block);
  // kTasksPerThread tasks a thread, claimed as threads come free: a pool thread that the OS
  // preempts (load_model's reading threads run beside the pool) then delays one small task, not
  // an equal share of the whole call. The bytes do not depend on the split (blocks are independent).
  pool.parallel_for(
      blocks, 1, std::max<std::int64_t>(1, kMinElemsPerTask / block),
      [&](std::int64_t b0, std::int64_t b1) { kernel(a0, a1, n, block, b0, b1, a2, a3); },
      kTasksPerThread * pool.size());
  return Status::ok();
}

}  // namespace

Status validate_block_size(std::int64_t block) {
  if (block < 2 || block % 2 != 0)
    return Status::invalid("block_size must be even and >= 2, got " + std::to_string(block));
  return Status::ok();
}

Status quantize_nf4(const void* x, DType x_dtype, std::int64_t n, int block, std::uint8_t* packed,
                    float* absmax, ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(
      check_args("quantize_nf4", n, block, x, "x", packed, "packed", absmax, x_dtype, "x"));
  return run_blocks(kernels().quantize_nf4, pool, x, x_dtype, n, block, packed, absmax);
}

Status dequantize_nf4(const std::uint8_t* packed, const float* absmax, std::int64_t n, int block,
                      void* out, DType out_dtype, ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(check_args("dequantize_nf4", n, block, packed, "packed", out, "out",
                                       absmax, out_dtype, "out"));
  return run_blocks(kernels().dequantize_nf4, pool, packed, absmax, n, block, out, out_dtype);
}

Status quantize_int8(const void* x, DType x_dtype, std::int64_t n, int block, std::int8_t* codes,
                     float* absmax, ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(
      check_args("quantize_int8", n, block, x, "x", codes, "codes", absmax, x_dtype, "x"));
  return run_blocks(kernels().quantize_int8, pool, x, x_dtype, n, block, codes, absmax);
}

Status dequantize_int8(const std::int8_t* codes, const float* absmax, std::int64_t n, int block,
                       void* out, DType out_dtype, ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(check_args("dequantize_int8", n, block, codes, "codes", out, "out",
                                       absmax, out_dtype, "out"));
  return run_blocks(kernels().dequantize_int8, pool, codes, absmax, n, block, out, out_dtype);
}

}  // namespace ramstream
