// Bindings for host AdamW, gradient accumulation, squared norms and casts: DLPack tensors for the
// public functions, raw pointers (internal, the engine's hot path) for the *_ptr variants.
#include <cstdint>
#include <optional>
#include <string>

#include <nanobind/stl/optional.h>

#include "adamw_hyper.h"
#include "common.h"
#include "ramstream/adamw.h"
#include "ramstream/thread_pool.h"

namespace ramstream::py {
namespace {

DType float_dtype(const Array& a, const char* arg, bool allow_f16 = true) {
  const DType t = dtype_of(a, arg);
  const bool ok = t == DType::kFloat32 || t == DType::kBFloat16 || (allow_f16 && t == DType::kFloat16);
  if (!ok)
    raise_type_error(std::string(arg) + ": dtype must be " +
                     (allow_f16 ? "float32/bfloat16/float16" : "float32/bfloat16") + ", got " +
                     dtype_name(t));
  return t;
}

// The checks of accumulate_ and cast_to_float_: dst a contiguous host float32 tensor, src a
// contiguous host float32/bfloat16/float16 tensor with as many elements. Returns src's dtype.
DType check_dst_src(const Array& dst, const Array& src) {
  require_host_buffer(dst, "dst");
  require_dtype(dst, DType::kFloat32, "dst");
  require_host_buffer(src, "src");
  const DType t = float_dtype(src, "src");
  require_numel(src, "src", numel(dst), "dst");
  return t;
}

DType dtype_from_int(int code, const char* arg) {
  if (code < static_cast<int>(DType::kFloat32) || code > static_cast<int>(DType::kFloat16))
    raise_value_error(std::string(arg) + ": must be DTYPE_FLOAT32, DTYPE_BFLOAT16 or DTYPE_FLOAT16, got " +
                      std::to_string(code));
  return static_cast<DType>(code);
}

template <typename T>
T* ptr_of(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

void bind_adamw(nb::module_& m) {
  m.attr("DTYPE_FLOAT32") = static_cast<int>(DType::kFloat32);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(DType::kBFloat16);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(DType::kFloat16);

  m.def(
      "adamw_",
      [](Array param, Array grad, Array exp_avg, Array exp_avg_sq, std::optional<Array> out, double lr,
         double beta1, double beta2, double eps, double weight_decay, std::int64_t step,
         double grad_scale, std::uint64_t seed, std::int64_t offset) {
        require_host_buffer(param, "param");
        require_dtype(param, DType::kFloat32, "param");
        const std::int64_t n = numel(param);
        require_host_buffer(grad, "grad");
        const DType gt = float_dtype(grad, "grad");
        require_numel(grad, "grad", n, "param");
        require_host_buffer(exp_avg, "exp_avg");
        const DType mt = float_dtype(exp_avg, "exp_avg", /*allow_f16=*/false);
        require_numel(exp_avg, "exp_avg", n, "param");
        require_host_buffer(exp_avg_sq, "exp_avg_sq");
        if (float_dtype(exp_avg_sq, "exp_avg_sq", false) != mt)
          raise_type_error(std::string("exp_avg_sq: dtype must match exp_avg (") + dtype_name(mt) +
                           "), got " + dtype_name(dtype_of(exp_avg_sq, "exp_avg_sq")));
        require_numel(exp_avg_sq, "exp_avg_sq", n, "param");
        AdamWBuffers b;
        if (out) {
          require_host_buffer(*out, "out");
          b.out_dtype = float_dtype(*out, "out");
          require_numel(*out, "out", n, "param");
          b.out = out->data();
        }
        if (offset < 0) raise_value_error("offset: must be >= 0, got " + std::to_string(offset));
        b.param = static_cast<float*>(param.data());
        b.grad = grad.data();
        b.grad_dtype = gt;
        b.exp_avg = exp_avg.data();
        b.exp_avg_sq = exp_avg_sq.data();
        b.moment_dtype = mt;
        b.n = n;
        b.offset = offset;
        const AdamWHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed);
        check_without_gil([&] { return adamw_step(b, h, global_pool()); });
      },
      nb::arg("param").noconvert(), nb::arg("grad").noconvert(), nb::arg("exp_avg").noconvert(),
      nb::arg("exp_avg_sq").noconvert(), nb::arg("out").noconvert().none(), nb::kw_only(),
      nb::arg("lr"), nb::arg("beta1") = 0.9, nb::arg("beta2") = 0.999, nb::arg("eps") = 1e-8,
      nb::arg("weight_decay") = 1e-2, nb::arg("step"), nb::arg("grad_scale") = 1.0,
      nb::arg("seed") = 0, nb::arg("offset") = 0,
      "One AdamW step in place on contiguous host tensors of equal numel: param float32; grad\n"
      "float32/bfloat16/float16; exp_avg and exp_avg_sq both float32 or both bfloat16 (stochastic\n"
      "rounding with `seed`, stream index = element index + `offset`); out None or\n"
      "float32/bfloat16/float16 (receives the new param, round to nearest even). Releases the GIL.");

  m.def(
      "sq_norm",
      [](Array x) {
        require_host_buffer(x, "x");
        const DType t = float_dtype(x, "x");
        const std::int64_t n = numel(x);
        double r = 0;
        check_without_gil([&] { return sq_norm(x.data(), t, n, global_pool(), &r); });
        return r;
      },
      nb::arg("x").noconvert(),
      "Sum of squares of a contiguous host float32/bfloat16/float16 tensor, accumulated in double.\n"
      "Deterministic for every ISA and thread count. Releases the GIL.");

  m.def(
      "accumulate_",
      [](Array dst, Array src) {
        const DType t = check_dst_src(dst, src);
        const std::int64_t n = numel(dst);
        check_without_gil([&] {
          return accumulate(static_cast<float*>(dst.data()), src.data(), t, n, global_pool());
        });
      },
      nb::arg("dst").noconvert(), nb::arg("src").noconvert(),
      "dst += float(src) in place: dst a contiguous host float32 tensor, src float32/bfloat16/\n"
      "float16 with the same numel. Releases the GIL.");

  m.def(
      "cast_to_float_",
      [](Array dst, Array src, double scale) {
        const DType t = check_dst_src(dst, src);
        const std::int64_t n = numel(dst);
        check_without_gil([&] {
          return cast_to_float(static_cast<float*>(dst.data()), src.data(), t, n,
                               static_cast<float>(scale), global_pool());
        });
      },
      nb::arg("dst").noconvert(), nb::arg("src").noconvert(), nb::arg("scale") = 1.0,
      "dst = float(src) * float(scale) in place (scale == 1: a plain cast); dst contiguous host\n"
      "float32, src float32/bfloat16/float16 with the same numel. Releases the GIL.");

  // ---- internal: raw host pointers (integers), for the engine's hot path --------------------
  m.def(
      "adamw_ptr",
      [](std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t exp_avg,
         std::uintptr_t exp_avg_sq, int moment_dtype, std::uintptr_t out, int out_dtype,
         std::int64_t n, std::int64_t offset, double lr, double beta1, double beta2, double eps,
         double weight_decay, std::int64_t step, double grad_scale, std::uint64_t seed) {
        AdamWBuffers b;
        b.param = ptr_of<float>(param);
        b.grad = ptr_of<const void>(grad);
        b.grad_dtype = dtype_from_int(grad_dtype, "grad_dtype");
        b.exp_avg = ptr_of<void>(exp_avg);
        b.exp_avg_sq = ptr_of<void>(exp_avg_sq);
        b.moment_dtype = dtype_from_int(moment_dtype, "moment_dtype");
        b.out = out ? ptr_of<void>(out) : nullptr;
        b.out_dtype = out ? dtype_from_int(out_dtype, "out_dtype") : DType::kBFloat16;
        b.n = n;
        b.offset = offset;
        const AdamWHyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed);
        check_without_gil([&] { return adamw_step(b, h, global_pool()); });
      },
      nb::arg("param"), nb::arg("grad"), nb::arg("grad_dtype"), nb::arg("exp_avg"),
      nb::arg("exp_avg_sq"), nb::arg("moment_dtype"), nb::arg("out"), nb::arg("out_dtype"),
      nb::arg("n"), nb::arg("offset"), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
      nb::arg("eps"), nb::arg("weight_decay"), nb::arg("step"), nb::arg("grad_scale"),
      nb::arg("seed"),
      "Internal (engine hot path): adamw_ on raw host addresses. Pointers are integers (out = 0:\n"
      "none), dtypes are DTYPE_* codes, n elements; the caller guarantees the buffers are valid,\n"
      "host-resident and non-overlapping. Same numerics as adamw_. Releases the GIL.");

