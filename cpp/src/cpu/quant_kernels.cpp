// Blockwise NF4 / int8 quantize and dequantize kernels, compiled once per ISA (scalar, AVX2,
// AVX-512). Every vector path computes exactly what the scalar path computes (element-wise IEEE
// float operations, comparisons, exact conversions), so all ISAs give the same bytes.
// The element conversions and the vector layer: quant_simd.h.
#include "cpu/quant_kernels.h"

#include <cstdint>
#include <cstring>

#include "cpu/quant_simd.h"
#include "ramstream/quant_format.h"

namespace ramstream::cpu::RAMSTREAM_ISA_NS {
namespace {

// ---- per block ----------------------------------------------------------------------------------

// max |x| over x[e0, e0 + cnt), NaN ignored (the result is never NaN).
template <class T>
float block_absmax(const void* x, int64_t e0, int64_t cnt) {
  int64_t i = 0;
  float m = 0.0f;
#if RAMSTREAM_ISA_LEVEL > 0
  if (cnt >= kW) {
    V m0 = vset1(0.0f), m1 = vset1(0.0f);
    for (; i + 2 * kW <= cnt; i += 2 * kW) {
      m0 = vmax(vabs(vload<T>(x, e0 + i)), m0);
      m1 = vmax(vabs(vload<T>(x, e0 + i + kW)), m1);
    }
    for (; i + kW <= cnt; i += kW) m0 = vmax(vabs(vload<T>(x, e0 + i)), m0);
    m = vhmax(vmax(m0, m1));
  }
#endif
  for (; i < cnt; ++i) m = max_ignore_nan(abs_s(load_s<T>(x, e0 + i)), m);
  return m;
}

#if RAMSTREAM_ISA_LEVEL > 0
using Quantizer = Nf4Quantizer;
#else
struct Quantizer {};
#endif

// One NF4 block of cnt elements starting at even element e0; kFull: reciprocal, else division.
// quant: built once per range (its tables).
template <class T, bool kFull>
void nf4_quantize_block([[maybe_unused]] const Quantizer& quant, const void* x, int64_t e0, int64_t cnt, uint8_t* packed,
                        float* absmax) {
  const float amax = block_absmax<T>(x, e0, cnt);
  *absmax = amax;
  const float d = amax > kNf4MinAbsmax ? amax : kNf4MinAbsmax;
  const float r = 1.0f / d;
  uint8_t* out = packed + e0 / 2;
  int64_t i = 0;
#if RAMSTREAM_ISA_LEVEL > 0
  const V vr = vset1(r), vd = vset1(d), lo = vset1(-1.0f), hi = vset1(1.0f);
  for (; i + kW <= cnt; i += kW) {
    const V v = vload<T>(x, e0 + i);
    const V s = kFull ? vmul(v, vr) : vdiv(v, vd);
    quant.pack(vmin(vmax(vnan_to_zero(s), lo), hi), out + i / 2);
  }
#endif
  auto code = [&](int64_t k) {
    const float v = load_s<T>(x, e0 + k);
    return nf4_code(clamp_unit(kFull ? v * r : v / d));
  };
  for (; i + 2 <= cnt; i += 2) out[i / 2] = static_cast<uint8_t>((code(i) << 4) | code(i + 1));
  if (i < cnt) out[i / 2] = static_cast<uint8_t>((code(i) << 4) | kNf4ZeroCode);
}

#if RAMSTREAM_ISA_LEVEL > 0
// A full block of 64 elements (the default block size) kept in registers between its absmax and
// its codes: each element is loaded and converted once. The same bytes as nf4_quantize_block
// (max is order-free over non-NaN values; NaN is skipped either way).
constexpr int64_t kRegBlock = 64;
template <class T>
void nf4_quantize_block64(const Quantizer& quant, const void* x, int64_t e0, uint8_t* packed, float* absmax) {
  constexpr int kVecs = static_cast<int>(kRegBlock / kW);
  V v[kVecs];
  V m = vset1(0.0f);
  for (int j = 0; j < kVecs; ++j) {
    v[j] = vload<T>(x, e0 + j * kW);
    m = vmax(vabs(v[j]), m);
  }
  const float amax = vhmax(m);
  *absmax = amax;
  const V vr = vset1(1.0f / (amax > kNf4MinAbsmax ? amax : kNf4MinAbsmax));
  const V lo = vset1(-1.0f), hi = vset1(1.0f);
  uint8_t* out = packed + e0 / 2;
  for (int j = 0; j < kVecs; ++j) quant.pack(vmin(vmax(vnan_to_zero(vmul(v[j], vr)), lo), hi), out + j * kW / 2);
}
#endif

template <class T>
void nf4_dequantize_block(const uint8_t* packed, float amax, int64_t e0, int64_t cnt, void* out) {
  const uint8_t* in = packed + e0 / 2;
  int64_t i = 0;
#if RAMSTREAM_ISA_LEVEL > 0
  const Nf4Decoder dec;
  const V va = vset1(amax);
  for (; i + kW <= cnt; i += kW) vstore<T>(out, e0 + i, vmul(dec.decode(in + i / 2), va));
#endif
  for (; i + 2 <= cnt; i += 2) {
    const uint8_t b = in[i / 2];
    store_s<T>(out, e0 + i, kNf4Code[b >> 4] * amax);
    store_s<T>(out, e0 + i + 1, kNf4Code[b & 15] * amax);
  }
  if (i < cnt) store_s<T>(out, e0 + i, kNf4Code[in[i / 2] >> 4] * amax);
}

template <class T>
void int8_quantize_block(const void* x, int64_t e0, int64_t cnt, std::int8_t* codes, float* absmax) {
  const float amax = block_absmax<T>(x, e0, cnt);
  *absmax = amax;
  std::int8_t* out = codes + e0;
  if (amax == 0.0f) {
    std::memset(out, 0, static_cast<std::size_t>(cnt));
    return;
  }
  int64_t i = 0;
#if RAMSTREAM_ISA_LEVEL > 0
  const V va = vset1(amax), levels = vset1(kInt8Levels);
  for (; i + kW <= cnt; i += kW)
    int8_store_codes(vnan_to_zero(vmul(vdiv(vload<T>(x, e0 + i), va), levels)), out + i);
#endif
  for (; i < cnt; ++i) out[i] = int8_code(load_s<T>(x, e0 + i), amax);
}

template <class T>
void int8_dequantize_block(const std::int8_t* codes, float amax, int64_t e0, int64_t cnt, void* out) {
  const float scale = amax / kInt8Levels;
  int64_t i = 0;
#if RAMSTREAM_ISA_LEVEL > 0
  const V vs = vset1(scale);
  for (; i + kW <= cnt; i += kW) vstore<T>(out, e0 + i, vmul(int8_load_codes(codes + e0 + i), vs));
#endif
  for (; i < cnt; ++i) store_s<T>(out, e0 + i, static_cast<float>(codes[e0 + i]) * scale);
}

// ---- block ranges -------------------------------------------------------------------------------

template <class T>
void nf4_quantize_range(const void* x, int64_t n, int64_t block, int64_t b0, int64_t b1,
                        uint8_t* packed, float* absmax) {
  const Quantizer quant;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t e0 = b * block;
    const int64_t cnt = n - e0 < block ? n - e0 : block;
#if RAMSTREAM_ISA_LEVEL > 0
    if (cnt == kRegBlock) {
      nf4_quantize_block64<T>(quant, x, e0, packed, absmax + b);
      continue;
    }
#endif
    if (cnt == block)
      nf4_quantize_block<T, true>(quant, x, e0, cnt, packed, absmax + b);
    else
      nf4_quantize_block<T, false>(quant, x, e0, cnt, packed, absmax + b);
  }
}

template <class T>
void nf4_dequantize_range(const uint8_t* packed, const float* absmax, int64_t n, int64_t block,
                          int64_t b0, int64_t b1, void* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t e0 = b * block;
    nf4_dequantize_block<T>(packed, absmax[b], e0, n - e0 < block ? n - e0 : block, out);
  }
}

