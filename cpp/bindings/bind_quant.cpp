// Bindings for blockwise NF4 / int8 quantization on host arrays (outputs allocated by the caller).
#include <climits>
#include <string>

#include "common.h"
#include "ramstream/quant.h"

namespace ramstream::py {
namespace {

int block_arg(const char* op, std::int64_t block_size) {
  if (block_size > INT_MAX)
    raise_value_error(std::string(op) + ": block_size must be even and >= 2 and at most " +
                      std::to_string(INT_MAX) + ", got " + std::to_string(block_size));
  Status s = validate_block_size(block_size);
  if (!s.is_ok()) raise_value_error(std::string(op) + ": " + s.message());
  return static_cast<int>(block_size);
}

DType float_arg(const Array& a, const char* op, const char* arg) {
  require_host_buffer(a, arg);
  const DType t = dtype_of(a, arg);
  if (!is_float_dtype(t))
    raise_type_error(std::string(op) + ": " + arg + " must be float32/bfloat16/float16, got " +
                     dtype_name(t));
  return t;
}

void typed_arg(const Array& a, DType want, const char* arg) {
  require_host_buffer(a, arg);
  require_dtype(a, want, arg);
}

void expect_size(const char* op, const Array& a, const char* arg, std::int64_t want,
                 const std::string& why) {
  if (numel(a) != want)
    raise_value_error(std::string(op) + ": " + arg + " has " + std::to_string(numel(a)) +
                      " elements, expected " + std::to_string(want) + " (" + why + ")");
}

std::string nf4_why(std::int64_t n) {
  return "ceil(" + std::to_string(n) + " / 2) bytes for " + std::to_string(n) + " elements";
}
std::string blocks_why(std::int64_t n, int block) {
  return "ceil(" + std::to_string(n) + " / " + std::to_string(block) + ") blocks";
}

}  // namespace

void bind_quant(nb::module_& m) {
  m.def(
      "quantize_nf4",
      [](const Array& x, const Array& packed, const Array& absmax, std::int64_t block_size) {
        const char* op = "quantize_nf4";
        const int block = block_arg(op, block_size);
        const DType xt = float_arg(x, op, "x");
        typed_arg(packed, DType::kUInt8, "packed");
        typed_arg(absmax, DType::kFloat32, "absmax");
        const std::int64_t n = numel(x);
        expect_size(op, packed, "packed", nf4_packed_size(n), nf4_why(n));
        expect_size(op, absmax, "absmax", quant_num_blocks(n, block), blocks_why(n, block));
        check_without_gil([&] {
          return quantize_nf4(x.data(), xt, n, block, static_cast<std::uint8_t*>(packed.data()),
                              static_cast<float*>(absmax.data()), global_pool());
        });
      },
      nb::arg("x").noconvert(), nb::arg("packed").noconvert(), nb::arg("absmax").noconvert(),
      nb::arg("block_size"),
      "NF4-quantize host x (float32/bfloat16/float16, contiguous, n elements) into packed\n"
      "(uint8, ceil(n/2)) and absmax (float32, ceil(n/block_size)), in place. GIL released.");
  m.def(
      "dequantize_nf4",
      [](const Array& packed, const Array& absmax, const Array& out, std::int64_t block_size) {
        const char* op = "dequantize_nf4";
        const int block = block_arg(op, block_size);
        typed_arg(packed, DType::kUInt8, "packed");
        typed_arg(absmax, DType::kFloat32, "absmax");
        const DType ot = float_arg(out, op, "out");
        const std::int64_t n = numel(out);
        expect_size(op, packed, "packed", nf4_packed_size(n), nf4_why(n));
        expect_size(op, absmax, "absmax", quant_num_blocks(n, block), blocks_why(n, block));
        check_without_gil([&] {
          return dequantize_nf4(static_cast<const std::uint8_t*>(packed.data()),
                                static_cast<const float*>(absmax.data()), n, block, out.data(), ot,
                                global_pool());
        });
      },
      nb::arg("packed").noconvert(), nb::arg("absmax").noconvert(), nb::arg("out").noconvert(),
      nb::arg("block_size"),
      "Dequantize host NF4 packed (uint8, ceil(n/2)) + absmax (float32) into out (n elements,\n"
      "float32/bfloat16/float16, contiguous), in place. GIL released.");
  m.def(
      "quantize_int8",
      [](const Array& x, const Array& codes, const Array& absmax, std::int64_t block_size) {
        const char* op = "quantize_int8";
        const int block = block_arg(op, block_size);
        const DType xt = float_arg(x, op, "x");
        typed_arg(codes, DType::kInt8, "codes");
        typed_arg(absmax, DType::kFloat32, "absmax");
        const std::int64_t n = numel(x);
        expect_size(op, codes, "codes", n, "one code per element of x");
        expect_size(op, absmax, "absmax", quant_num_blocks(n, block), blocks_why(n, block));
        check_without_gil([&] {
          return quantize_int8(x.data(), xt, n, block, static_cast<std::int8_t*>(codes.data()),
                               static_cast<float*>(absmax.data()), global_pool());
        });
      },
      nb::arg("x").noconvert(), nb::arg("codes").noconvert(), nb::arg("absmax").noconvert(),
      nb::arg("block_size"),
      "int8-quantize host x (float32/bfloat16/float16, contiguous, n elements) into codes\n"
      "(int8, n) and absmax (float32, ceil(n/block_size)), in place. GIL released.");
  m.def(
      "dequantize_int8",
      [](const Array& codes, const Array& absmax, const Array& out, std::int64_t block_size) {
        const char* op = "dequantize_int8";
        const int block = block_arg(op, block_size);
        typed_arg(codes, DType::kInt8, "codes");
        typed_arg(absmax, DType::kFloat32, "absmax");
        const DType ot = float_arg(out, op, "out");
        const std::int64_t n = numel(out);
        expect_size(op, codes, "codes", n, "one code per element of out");
        expect_size(op, absmax, "absmax", quant_num_blocks(n, block), blocks_why(n, block));
        check_without_gil([&] {
          return dequantize_int8(static_cast<const std::int8_t*>(codes.data()),
                                 static_cast<const float*>(absmax.data()), n, block, out.data(), ot,
                                 global_pool());
        });
      },
      nb::arg("codes").noconvert(), nb::arg("absmax").noconvert(), nb::arg("out").noconvert(),
      nb::arg("block_size"),
      "Dequantize host int8 codes (n) + absmax (float32) into out (n elements,\n"
      "float32/bfloat16/float16, contiguous), in place. GIL released.");
}

}  // namespace ramstream::py