  m.def(
      "sq_norm_ptr",
      [](std::uintptr_t x, int dtype, std::int64_t n) {
        const DType t = dtype_from_int(dtype, "dtype");
        double r = 0;
        check_without_gil([&] { return sq_norm(ptr_of<const void>(x), t, n, global_pool(), &r); });
        return r;
      },
      nb::arg("ptr"), nb::arg("dtype"), nb::arg("n"),
      "Internal: sq_norm on a raw host address (dtype a DTYPE_* code, n elements). Releases the GIL.");

  m.def(
      "accumulate_ptr",
      [](std::uintptr_t dst, std::uintptr_t src, int src_dtype, std::int64_t n) {
        const DType t = dtype_from_int(src_dtype, "src_dtype");
        check_without_gil([&] {
          return accumulate(ptr_of<float>(dst), ptr_of<const void>(src), t, n, global_pool());
        });
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("src_dtype"), nb::arg("n"),
      "Internal: float32 dst[i] += float(src[i]) on raw host addresses. Releases the GIL.");

  m.def("sr_bits", &sr_bits, nb::arg("seed"), nb::arg("step"), nb::arg("index"), nb::arg("moment"),
        "Internal (tests, CUDA reference): the 16 stochastic-rounding bits of docs/NUMERICS.md rule 2.");
}

}  // namespace ramstream::py
