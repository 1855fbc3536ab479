// The NF4 and int8 blockwise formats as facts (data only, no code): the contract that the host
// kernels (cpp/src/cpu/quant_kernels.cpp) and the CUDA kernels both implement bit for bit.
//
// NF4 (bitsandbytes quantize_4bit(quant_type="nf4"), any even block size >= 2):
//   absmax[b] = max |x| over block b in float32 (the true max: 0 for an all-zero block; NaN
//               elements are ignored).
//   full block:           s = clamp(x * (1.0f / max(absmax, 1e-38f)), -1, 1)  (float reciprocal)
//   final partial block:  s = clamp(x / max(absmax, 1e-38f), -1, 1)           (true division)
//   code = number of kNf4Midpoint[i] strictly below s (s exactly on a midpoint takes the lower
//          code); a NaN s takes the code of 0.0 (kNf4ZeroCode).
//   packing: byte j = (code[2j] << 4) | code[2j + 1]; odd n pads one 0.0 (code 7) in the low
//            nibble of the last byte. bf16/fp16 input is converted to float32 first (exact).
//   dequantize: x = kNf4Code[q] * absmax[b] in float32, then rounded to nearest even into the
//               output dtype (bf16: (u + 0x7FFF + ((u >> 16) & 1)) >> 16, NaN -> sign | 0x7FC0).
// int8 symmetric blockwise:
//   absmax[b] as above; q = (int8) nearbyint((x / absmax) * 127.0f) (float division, then float
//   multiply, round half to even); q = 0 when absmax == 0 and for NaN x.
//   dequantize: x = float(q) * (absmax / 127.0f) (one float division per block), then rounded
//   into the output dtype as above.
#pragma once

namespace ramstream {

// NF4 code table, index 0..15 (ascending).
inline constexpr float kNf4Code[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// Decision thresholds: kNf4Midpoint[i] = (kNf4Code[i] + kNf4Code[i + 1]) / 2 evaluated in float32
// (the sum is rounded to float, the halving is exact).
inline constexpr float kNf4Midpoint[15] = {
    (kNf4Code[0] + kNf4Code[1]) / 2.0f,   (kNf4Code[1] + kNf4Code[2]) / 2.0f,
    (kNf4Code[2] + kNf4Code[3]) / 2.0f,   (kNf4Code[3] + kNf4Code[4]) / 2.0f,
    (kNf4Code[4] + kNf4Code[5]) / 2.0f,   (kNf4Code[5] + kNf4Code[6]) / 2.0f,
    (kNf4Code[6] + kNf4Code[7]) / 2.0f,   (kNf4Code[7] + kNf4Code[8]) / 2.0f,
    (kNf4Code[8] + kNf4Code[9]) / 2.0f,   (kNf4Code[9] + kNf4Code[10]) / 2.0f,
    (kNf4Code[10] + kNf4Code[11]) / 2.0f, (kNf4Code[11] + kNf4Code[12]) / 2.0f,
    (kNf4Code[12] + kNf4Code[13]) / 2.0f, (kNf4Code[13] + kNf4Code[14]) / 2.0f,
    (kNf4Code[14] + kNf4Code[15]) / 2.0f,
};

inline constexpr int kNf4ZeroCode = 7;            // the code of 0.0 (padding, NaN input)
inline constexpr float kNf4MinAbsmax = 1e-38f;    // divisor floor: max(absmax, 1e-38f)
inline constexpr float kInt8Levels = 127.0f;      // q in [-127, 127]

}  // namespace ramstream