template <class T>
void int8_quantize_range(const void* x, int64_t n, int64_t block, int64_t b0, int64_t b1,
                         std::int8_t* codes, float* absmax) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t e0 = b * block;
    int8_quantize_block<T>(x, e0, n - e0 < block ? n - e0 : block, codes, absmax + b);
  }
}

template <class T>
void int8_dequantize_range(const std::int8_t* codes, const float* absmax, int64_t n, int64_t block,
                           int64_t b0, int64_t b1, void* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t e0 = b * block;
    int8_dequantize_block<T>(codes, absmax[b], e0, n - e0 < block ? n - e0 : block, out);
  }
}

}  // namespace

// ---- entry points -------------------------------------------------------------------------------

void quantize_nf4_blocks(const void* x, DType x_dtype, int64_t n, int64_t block, int64_t b0,
                         int64_t b1, uint8_t* packed, float* absmax) {
  switch (x_dtype) {
    case DType::kBFloat16: return nf4_quantize_range<BF16>(x, n, block, b0, b1, packed, absmax);
    case DType::kFloat16: return nf4_quantize_range<F16>(x, n, block, b0, b1, packed, absmax);
    default: return nf4_quantize_range<F32>(x, n, block, b0, b1, packed, absmax);
  }
}

void dequantize_nf4_blocks(const uint8_t* packed, const float* absmax, int64_t n, int64_t block,
                           int64_t b0, int64_t b1, void* out, DType out_dtype) {
  switch (out_dtype) {
    case DType::kBFloat16: return nf4_dequantize_range<BF16>(packed, absmax, n, block, b0, b1, out);
    case DType::kFloat16: return nf4_dequantize_range<F16>(packed, absmax, n, block, b0, b1, out);
    default: return nf4_dequantize_range<F32>(packed, absmax, n, block, b0, b1, out);
  }
}

void quantize_int8_blocks(const void* x, DType x_dtype, int64_t n, int64_t block, int64_t b0,
                          int64_t b1, std::int8_t* codes, float* absmax) {
  switch (x_dtype) {
    case DType::kBFloat16: return int8_quantize_range<BF16>(x, n, block, b0, b1, codes, absmax);
    case DType::kFloat16: return int8_quantize_range<F16>(x, n, block, b0, b1, codes, absmax);
    default: return int8_quantize_range<F32>(x, n, block, b0, b1, codes, absmax);
  }
}

void dequantize_int8_blocks(const std::int8_t* codes, const float* absmax, int64_t n, int64_t block,
                            int64_t b0, int64_t b1, void* out, DType out_dtype) {
  switch (out_dtype) {
    case DType::kBFloat16: return int8_dequantize_range<BF16>(codes, absmax, n, block, b0, b1, out);
    case DType::kFloat16: return int8_dequantize_range<F16>(codes, absmax, n, block, b0, b1, out);
    default: return int8_dequantize_range<F32>(codes, absmax, n, block, b0, b1, out);
  }
}

}  // namespace ramstream::cpu::RAMSTREAM_ISA_NS
