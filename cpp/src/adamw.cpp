// Host AdamW dispatcher: validates, precomputes the coefficients torch uses, picks the ISA once
// per call and splits the buffers over the pool at multiples of 16 elements.
#include "ramstream/adamw.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "cpu/adamw_kernels.h"
#include "ramstream/adamw_rules.h"
#include "ramstream/cpu_features.h"
#include "ramstream/rounding.h"

#if defined(RAMSTREAM_HAVE_X86_ISAS) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace ramstream {

static_assert(static_cast<int>(DType::kFloat32) == cpu::kKF32 &&
                  static_cast<int>(DType::kBFloat16) == cpu::kKBF16 &&
                  static_cast<int>(DType::kFloat16) == cpu::kKF16,
              "kernel dtype codes must equal ramstream::DType");

namespace {

constexpr std::int64_t kGranule = 16;         // chunk boundaries: multiples of 16 elements
constexpr std::int64_t kMinChunk = 32 * 1024;  // below this a call runs inline
constexpr std::int64_t kStreamMinElems = 1 << 18;  // out gets non-temporal stores from here on
constexpr int kTasksPerThread = 4;  // several tasks per thread: the pool balances late threads

using AdamWRangeFn = void (*)(const cpu::AdamWKernelArgs&, std::int64_t, std::int64_t);

AdamWRangeFn pick_adamw_kernel() {
  switch (active_isa()) {
#ifdef RAMSTREAM_HAVE_X86_ISAS
    case Isa::kAvx512: return &cpu::avx512::adamw_range;
    case Isa::kAvx2: return &cpu::avx2::adamw_range;
#endif
    default: return &cpu::scalar::adamw_range;
  }
}

// AVX512-BF16 (vcvtne2ps2bf16) for the AVX-512 kernel's bf16 `out`; RAMSTREAM_AVX512BF16=0 turns it
// off (tests compare both paths). Read once.
bool use_avx512_bf16() {
  static const bool use = [] {
#if defined(RAMSTREAM_HAVE_X86_ISAS) && (defined(__GNUC__) || defined(__clang__))
    const char* env = std::getenv("RAMSTREAM_AVX512BF16");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    // CPUID.(EAX=7, ECX=1):EAX bit 5. The kernel runs only where AVX-512 (and its OS support) was
    // already detected.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (eax & (1u << 5)) != 0;
#else
    return false;
#endif
  }();
  return use;
}

// Whether [a, a + an) and [b, b + bn) (bytes) share a byte.
bool overlaps(const void* a, std::int64_t an, const void* b, std::int64_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + static_cast<std::uintptr_t>(bn) && y < x + static_cast<std::uintptr_t>(an);
}

}  // namespace

std::uint32_t sr_bits(std::uint64_t seed, std::int64_t step, std::int64_t index, int moment) {
  return rounding::bits(rounding::key_base(seed, step), static_cast<std::uint64_t>(index),
                        static_cast<std::uint32_t>(moment));
}

Status validate_adamw_hyper(const AdamWHyper& h) { return adamw_hyper_status(h); }

Status adamw_step(const AdamWBuffers& b, const AdamWHyper& h, ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(validate_adamw_hyper(h));
  if (b.n < 0) return Status::invalid("adamw: n must be >= 0, got " + std::to_string(b.n));
  if (b.offset < 0 || b.offset > std::numeric_limits<std::int64_t>::max() - b.n)
    return Status::invalid("adamw: offset must be >= 0 (and offset + n must fit in int64), got " +
                           std::to_string(b.offset));
  if (b.grad_dtype != DType::kFloat32 && b.grad_dtype != DType::kBFloat16 &&
      b.grad_dtype != DType::kFloat16)
    return Status::invalid(std::string("adamw: grad dtype must be float32/bfloat16/float16, got ") +
                           dtype_name(b.grad_dtype));
  if (b.moment_dtype != DType::kFloat32 && b.moment_dtype != DType::kBFloat16)
    return Status::invalid(std::string("adamw: moment dtype must be float32/bfloat16, got ") +
                           dtype_name(b.moment_dtype));
  if (b.out != nullptr && b.out_dtype != DType::kFloat32 && b.out_dtype != DType::kBFloat16 &&
      b.out_dtype != DType::kFloat16)
    return Status::invalid(std::string("adamw: out dtype must be float32/bfloat16/float16, got ") +
                           dtype_name(b.out_dtype));
  if (b.n == 0) return Status::ok();
  if (b.param == nullptr) return Status::invalid("adamw: param is a null pointer");
  if (b.grad == nullptr) return Status::invalid("adamw: grad is a null pointer");
  if (b.exp_avg == nullptr) return Status::invalid("adamw: exp_avg is a null pointer");
  if (b.exp_avg_sq == nullptr) return Status::invalid("adamw: exp_avg_sq is a null pointer");

  // Coefficients exactly as torch's fused CPU AdamW forms them: double, rounded to float once.
  const double step = static_cast<double>(h.step);
  const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bias_correction1;
  const float c1 = static_cast<float>(1.0 - h.beta1);

  cpu::AdamWKernelArgs a{};
  a.param = b.param;
  a.grad = b.grad;
  a.exp_avg = b.exp_avg;
  a.exp_avg_sq = b.exp_avg_sq;
  a.out = b.out;
  a.grad_dtype = static_cast<int>(b.grad_dtype);
  a.moment_dtype = static_cast<int>(b.moment_dtype);
  a.out_dtype = static_cast<int>(b.out_dtype);
  // `out` is only written: non-temporal stores spare the read of each line before its write
  // (write-allocate), 2 of 22 bytes per element in the mixed case. Not when it shares memory
  // with an input (the engine passes out == grad): those lines were just read into the cache,
  // ordinary stores are faster there.
  if (b.out != nullptr && b.n >= kStreamMinElems) {
    const auto bytes = [&](DType t) { return b.n * static_cast<std::int64_t>(dtype_size(t)); };
    const std::int64_t out_bytes = bytes(b.out_dtype), moment_bytes = bytes(b.moment_dtype);
    a.out_streaming = !overlaps(b.out, out_bytes, b.grad, bytes(b.grad_dtype)) &&
                      !overlaps(b.out, out_bytes, b.param, bytes(DType::kFloat32)) &&
                      !overlaps(b.out, out_bytes, b.exp_avg, moment_bytes) &&
                      !overlaps(b.out, out_bytes, b.exp_avg_sq, moment_bytes);
  }
  a.bf16_cvt = use_avx512_bf16();
  a.tail_begin = b.n - b.n % 8;
  a.offset = b.offset;
  a.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  a.has_decay = h.weight_decay != 0.0;
  a.lerp_small = std::fabs(c1) < 0.5f;
  a.lerp_coeff = a.lerp_small ? c1 : c1 - 1.0f;
  a.beta2 = static_cast<float>(h.beta2);
  a.c2 = static_cast<float>(1.0 - h.beta2);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  a.eps = static_cast<float>(h.eps);
  a.neg_step_size = static_cast<float>(-step_size);
  a.grad_scale = h.grad_scale;
  a.has_scale = h.grad_scale != 1.0f;
  a.sr_key[0] = rounding::key(h.seed, h.step, 0);
  a.sr_key[1] = rounding::key(h.seed, h.step, 1);

  const AdamWRangeFn fn = pick_adamw_kernel();
  pool.parallel_for(
      b.n, kGranule, kMinChunk, [&](std::int64_t begin, std::int64_t end) { fn(a, begin, end); },
      kTasksPerThread * pool.size());
  return Status::ok();
}

}  // namespace ramstream
