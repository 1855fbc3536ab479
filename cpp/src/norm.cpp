// Dispatchers for gradient accumulation, float casts and squared L2 norms (kernels in
// cpu/norm_kernels.cpp): validate, pick the ISA once per call, split over the pool.
#include <string>
#include <vector>

#include "cpu/adamw_kernels.h"
#include "ramstream/adamw.h"
#include "ramstream/cpu_features.h"

namespace ramstream {
namespace {

constexpr std::int64_t kGranule = 16;
constexpr std::int64_t kMinChunk = 64 * 1024;       // element-wise ops below this run inline
constexpr std::int64_t kSqNormBlock = 64 * 1024;    // fixed summation blocks (multiple of 32)
constexpr int kTasksPerThread = 4;                  // the pool balances late threads

struct NormFns {
  void (*accumulate)(float*, const void*, int, std::int64_t, std::int64_t);
  void (*cast)(float*, const void*, int, float, bool, std::int64_t, std::int64_t);
  double (*sq_norm)(const void*, int, std::int64_t, std::int64_t);
};

NormFns pick() {
  switch (active_isa()) {
#ifdef RAMSTREAM_HAVE_X86_ISAS
    case Isa::kAvx512:
      return {&cpu::avx512::accumulate_range, &cpu::avx512::cast_range, &cpu::avx512::sq_norm_block};
    case Isa::kAvx2:
      return {&cpu::avx2::accumulate_range, &cpu::avx2::cast_range, &cpu::avx2::sq_norm_block};
#endif
    default:
      return {&cpu::scalar::accumulate_range, &cpu::scalar::cast_range, &cpu::scalar::sq_norm_block};
  }
}

Status check_float(const char* op, const char* arg, DType t) {
  if (is_float_dtype(t)) return Status::ok();
  return Status::invalid(std::string(op) + ": " + arg + " dtype must be float32/bfloat16/float16, got " +
                         dtype_name(t));
}

Status check_n(const char* op, std::int64_t n) {
  if (n >= 0) return Status::ok();
  return Status::invalid(std::string(op) + ": n must be >= 0, got " + std::to_string(n));
}

}  // namespace

Status accumulate(float* dst, const void* src, DType src_dtype, std::int64_t n, ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(check_n("accumulate", n));
  RAMSTREAM_RETURN_IF_ERROR(check_float("accumulate", "src", src_dtype));
  if (n == 0) return Status::ok();
  if (dst == nullptr || src == nullptr) return Status::invalid("accumulate: null pointer");
  const auto fn = pick().accumulate;
  const int dt = static_cast<int>(src_dtype);
  pool.parallel_for(
      n, kGranule, kMinChunk, [&](std::int64_t b, std::int64_t e) { fn(dst, src, dt, b, e); },
      kTasksPerThread * pool.size());
  return Status::ok();
}

Status cast_to_float(float* dst, const void* src, DType src_dtype, std::int64_t n, float scale,
                     ThreadPool& pool) {
  RAMSTREAM_RETURN_IF_ERROR(check_n("cast_to_float", n));
  RAMSTREAM_RETURN_IF_ERROR(check_float("cast_to_float", "src", src_dtype));
  if (n == 0) return Status::ok();
  if (dst == nullptr || src == nullptr) return Status::invalid("cast_to_float: null pointer");
  const auto fn = pick().cast;
  const int dt = static_cast<int>(src_dtype);
  const bool has_scale = scale != 1.0f;
  pool.parallel_for(
      n, kGranule, kMinChunk,
      [&](std::int64_t b, std::int64_t e) { fn(dst, src, dt, scale, has_scale, b, e); },
      kTasksPerThread * pool.size());
  return Status::ok();
}

Status sq_norm(const void* x, DType dtype, std::int64_t n, ThreadPool& pool, double* out) {
  if (out == nullptr) return Status::invalid("sq_norm: out is a null pointer");
  *out = 0.0;
  RAMSTREAM_RETURN_IF_ERROR(check_n("sq_norm", n));
  RAMSTREAM_RETURN_IF_ERROR(check_float("sq_norm", "x", dtype));
  if (n == 0) return Status::ok();
  if (x == nullptr) return Status::invalid("sq_norm: x is a null pointer");
  const auto fn = pick().sq_norm;
  const int dt = static_cast<int>(dtype);
  const std::int64_t blocks = (n + kSqNormBlock - 1) / kSqNormBlock;
  if (blocks == 1) {
    *out = fn(x, dt, 0, n);
    return Status::ok();
  }
  std::vector<double> partial(static_cast<std::size_t>(blocks));
  pool.parallel_for(blocks, 1, 2, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t k = b; k < e; ++k) {
      const std::int64_t end = (k + 1) * kSqNormBlock < n ? (k + 1) * kSqNormBlock : n;
      partial[static_cast<std::size_t>(k)] = fn(x, dt, k * kSqNormBlock, end);
    }
  }, kTasksPerThread * pool.size());
  double s = 0.0;
  for (double p : partial) s += p;  // index order: the same sum for every thread count
  *out = s;
  return Status::ok();
}

}  // namespace ramstream
