// The AVX-512 vector loop of the AdamW kernel, 32 elements (two vectors) per iteration. Included
// twice by adamw_kernels.cpp, with no include guard on purpose: once with RAMSTREAM_LOOP_BF16CVT 0,
// once inside namespace bf16cvt with RAMSTREAM_LOOP_BF16CVT 1 and RAMSTREAM_LOOP_TARGET =
// target("avx512bf16"), where the bf16 `out` is converted by vcvtne2ps2bf16 (used only on CPUs
// that have it). Both give the same bits: rule 1 of docs/NUMERICS.md.
// (No lambdas here: a lambda would not inherit the target attribute and step32 would not inline.)

// 32 elements at i; k16 = 16 * kSrIdxLo in every lane (the keys of elements i+16..i+31 are
// km + k16, kv + k16). kStream: `out` + i is 64-byte aligned and gets non-temporal stores.
// A NaN in a new moment makes the new weight NaN too, so when neither weight vector has one, the
// bf16 conversions skip their NaN case; the rare pairs with one take step16's full conversions.
// vcvtne2ps2bf16 differs from rule 1 only on NaN and on subnormal inputs (it flushes them to
// zero): those pairs take the full conversion as well.
template <int G, int M, int O, bool kStream>
RAMSTREAM_LOOP_TARGET inline void step32(const Pass16& c, std::int64_t i, __m512i km, __m512i kv, __m512i k16) {
  __m512 g0, g1, m0, m1, v0, v1;
  load32<G>(c.grad, i, g0, g1);
  __m512 p0 = _mm512_loadu_ps(c.param + i);
  __m512 p1 = _mm512_loadu_ps(c.param + i + 16);
  load32<M>(c.exp_avg, i, m0, m1);
  load32<M>(c.exp_avg_sq, i, v0, v1);
  update16(c, g0, p0, m0, v0);
  update16(c, g1, p1, m1, v1);
  _mm512_storeu_ps(c.param + i, p0);
  _mm512_storeu_ps(c.param + i + 16, p1);
  if constexpr (M == 0) {
    float* const em = static_cast<float*>(c.exp_avg) + i;
    float* const ev = static_cast<float*>(c.exp_avg_sq) + i;
    _mm512_storeu_ps(em, m0);
    _mm512_storeu_ps(em + 16, m1);
    _mm512_storeu_ps(ev, v0);
    _mm512_storeu_ps(ev + 16, v1);
  }
  if constexpr (M == 1 || O == 1) {
    std::uint16_t* const em = static_cast<std::uint16_t*>(c.exp_avg) + i;  // used when M == 1
    std::uint16_t* const ev = static_cast<std::uint16_t*>(c.exp_avg_sq) + i;
    std::uint16_t* const eo = O == 1 ? static_cast<std::uint16_t*>(c.out) + i : nullptr;
    constexpr int kSlowClasses = (RAMSTREAM_LOOP_BF16CVT && O == 1) ? 0xA1 : 0x81;  // NaN (| subnormal)
    if (__builtin_expect(_kortestz_mask16_u8(_mm512_fpclass_ps_mask(p0, kSlowClasses),
                                             _mm512_fpclass_ps_mask(p1, kSlowClasses)), 1)) {
      if constexpr (M == 1) {
        const __m512i rm0 = sr_finish16(km), rm1 = sr_finish16(_mm512_add_epi32(km, k16));
        const __m512i rv0 = sr_finish16(kv), rv1 = sr_finish16(_mm512_add_epi32(kv, k16));
        _mm512_storeu_si512(em, high_halves32(_mm512_add_epi32(_mm512_castps_si512(m0), rm0),
                                              _mm512_add_epi32(_mm512_castps_si512(m1), rm1)));
        _mm512_storeu_si512(ev, high_halves32(_mm512_add_epi32(_mm512_castps_si512(v0), rv0),
                                              _mm512_add_epi32(_mm512_castps_si512(v1), rv1)));
      }
      if constexpr (O == 1) {
#if RAMSTREAM_LOOP_BF16CVT
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 -> low half
#else
        const __m512i h = high_halves32(bf16_rne_sum16(p0), bf16_rne_sum16(p1));
#endif
        if constexpr (kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(eo), h);
        else _mm512_storeu_si512(eo, h);
      }
    } else {
      if constexpr (M == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(em), f32x16_to_bf16_sr(m0, sr_finish16(km)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(em + 16),
                            f32x16_to_bf16_sr(m1, sr_finish16(_mm512_add_epi32(km, k16))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ev), f32x16_to_bf16_sr(v0, sr_finish16(kv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ev + 16),
                            f32x16_to_bf16_sr(v1, sr_finish16(_mm512_add_epi32(kv, k16))));
      }
      if constexpr (O == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(eo), f32x16_to_bf16_rne(p0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(eo + 16), f32x16_to_bf16_rne(p1));
      }
    }
  }
  if constexpr (O == 0) {
    float* const eo = static_cast<float*>(c.out) + i;
    if constexpr (kStream) {
      _mm512_stream_ps(eo, p0);
      _mm512_stream_ps(eo + 16, p1);
    } else {
      _mm512_storeu_ps(eo, p0);
      _mm512_storeu_ps(eo + 16, p1);
    }
  } else if constexpr (O == 2) {
    const __m512i h = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm512_cvtps_ph(p0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
        _mm512_cvtps_ph(p1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 1);
    __m512i* const eo = reinterpret_cast<__m512i*>(static_cast<std::uint16_t*>(c.out) + i);
    if constexpr (kStream) _mm512_stream_si512(eo, h);
    else _mm512_storeu_si512(eo, h);
  }
}

// The vector range [vbeg, vend) (whole vectors of 16, below tail_begin). With bf16 moments it is
// cut into runs in which the random-stream index keeps its high 32-bit word (as
// for_each_uniform_run does); in each run: pairs of vectors, then at most one single vector.
template <int G, int M, int O, bool kStream>
RAMSTREAM_LOOP_TARGET void adamw_vectors(const AdamWKernelArgs& a, std::int64_t vbeg, std::int64_t vend) {
  const Pass16 c = make_pass16(a);
  const std::int64_t offset = a.offset;
  const std::uint32_t key0 = a.sr_key[0], key1 = a.sr_key[1];
  const __m512i iota_a = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(kSrIdxLo)));
  const __m512i k16 = _mm512_set1_epi32(static_cast<int>(16u * kSrIdxLo));
  const __m512i k32 = _mm512_set1_epi32(static_cast<int>(32u * kSrIdxLo));
  std::int64_t i = vbeg;
  while (i < vend) {
    std::int64_t i1 = vend;
    std::uint32_t hi_term = 0;
    if constexpr (M == 1) {
      const std::uint64_t idx = static_cast<std::uint64_t>(i + offset);
      const std::uint64_t room = (std::uint64_t{1} << 32) - (idx & 0xFFFFFFFFu);  // until hi changes
      const std::uint64_t vectors_left = static_cast<std::uint64_t>(vend - i) / 16;
      const std::int64_t nvec = static_cast<std::int64_t>(room / 16 < vectors_left ? room / 16 : vectors_left);
      if (nvec == 0) {  // straddles a 2^32 boundary: once per 4G elements
        for (int j = 0; j < 16; ++j) adamw_elem<G, M, O>(a, i + j);
        i += 16;
        continue;
      }
      i1 = i + nvec * 16;
      hi_term = static_cast<std::uint32_t>(idx >> 32) * kSrIdxHi;
    }
    // rule 2's key of lane j of the vector at i: idx_lo*A + hi*B + key, idx = i + j + offset
    const std::uint32_t t0 = static_cast<std::uint32_t>(i + offset) * kSrIdxLo + hi_term;
    __m512i km = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(t0 + key0)), iota_a);
    __m512i kv = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(t0 + key1)), iota_a);
    if constexpr (kStream) {
      // only after a vector that straddled a 2^32 boundary: back to whole cache lines of `out`
      if ((reinterpret_cast<std::uintptr_t>(static_cast<char*>(c.out) + i * (O == 0 ? 4 : 2)) & 63) != 0) {
        step16<G, M, O>(c, i, km, kv);
        i += 16;
        km = _mm512_add_epi32(km, k16);
        kv = _mm512_add_epi32(kv, k16);
      }
    }
    for (; i + 32 <= i1; i += 32) {
      step32<G, M, O, kStream>(c, i, km, kv, k16);
      km = _mm512_add_epi32(km, k32);
      kv = _mm512_add_epi32(kv, k32);
    }
    if (i < i1) {
      step16<G, M, O>(c, i, km, kv);
      i += 16;
    }
  }
}
