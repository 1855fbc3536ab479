// Element types the core understands, and their sizes. Buffers are raw pointers + a DType.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ramstream {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kUInt8 = 3, kInt8 = 4 };

inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kUInt8:
    case DType::kInt8: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
  }
  return "?";
}

inline bool is_float_dtype(DType t) {
  return t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16;
}

}  // namespace ramstream
