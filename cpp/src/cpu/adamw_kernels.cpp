// Host AdamW kernel, compiled once per ISA: one pass over param/grad/moments(/out), fp32 math
// exactly as documented in ramstream/adamw.h, bf16 moments with stochastic rounding.
#include "cpu/adamw_kernels.h"

#include "cpu/adamw_simd.h"

namespace ramstream::cpu::RAMSTREAM_ISA_NS {
namespace {

// The reference element update; vector bodies below compute exactly this, lane by lane.
template <int G, int M, int O>
inline void adamw_elem(const AdamWKernelArgs& a, std::int64_t i) {
  float g = load1<G>(a.grad, i);
  if (a.has_scale) g = g * a.grad_scale;
  float p = a.param[i];
  if (a.has_decay) p = p * a.decay;
  float m = load1<M>(a.exp_avg, i);
  float v = load1<M>(a.exp_avg_sq, i);
  m = std::fma(a.lerp_coeff, g - m, a.lerp_small ? m : g);
  if (i < a.tail_begin) v = std::fma(a.c2 * g, g, v * a.beta2);
  else v = std::fma(v, a.beta2, (a.c2 * g) * g);
  const float d = std::sqrt(v) / a.bc2_sqrt + a.eps;
  p = p + (a.neg_step_size * m) / d;
  a.param[i] = p;
  if constexpr (M == 0) {
    static_cast<float*>(a.exp_avg)[i] = m;
    static_cast<float*>(a.exp_avg_sq)[i] = v;
  } else {
    const std::uint32_t t = sr_index_term(static_cast<std::uint64_t>(i + a.offset));
    static_cast<std::uint16_t*>(a.exp_avg)[i] = f32_to_bf16_sr(m, sr_finish(t + a.sr_key[0]));
    static_cast<std::uint16_t*>(a.exp_avg_sq)[i] = f32_to_bf16_sr(v, sr_finish(t + a.sr_key[1]));
  }
  if constexpr (O >= 0) store1_rne<O>(a.out, i, p);
}

// The vector part of [begin, end) starts at vbeg (>= begin; elements before it go through
// adamw_elem) and covers whole vectors of W elements below tail_begin: returns its end.
inline std::int64_t vector_end(const AdamWKernelArgs& a, std::int64_t vbeg, std::int64_t end, int w) {
  const std::int64_t lim = end < a.tail_begin ? end : a.tail_begin;
  return lim <= vbeg ? vbeg : vbeg + ((lim - vbeg) / w) * w;
}

// Non-temporal stores of `out` (a.out_streaming): the first element at or after `begin` whose
// address in `out` is 64-byte aligned, so that vector stores from there on fill whole cache lines.
// Returns -1 when `out` is not even element-aligned (then it is written with ordinary stores).
template <int O>
inline std::int64_t stream_start(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  constexpr std::uintptr_t size = O == 0 ? 4 : 2;
  const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(a.out) + static_cast<std::uintptr_t>(begin) * size;
  if (addr % size != 0) return -1;
  const std::int64_t skip = static_cast<std::int64_t>(((64 - addr % 64) % 64) / size);
  return begin + skip < end ? begin + skip : end;
}

// The vector loops copy every field they use into locals first: stores through the float
// pointers could alias `a` as far as the compiler knows, which would force reloads each iteration.
// Splits the vector range [begin, vend) (whole vectors of W) into runs in which the random-stream
// index keeps its high 32-bit word, calling run(i0, i1, hi_term) on each; a vector that straddles a
// 2^32 boundary (once per 4G elements) goes through the scalar element update instead.
template <int W, int G, int M, int O, typename Run>
inline void for_each_uniform_run(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t vend, Run run) {
  std::int64_t i = begin;
  while (i < vend) {
    const std::uint64_t idx = static_cast<std::uint64_t>(i + a.offset);
    const std::uint64_t room = (std::uint64_t{1} << 32) - (idx & 0xFFFFFFFFu);  // until hi changes
    const std::uint64_t vectors_left = static_cast<std::uint64_t>(vend - i) / W;
    const std::int64_t nvec = static_cast<std::int64_t>(room / W < vectors_left ? room / W : vectors_left);
    if (nvec == 0) {
      for (int j = 0; j < W; ++j) adamw_elem<G, M, O>(a, i + j);
      i += W;
      continue;
    }
    run(i, i + nvec * W, static_cast<std::uint32_t>(idx >> 32) * kSrIdxHi);
    i += nvec * W;
  }
}

#if RAMSTREAM_ISA_LEVEL >= 2
// The buffers and coefficients of one call, in registers (see for_each_uniform_run).
struct Pass16 {
  float* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* out;
  __m512 decay, lerp_c, beta2, c2, bc2s, eps, nss, gscale;
  __mmask16 base_is_m;  // all ones: the base of the lerp is m, else g
  bool has_scale, has_decay;
};

inline Pass16 make_pass16(const AdamWKernelArgs& a) {
  Pass16 c;
  c.param = a.param;
  c.grad = a.grad;
  c.exp_avg = a.exp_avg;
  c.exp_avg_sq = a.exp_avg_sq;
  c.out = a.out;
  c.decay = _mm512_set1_ps(a.decay);
  c.lerp_c = _mm512_set1_ps(a.lerp_coeff);
  c.beta2 = _mm512_set1_ps(a.beta2);
  c.c2 = _mm512_set1_ps(a.c2);
  c.bc2s = _mm512_set1_ps(a.bc2_sqrt);
  c.eps = _mm512_set1_ps(a.eps);
  c.nss = _mm512_set1_ps(a.neg_step_size);
  c.gscale = _mm512_set1_ps(a.grad_scale);
  c.base_is_m = a.lerp_small ? 0xFFFF : 0;
  c.has_scale = a.has_scale;
  c.has_decay = a.has_decay;
  return c;
}

// adamw_elem's arithmetic on 16 lanes.
inline void update16(const Pass16& c, __m512 g, __m512& p, __m512& m, __m512& v) {
  if (c.has_scale) g = _mm512_mul_ps(g, c.gscale);
  if (c.has_decay) p = _mm512_mul_ps(p, c.decay);
  m = _mm512_fmadd_ps(c.lerp_c, _mm512_sub_ps(g, m), _mm512_mask_blend_ps(c.base_is_m, g, m));
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.c2, g), g, _mm512_mul_ps(v, c.beta2));
  const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bc2s), c.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.nss, m), d));
}

