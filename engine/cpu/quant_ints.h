// The int8 path's view of a weight block on its ymm tiles (gemm_quant_int8.cpp; AVX2, and SSE2 in two xmm
// registers; quant_pairs.h has AVX-512's): a block's 32 quants as bytes, unpacked once per block and weight row,
// their integer dot product with a block of quantized x (8 int32 lanes, each the sum of 4 products: exact), and the
// fp16 scale those lanes take.
//
// Unsigned quants go in as they are (Q4_1's and Q4_K's nibbles; a min term carries the offset); signed ones as
// |q| with their signs moved onto x (Q8_0's q, Q5_0's q - 16, Q6_K's q - 32: the sign trick, no weight-side data,
// so the resident weights stay the file's bytes); SSE2 multiplies signed by signed. K-quants' sub-block scales
// multiply the integer sums (Q4_K one a block of 32, Q6_K one per 16 weights: lanes 0-3 and 4-7), exact, so the
// fp32 factor a block's lanes take is the super-block's fp16 d, as for the other types.
#pragma once

#include "quant_blocks.h"

namespace tandem_quant {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));

// A block's 32 bytes (weights or quantized x), its integer dot product with another (8 int32 lanes, each the sum
// of 4 products) and the same with the products' pairs times 16-bit scales (`Scales`: one for bytes 0-15, one for
// 16-31). All exact: no lane or pair sum comes near int16's or int32's range here.
#if defined(__AVX2__)  // the avx2 and avx512 builds: one ymm register
typedef __m256i Bytes32;
typedef __m256i Scales;  // 16-bit
inline Bytes32 load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline Bytes32 join(__m128i lo, __m128i hi) { return _mm256_set_m128i(hi, lo); }
inline Scales scales(int lo, int hi) { return _mm256_set_m128i(_mm_set1_epi16(short(hi)), _mm_set1_epi16(short(lo))); }
// Unsigned bytes u by signed bytes s. Without VNNI, VPMADDUBSW's pair sums saturate at int16's 32767, which
// they never reach here: u <= 128 and |s| <= 127 (2 * 128 * 127 = 32512).
inline v8i idot(Bytes32 u, Bytes32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return (v8i)_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return (v8i)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline v8i idot(Bytes32 u, Bytes32 s, Scales sc) {  // the pair sums (u <= 32) times the scales
  return (v8i)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc);
}
inline Bytes32 srl_and(Bytes32 v, int shift, int mask) {  // every byte >> shift & mask
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(char(mask)));
}
inline Bytes32 bit4_bytes32(uint32_t bits) {  // 0x10 in byte i where bit i is set
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(__mmask32(bits), _mm256_set1_epi8(0x10));
#else  // llama.cpp's bytes_from_bits_32: byte i takes bits' byte i / 8, all of it but bit i % 8 set, compared
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i all = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE));
  return _mm256_and_si256(_mm256_cmpeq_epi8(all, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}
#else  // SSE2: two xmm registers, bytes widened to 16 bits and multiplied in pairs (PMADDWD), signed by signed
struct Bytes32 {
  __m128i lo, hi;
};
struct Scales {
  __m128i lo, hi;  // 32-bit lanes, the scale in their low halves
};
inline Bytes32 load32(const void* p) {
  return {load16(p), load16(static_cast<const uint8_t*>(p) + 16)};
}
inline Bytes32 join(__m128i lo, __m128i hi) { return {lo, hi}; }
inline Scales scales(int lo, int hi) { return {_mm_set1_epi32(lo & 0xFFFF), _mm_set1_epi32(hi & 0xFFFF)}; }
inline __m128i dot16(__m128i a, __m128i b) {
  const __m128i a0 = _mm_srai_epi16(_mm_unpacklo_epi8(a, a), 8), a1 = _mm_srai_epi16(_mm_unpackhi_epi8(a, a), 8);
  const __m128i b0 = _mm_srai_epi16(_mm_unpacklo_epi8(b, b), 8), b1 = _mm_srai_epi16(_mm_unpackhi_epi8(b, b), 8);
  return _mm_add_epi32(_mm_madd_epi16(a0, b0), _mm_madd_epi16(a1, b1));
}
// The weights' bytes are signed as they are (Q8_0's q, Q6_K's q - 32) or below 128 (nibbles, Q5_0's q).
inline v8i idot(Bytes32 w, Bytes32 x) {
  return __builtin_shufflevector((v4i)dot16(w.lo, x.lo), (v4i)dot16(w.hi, x.hi), 0, 1, 2, 3, 4, 5, 6, 7);
}
// The lanes (|lane| <= 4 * 32 * 127: an int16) times the scales, PMADDWD on their low halves.
inline v8i idot(Bytes32 w, Bytes32 x, Scales sc) {
  return __builtin_shufflevector((v4i)_mm_madd_epi16(dot16(w.lo, x.lo), sc.lo),
                                 (v4i)_mm_madd_epi16(dot16(w.hi, x.hi), sc.hi), 0, 1, 2, 3, 4, 5, 6, 7);
}
inline Bytes32 srl_and(Bytes32 v, int shift, int mask) {
  const __m128i s = _mm_cvtsi32_si128(shift), m = _mm_set1_epi8(char(mask));
  return {_mm_and_si128(_mm_srl_epi16(v.lo, s), m), _mm_and_si128(_mm_srl_epi16(v.hi, s), m)};
}
inline Bytes32 bit4_bytes32(uint32_t bits) { return {bit4_bytes16(bits), bit4_bytes16(bits >> 16)}; }
#endif

// Q6_K's 32 q - 32 of sub-block s of the super-block at `sb`, as signed bytes.
inline Bytes32 q6k_bytes32(const uint8_t* sb, int s) {
  const int h = s / 4;
  const Bytes32 lo = srl_and(load32(sb + 64 * h + 32 * (s & 1)), 4 * ((s >> 1) & 1), 0x0F);
  const Bytes32 hi = srl_and(load32(sb + 128 + 32 * h), 2 * (s & 3), 3);
#if defined(__AVX2__)
  return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
#else
  const __m128i k32 = _mm_set1_epi8(32);
  return {_mm_sub_epi8(_mm_or_si128(lo.lo, _mm_slli_epi16(hi.lo, 4)), k32),
          _mm_sub_epi8(_mm_or_si128(lo.hi, _mm_slli_epi16(hi.hi, 4)), k32)};
#endif
}

// A tile's weight row a group at a time on the ymm (xmm) tiles, a group one block or a K-quant's super-block of 8:
// head(g) takes the group at g (loads a block; reads a super-block's header), load(j) its block j (K-quants), then
// dot(x) that block's lanes with a block of x's quants, d the fp16 scale they take (times x's d); Q4_1's min m
// (times x's d * sum(q_x)), Q4_K's mins per super-block (negm).
template <int64_t QT>
constexpr int kSubs = kKQuant<QT> ? 8 : 1;  // blocks a group

template <int64_t QT>
struct Ints;

template <>
struct Ints<kGgmlQ8_0> {
  float d;
#if defined(__AVX2__)
  Bytes32 u, q;  // |q| as unsigned bytes (-128 is 128) and q, whose signs go onto x
  inline void head(const uint8_t* blk) {
    d = half_to_float(blk);
    q = load32(blk + 2);
    u = _mm256_abs_epi8(q);
  }
  inline v8i dot(Bytes32 x) const { return idot(u, _mm256_sign_epi8(x, q)); }
#else
  Bytes32 q;
  inline void head(const uint8_t* blk) {
    d = half_to_float(blk);
    q = load32(blk + 2);
  }
  inline v8i dot(Bytes32 x) const { return idot(q, x); }
#endif
  inline void load(int) {}
};

template <>
struct Ints<kGgmlQ4_1> {
  float d, m;
  Bytes32 u;  // the nibbles as bytes, in weight order
  inline void head(const uint8_t* blk) {
    d = half_to_float(blk), m = half_to_float(blk + 2);
    const __m128i qs = load16(blk + 4), low = _mm_set1_epi8(0x0F);
    u = join(_mm_and_si128(qs, low), _mm_and_si128(_mm_srli_epi16(qs, 4), low));
  }
  inline void load(int) {}
  inline v8i dot(Bytes32 x) const { return idot(u, x); }
};

template <>
struct Ints<kGgmlQ5_0> {
  float d;
#if defined(__AVX2__)
  Bytes32 u, q;  // |q - 16| and q - 16, whose signs go onto x (as Q8_0's)
  inline void set_q(Bytes32 q16) { q = q16, u = _mm256_abs_epi8(q16); }
  inline v8i dot(Bytes32 x) const { return idot(u, _mm256_sign_epi8(x, q)); }
#else
  Bytes32 q;
  inline void set_q(Bytes32 q16) { q = q16; }
  inline v8i dot(Bytes32 x) const { return idot(q, x); }
#endif
  inline void head(const uint8_t* blk) {
    d = half_to_float(blk);
    const __m128i qs = load16(blk + 6), low = _mm_set1_epi8(0x0F);
    const Bytes32 nibbles = join(_mm_and_si128(qs, low), _mm_and_si128(_mm_srli_epi16(qs, 4), low));
    const Bytes32 fifth = bit4_bytes32(load_u32(blk + 2));
#if defined(__AVX2__)
    set_q(_mm256_sub_epi8(_mm256_or_si256(nibbles, fifth), _mm256_set1_epi8(16)));
#else
    const __m128i k16 = _mm_set1_epi8(16);
    set_q({_mm_sub_epi8(_mm_or_si128(nibbles.lo, fifth.lo), k16),
           _mm_sub_epi8(_mm_or_si128(nibbles.hi, fifth.hi), k16)});
#endif
  }
  inline void load(int) {}
};

template <>
struct Ints<kGgmlQ4_K> {
  const uint8_t* qs;
  float d;                      // the super-block's d
  v8f negm;                     // -dmin m_j (exact), j = 0..7
  alignas(16) uint8_t scm[16];  // sc_j, then m_j
  Bytes32 u;                    // block j's nibbles
  Scales sc;                    // and sc_j
  inline void head(const uint8_t* sb) {
    qs = sb + 16;
    d = half_to_float(sb);
    _mm_store_si128(reinterpret_cast<__m128i*>(scm), q4k_scales_mins(sb + 4));
    const float dmin = half_to_float(sb + 2);
    for (int j = 0; j < 8; ++j) negm[j] = -(dmin * float(scm[8 + j]));
  }
  inline void load(int j) {
    u = srl_and(load32(qs + 32 * (j / 2)), 4 * (j % 2), 0x0F);
    sc = scales(scm[j], scm[j]);
  }
  inline v8i dot(Bytes32 x) const { return idot(u, x, sc); }
};

template <>
struct Ints<kGgmlQ6_K> {
  const uint8_t* sb;
  float d;
  Scales sc;  // block j's two 16-weight groups' int8 scales
#if defined(__AVX2__)
  Bytes32 u, q;  // |q - 32| and q - 32, whose signs go onto x
  inline void set_q(Bytes32 q32) { q = q32, u = _mm256_abs_epi8(q32); }
  inline v8i dot(Bytes32 x) const { return idot(u, _mm256_sign_epi8(x, q), sc); }
#else
  Bytes32 q;
  inline void set_q(Bytes32 q32) { q = q32; }
  inline v8i dot(Bytes32 x) const { return idot(q, x, sc); }
#endif
  inline void head(const uint8_t* block) {
    sb = block;
    d = half_to_float(sb + 208);
  }
  inline void load(int j) {
    const int8_t* scale = reinterpret_cast<const int8_t*>(sb + 192 + 2 * j);
    sc = scales(scale[0], scale[1]);
    set_q(q6k_bytes32(sb, j));
  }
};

#pragma GCC pop_options

}  // namespace tandem_quant
