// V16: sixteen float32 lanes, the one vector type Draftsmith's CPU kernels are written in.
//
// On a CPU with AVX-512 a V16 is one zmm register; on one with AVX2 + FMA (no AVX-512: AMD Zen 2 / 3,
// most Intel client chips) it is a pair of ymm registers and every op is the same lane-wise op on
// both halves. Lane-wise arithmetic (add, mul, fma, div, max, rounding) gives the same bits on either
// ISA; reductions over the lanes of one vector (reduce_add, hsum16) each use one fixed order, so a
// result never depends on how many rows or queries a kernel call holds.
//
// Only the few ops the kernels use are here. The linears' inner loops (gemv.cpp) are tiled per ISA:
// 32 zmm registers hold 8 rows x 32 columns of sums, 16 ymm registers far fewer.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace v16 {

#if defined(__AVX512F__)

struct V16 {
  __m512 v;
};
using Mask = __mmask16;

inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // b where a is NaN
inline V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline V16 round_nearest(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n (one rounding)
inline V16 scale2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }
inline float reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline int equal_lanes(V16 a, float m) {  // bit i set where lane i == m
  return static_cast<int>(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(m), _CMP_EQ_OQ));
}
inline Mask first(int64_t n) { return static_cast<Mask>(n >= 16 ? 0xFFFF : (1u << n) - 1); }  // lanes [0, n)
inline V16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }  // others 0
inline void store_first(float* p, V16 a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline V16 zero_where_less(V16 a, V16 x, V16 lim) {  // a, with 0 in the lanes where x < lim
  return {_mm512_maskz_mov_ps(static_cast<Mask>(~_mm512_cmp_ps_mask(x.v, lim.v, _CMP_LT_OQ)), a.v)};
}

// bfloat16 <-> float32 of 16 values; the rounding is torch's (to nearest even; NaN -> 0x7FC0).
inline V16 load(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16))};
}
inline __m256i to_bf16(V16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline V16 round_bf16(V16 a) {  // a rounded to bfloat16 and back
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(a)), 16))};
}

// The 16 lane sums of a[0..15] as one vector (lane i = the sum of a[i]'s lanes): a fixed tree of
// unpacks, shuffles and adds, the same for every i.
inline V16 hsum16(const V16* a) {
  __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v), _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD))};
}

#elif defined(__AVX2__) && defined(__FMA__)

struct V16 {
  __m256 a, b;  // lanes 0-7, 8-15
};

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline V16 add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V16 sub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline V16 mul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V16 div(V16 x, V16 y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline V16 max(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline V16 min(V16 x, V16 y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
inline V16 fmadd(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V16 fnmadd(V16 x, V16 y, V16 z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
inline V16 round_nearest(V16 x) {
  constexpr int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, r), _mm256_round_ps(x.b, r)};
}
inline __m256 pow2(__m256 n) {  // 2^n for integral n in [-127, 127] from its exponent bits (-127 gives 0)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// x * 2^n as two exact-power steps, n = n1 + n2 with |n1|, |n2| <= 127: for the kernels' x (the exp
// polynomial, 0.7 < x < 1.5) and n >= -150 the first product is exact and the second rounds once, as
// scalef does (results in the subnormal range included)
inline __m256 scale2_8(__m256 x, __m256 n) {
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-252.0f)), _mm256_set1_ps(254.0f));
  const __m256 n1 = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
  return _mm256_mul_ps(_mm256_mul_ps(x, pow2(n1)), pow2(_mm256_sub_ps(n, n1)));
}
inline V16 scale2(V16 x, V16 n) { return {scale2_8(x.a, n.a), scale2_8(x.b, n.b)}; }
inline float reduce_add(V16 x) {  // halves, then quarters, ...: one fixed order
  __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
inline float reduce_max(V16 x) {
  __m256 s = _mm256_max_ps(x.a, x.b);
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
inline int equal_lanes(V16 x, float m) {  // bit i set where lane i == m
  const __m256 v = _mm256_set1_ps(m);
  return _mm256_movemask_ps(_mm256_cmp_ps(x.a, v, _CMP_EQ_OQ)) | (_mm256_movemask_ps(_mm256_cmp_ps(x.b, v, _CMP_EQ_OQ)) << 8);
}
inline __m256i first8(int64_t n) {  // lanes [0, n) of 8 set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V16 load_first(const float* p, int64_t n) {  // lanes [0, n) from p, the others 0
  return {_mm256_maskload_ps(p, first8(n)), _mm256_maskload_ps(p + 8, first8(n - 8))};
}
inline void store_first(float* p, V16 x, int64_t n) {
  _mm256_maskstore_ps(p, first8(n), x.a);
  _mm256_maskstore_ps(p + 8, first8(n - 8), x.b);
}
inline V16 zero_where_less(V16 x, V16 v, V16 lim) {
  return {_mm256_andnot_ps(_mm256_cmp_ps(v.a, lim.a, _CMP_LT_OQ), x.a),
          _mm256_andnot_ps(_mm256_cmp_ps(v.b, lim.b, _CMP_LT_OQ), x.b)};
}

inline __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V16 load(const uint16_t* p) {
  return {bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256i bf16_bits(__m256 x) {  // 8 lanes: the bfloat16 in the low 16 bits of each 32
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline __m256i to_bf16(V16 x) {  // 16 bfloat16 in lane order
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(x.a), bf16_bits(x.b)), 0xD8);
}
inline V16 round_bf16(V16 x) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x.a), 16)), _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x.b), 16))};
}

// The 8 lane sums of a[0..7] (8-lane vectors) as one vector: a fixed tree of horizontal adds.
inline __m256 hsum8(const __m256* a) {
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  // c0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low / high 128-bit halves of a[0..3]); likewise c1
  const __m256 lo = _mm256_permute2f128_ps(c0, c1, 0x20), hi = _mm256_permute2f128_ps(c0, c1, 0x31);
  return _mm256_add_ps(lo, hi);
}
inline V16 hsum16(const V16* a) {
  __m256 s[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(a[i].a, a[i].b);
  return {hsum8(s), hsum8(s + 8)};
}

#else
#error "Draftsmith's CPU kernels need AVX-512 or AVX2 + FMA (build.py checks before compiling)"
#endif

}  // namespace v16