// 16 elements at i with ordinary stores; km/kv: the SR hash keys of its lanes (rule 2 before the
// mixing steps) for exp_avg / exp_avg_sq.
template <int G, int M, int O>
inline void step16(const Pass16& c, std::int64_t i, __m512i km, __m512i kv) {
  const __m512 g = load16<G>(c.grad, i);
  __m512 p = _mm512_loadu_ps(c.param + i);
  __m512 m = load16<M>(c.exp_avg, i);
  __m512 v = load16<M>(c.exp_avg_sq, i);
  update16(c, g, p, m, v);
  _mm512_storeu_ps(c.param + i, p);
  if constexpr (M == 0) {
    _mm512_storeu_ps(static_cast<float*>(c.exp_avg) + i, m);
    _mm512_storeu_ps(static_cast<float*>(c.exp_avg_sq) + i, v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(c.exp_avg) + i),
                        f32x16_to_bf16_sr(m, sr_finish16(km)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(c.exp_avg_sq) + i),
                        f32x16_to_bf16_sr(v, sr_finish16(kv)));
  }
  if constexpr (O >= 0) store16_rne<O>(c.out, i, p, false);
}

// The pair loop, twice: with the rule-1 conversion in integer instructions (namespace intcvt),
// and with AVX512-BF16's vcvtne2ps2bf16 for bf16 `out` on CPUs that have it (namespace bf16cvt).
namespace intcvt {
#define RAMSTREAM_LOOP_TARGET
#define RAMSTREAM_LOOP_BF16CVT 0
#include "cpu/adamw_avx512_loop.h"
#undef RAMSTREAM_LOOP_TARGET
#undef RAMSTREAM_LOOP_BF16CVT
}  // namespace intcvt
namespace bf16cvt {
#define RAMSTREAM_LOOP_TARGET __attribute__((target("avx512bf16")))
#define RAMSTREAM_LOOP_BF16CVT 1
#include "cpu/adamw_avx512_loop.h"
#undef RAMSTREAM_LOOP_TARGET
#undef RAMSTREAM_LOOP_BF16CVT
}  // namespace bf16cvt

template <int G, int M, int O, bool kStream>
inline void adamw_vectors_any(const AdamWKernelArgs& a, std::int64_t vbeg, std::int64_t vend) {
  if constexpr (O == 1) {
    if (a.bf16_cvt) return bf16cvt::adamw_vectors<G, M, O, kStream>(a, vbeg, vend);
  }
  intcvt::adamw_vectors<G, M, O, kStream>(a, vbeg, vend);
}

template <int G, int M, int O>
void adamw_run(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  std::int64_t vbeg = begin;
  bool stream = false;
  if constexpr (O >= 0) {
    if (a.out_streaming) {
      const std::int64_t s = stream_start<O>(a, begin, end < a.tail_begin ? end : a.tail_begin);
      if (s >= 0) {
        stream = true;
        vbeg = s;
      }
    }
  }
  for (std::int64_t i = begin; i < vbeg; ++i) adamw_elem<G, M, O>(a, i);
  const std::int64_t vend = vector_end(a, vbeg, end, 16);
  if (vend > vbeg) {
    if (stream) {
      if constexpr (O >= 0) adamw_vectors_any<G, M, O, true>(a, vbeg, vend);
      _mm_sfence();  // non-temporal stores are weakly ordered: publish them before returning
    } else {
      adamw_vectors_any<G, M, O, false>(a, vbeg, vend);
    }
  }
  for (std::int64_t i = vend; i < end; ++i) adamw_elem<G, M, O>(a, i);
}
#elif RAMSTREAM_ISA_LEVEL == 1
template <int G, int M, int O>
void adamw_run(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  std::int64_t vbeg = begin;
  bool stream = false;
  if constexpr (O >= 0) {
    if (a.out_streaming) {
      const std::int64_t s = stream_start<O>(a, begin, end < a.tail_begin ? end : a.tail_begin);
      if (s >= 0) {
        stream = true;
        vbeg = s;
      }
    }
  }
  for (std::int64_t i = begin; i < vbeg; ++i) adamw_elem<G, M, O>(a, i);
  const std::int64_t vend = vector_end(a, vbeg, end, 8);
  float* const param = a.param;
  const void* const grad = a.grad;
  void* const exp_avg = a.exp_avg;
  void* const exp_avg_sq = a.exp_avg_sq;
  void* const out = a.out;
  const std::int64_t offset = a.offset;
  const bool has_scale = a.has_scale, has_decay = a.has_decay;
  const __m256 decay = _mm256_set1_ps(a.decay), lerp_c = _mm256_set1_ps(a.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(a.beta2), c2 = _mm256_set1_ps(a.c2);
  const __m256 bc2s = _mm256_set1_ps(a.bc2_sqrt), eps = _mm256_set1_ps(a.eps);
  const __m256 nss = _mm256_set1_ps(a.neg_step_size), gscale = _mm256_set1_ps(a.grad_scale);
  const __m256 base_is_m = _mm256_castsi256_ps(_mm256_set1_epi32(a.lerp_small ? -1 : 0));
  const __m256i iota_a = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(static_cast<int>(kSrIdxLo)));
  const std::uint32_t key0 = a.sr_key[0], key1 = a.sr_key[1];

  const __m256i k8 = _mm256_set1_epi32(static_cast<int>(8u * kSrIdxLo));

  auto run = [&](std::int64_t i0, std::int64_t i1, std::uint32_t hi_term) {
    // rule 2's key of lane j of the vector at i: idx_lo*A + hi*B + key, idx = i + j + offset
    const std::uint32_t t0 = static_cast<std::uint32_t>(i0 + offset) * kSrIdxLo + hi_term;
    __m256i km = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0 + key0)), iota_a);
    __m256i kv = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t0 + key1)), iota_a);
    for (std::int64_t i = i0; i < i1; i += 8, km = _mm256_add_epi32(km, k8), kv = _mm256_add_epi32(kv, k8)) {
      __m256 g = load8<G>(grad, i);
      if (has_scale) g = _mm256_mul_ps(g, gscale);
      __m256 p = _mm256_loadu_ps(param + i);
      if (has_decay) p = _mm256_mul_ps(p, decay);
      __m256 m = load8<M>(exp_avg, i);
      __m256 v = load8<M>(exp_avg_sq, i);
      m = _mm256_fmadd_ps(lerp_c, _mm256_sub_ps(g, m), _mm256_blendv_ps(g, m, base_is_m));
      v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, beta2));
      const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2s), eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
      _mm256_storeu_ps(param + i, p);
      if constexpr (M == 0) {
        _mm256_storeu_ps(static_cast<float*>(exp_avg) + i, m);
        _mm256_storeu_ps(static_cast<float*>(exp_avg_sq) + i, v);
      }
      // As in the AVX-512 loop: without a NaN in the new weight there is none in the new moments,
      // and the bf16 conversions can skip their NaN case.
      bool no_nan = true;
      if constexpr (M == 1 || O == 1) no_nan = _mm256_movemask_ps(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)) == 0;
      if constexpr (M == 1) {
        __m128i mb, vb;
        if (__builtin_expect(no_nan, 1)) {
          mb = high_halves8(_mm256_add_epi32(_mm256_castps_si256(m), sr_finish8(km)));
          vb = high_halves8(_mm256_add_epi32(_mm256_castps_si256(v), sr_finish8(kv)));
        } else {
          mb = f32x8_to_bf16_sr(m, sr_finish8(km));
          vb = f32x8_to_bf16_sr(v, sr_finish8(kv));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(exp_avg) + i), mb);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(exp_avg_sq) + i), vb);
      }
      if constexpr (O == 1) {
        __m128i* const q = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(out) + i);
        if (__builtin_expect(no_nan, 1)) {
          const __m256i u = _mm256_castps_si256(p);
          const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
          const __m128i h = high_halves8(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb));
          if (stream) _mm_stream_si128(q, h);
          else _mm_storeu_si128(q, h);
        } else {
          _mm_storeu_si128(q, f32x8_to_bf16_rne(p));
        }
      } else if constexpr (O >= 0) {
        store8_rne<O>(out, i, p, stream);
      }
    }
  };
  if constexpr (M == 0) run(vbeg, vend, 0);
  else for_each_uniform_run<8, G, M, O>(a, vbeg, vend, run);
  if (O >= 0 && stream) _mm_sfence();  // non-temporal stores are weakly ordered
  for (std::int64_t i = vend; i < end; ++i) adamw_elem<G, M, O>(a, i);
}
#else
template <int G, int M, int O>
void adamw_run(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) adamw_elem<G, M, O>(a, i);
}
#endif

template <int G, int M>
void adamw_by_out(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  if (a.out == nullptr) return adamw_run<G, M, -1>(a, begin, end);
  switch (a.out_dtype) {
    case kKF32: return adamw_run<G, M, 0>(a, begin, end);
    case kKBF16: return adamw_run<G, M, 1>(a, begin, end);
    default: return adamw_run<G, M, 2>(a, begin, end);
  }
}

template <int G>
void adamw_by_moment(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  if (a.moment_dtype == kKBF16) return adamw_by_out<G, 1>(a, begin, end);
  return adamw_by_out<G, 0>(a, begin, end);
}

}  // namespace

void adamw_range(const AdamWKernelArgs& a, std::int64_t begin, std::int64_t end) {
  switch (a.grad_dtype) {
    case kKF32: return adamw_by_moment<0>(a, begin, end);
    case kKBF16: return adamw_by_moment<1>(a, begin, end);
    default: return adamw_by_moment<2>(a, begin, end);
  }
}

}  // namespace ramstream::cpu::RAMSTREAM_ISA_NS
