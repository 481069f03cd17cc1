// The int8 path's view of a weight block on AVX-512 (gemm_quant_int8.cpp; quant_ints.h has the other levels'):
// two neighbouring blocks of 32 weights in a zmm register, their integer dot products with two blocks of quantized
// x (16 int32 lanes, 0-7 the first block's, 8-15 the second's, each the sum of 4 products: exact), and the fp32
// factors those lanes take. The quants go in as quant_ints.h says, but for Q5_0: q (0..31) unsigned, with the lanes
// 0 and 8 started at -16 sum(q_x) of x's block (VPDPBUSD accumulates onto it), so the lanes sum to the dot product
// of q - 16 with q_x as the sign trick's would, one instruction less.
#pragma once

#include "quant_ints.h"

namespace tandem_quant {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#if defined(__AVX512F__)
// Unsigned bytes u by signed bytes s from `seed` (VPDPBUSD; VPMADDUBSW + VPMADDWD without VNNI, exact as quant_ints.h
// says), and the pair sums times 16-bit scales.
inline __m512i idot(__m512i u, __m512i s, __m512i seed = _mm512_setzero_si512()) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(seed, u, s);
#else
  return _mm512_add_epi32(seed, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
inline __m512i idot_scaled(__m512i u, __m512i s, __m512i sc) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), sc);
}
// [p0 x 8, p2 x 8]: lane 0 of p for the first block's lanes, lane 2 for the second's.
inline __m512 spread2(__m128 p) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_castps128_ps512(p));
}
inline __m512i shifts(short lo, short hi) {  // 16-bit counts: `lo` in the low 256 bits, `hi` in the high
  return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
}
inline __m512i broadcast_256(const uint8_t* p) {  // 32 bytes in both halves
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
}
// Q4_1's and Q5_0's nibbles of the blocks at a and b (16 bytes each) as bytes in weight order.
inline __m512i nibbles_2x16(const uint8_t* a, const uint8_t* b) {
  // [a, a, b, b], every other 128 bits shifted down by a nibble, masked: [low a, high a, low b, high b]
  const __m512i qs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(load16(a))),
                                        _mm256_broadcastsi128_si256(load16(b)), 1);
  const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                         0x0004000400040004, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi16(qs, shift), _mm512_set1_epi8(0x0F));
}
// fp16 values at a and b as [a, 0, b, 0]
inline __m128 halves_2(const uint8_t* a, const uint8_t* b) {
  uint16_t ha, hb;
  std::memcpy(&ha, a, sizeof(ha));
  std::memcpy(&hb, b, sizeof(hb));
  return _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(ha), hb, 2));
}

// A pair of x's blocks as the zmm tiles take them (once per pair and row of x).
struct XPair {
  __m512i q;     // the 64 quants
  __m512 d;      // [d_x0 x 8, d_x1 x 8]
  __m128 ds;     // [d_x0, s_x0, d_x1, s_x1], s = d_x * sum(q_x)
  __m512i seed;  // Q5_0: -16 sum(q_x) of each block in lanes 0 and 8, zeros elsewhere
};

// A tile's weight row a group at a time: head(g) takes the group at g (two blocks, or a K-quant's super-block:
// its header), load(c) its pair of blocks c (K-quants; the others load in head), add() their products with a pair
// of x's blocks into a tile's accumulators: acc's 16 lanes (d_w d_x, exact, times the lanes' integer sums, exact:
// one rounding, an FMA) and Q4_1's min terms m_w s_x into accm's lanes 1 and 3 (an FMA; 0 and 2 unused). Q4_K's
// min terms go into acc, a super-block's 8 at once (finish(): -dmin m_j s_j, an FMA, into lane 2j + 1).
template <int64_t QT>
constexpr int kPairs = kKQuant<QT> ? 4 : 1;  // pairs a group
template <int64_t QT>
constexpr int64_t kGroupBytes = kKQuant<QT> ? kBlockBytes<QT> : 2 * kBlockBytes<QT>;

template <int64_t QT>
struct Pair;

template <>
struct Pair<kGgmlQ8_0> {
  __m512i u;      // |q| as unsigned bytes (-128 is 128)
  __mmask64 neg;  // q < 0: those bytes of x are negated (the sign trick)
  __m512 d;       // [d0 x 8, d1 x 8]
  inline void head(const uint8_t* blk) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(load32(blk + 2)), load32(blk + 36), 1);
    u = _mm512_abs_epi8(q);
    neg = _mm512_movepi8_mask(q);
    d = spread2(halves_2(blk, blk + 34));
  }
  inline void load(int) {}
  inline void add(const XPair& x, __m512& acc, __m128&) const {
    const __m512i s = _mm512_mask_sub_epi8(x.q, neg, _mm512_setzero_si512(), x.q);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, x.d), _mm512_cvtepi32_ps(idot(u, s)), acc);
  }
};

template <>
struct Pair<kGgmlQ4_1> {
  __m512i u;  // the 64 nibbles as bytes, in weight order
  __m128 dm;  // [d0, m0, d1, m1]
  __m512 d;   // [d0 x 8, d1 x 8]
  inline void head(const uint8_t* blk) {
    u = nibbles_2x16(blk + 4, blk + 24);
    dm = _mm_cvtph_ps(_mm_setr_epi32(int(load_u32(blk)), int(load_u32(blk + 20)), 0, 0));
    d = spread2(dm);
  }
  inline void load(int) {}
  inline void add(const XPair& x, __m512& acc, __m128& accm) const {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, x.d), _mm512_cvtepi32_ps(idot(u, x.q)), acc);
    accm = _mm_fmadd_ps(dm, x.ds, accm);
  }
};

template <>
struct Pair<kGgmlQ5_0> {
  __m512i u;  // q, 0..31: the lanes' sums from x's seed are those of q - 16
  __m512 d;   // [d0 x 8, d1 x 8]
  inline void head(const uint8_t* blk) {
    const uint64_t bits = load_u32(blk + 2) | uint64_t(load_u32(blk + 24)) << 32;
    u = _mm512_or_si512(nibbles_2x16(blk + 6, blk + 28), _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
    d = spread2(halves_2(blk, blk + 22));
  }
  inline void load(int) {}
  inline void add(const XPair& x, __m512& acc, __m128&) const {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, x.d), _mm512_cvtepi32_ps(idot(u, x.q, x.seed)), acc);
  }
};

// A K-quant pair's 16-bit scales from its super-block's (words of `from`): pair c's word i (of 32, one per 2
// weights) takes scale c * Per + i / Run.
template <int Per, int Run>
struct ScalePicks {
  uint16_t index[4][32];
  constexpr ScalePicks() : index() {
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 32; ++i) index[c][i] = uint16_t(c * Per + i / Run);
  }
  inline __m512i pick(__m512i from, int c) const {
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(index[c]), from);
  }
};

template <>
struct Pair<kGgmlQ4_K> {
  const uint8_t* qs;
  __m512 d;       // the super-block's d in every lane
  __m512i scm;    // words 0-7 the super-block's sc_j
  __m512 negm;    // -dmin m_j in lanes 2j and 2j + 1 (exact)
  __m512i u, sc;  // a pair's nibbles and their scales
  inline void head(const uint8_t* sb) {
    qs = sb + 16;
    d = _mm512_set1_ps(half_to_float(sb));
    const __m128i bytes = q4k_scales_mins(sb + 4);
    scm = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(bytes));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    const __m256 m8 = _mm256_mul_ps(mins, _mm256_set1_ps(-half_to_float(sb + 2)));
    negm = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                 _mm512_castps256_ps512(m8));
  }
  inline void load(int c) {  // sub-blocks 2c (the low nibbles of 32 bytes) and 2c + 1 (their high nibbles)
    static constexpr ScalePicks<2, 16> picks;  // sc_2c, sc_2c+1
    u = _mm512_and_si512(_mm512_srlv_epi16(broadcast_256(qs + 32 * c), shifts(0, 4)), _mm512_set1_epi8(0x0F));
    sc = picks.pick(scm, c);
  }
  inline void add(const XPair& x, __m512& acc, __m128&) const {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, x.d), _mm512_cvtepi32_ps(idot_scaled(u, x.q, sc)), acc);
  }
  // the super-block's min terms, x's [d, s] of its 8 blocks in ds: -dmin m_j s_j into lane 2j + 1
  inline void finish(__m512 ds, __m512& acc) const { acc = _mm512_mask3_fmadd_ps(negm, ds, acc, 0xAAAA); }
};

template <>
struct Pair<kGgmlQ6_K> {
  const uint8_t* sb;
  __m512 d;       // the super-block's d in every lane
  __m512i sc16;   // its 16 scales as words
  __m512i u, sc;  // a pair's |q - 32| and its four 16-weight groups' scales
  __mmask64 neg;  // q - 32 < 0
  inline void head(const uint8_t* block) {
    sb = block;
    d = _mm512_set1_ps(half_to_float(sb + 208));
    sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(load16(sb + 192)));
  }
  inline void load(int c) {  // sub-blocks 2c and 2c + 1: 64 bytes of ql, one nibble; 32 of qh, two bit pairs
    static constexpr ScalePicks<4, 8> picks;  // sc[4c .. 4c + 3], 16 weights each
    const int h = c / 2;
    const __m512i lo = _mm512_srl_epi16(_mm512_loadu_si512(sb + 64 * h), _mm_cvtsi32_si128(4 * (c & 1)));
    // qh's bit pairs 4 (c % 2) (sub-block 2c) and 4 (c % 2) + 2 (2c + 1) of each byte, moved to bits 4-5
    const __m512i qh = broadcast_256(sb + 128 + 32 * h);
    const __m512i up = c & 1 ? _mm512_srlv_epi16(qh, shifts(0, 2)) : _mm512_sllv_epi16(qh, shifts(4, 2));
    const __m512i hi = _mm512_and_si512(up, _mm512_set1_epi8(0x30));
    const __m512i q = _mm512_sub_epi8(_mm512_ternarylogic_epi32(lo, _mm512_set1_epi8(0x0F), hi, 0xEA),
                                      _mm512_set1_epi8(32));  // (lo & 0x0F) | hi, less 32
    u = _mm512_abs_epi8(q);
    neg = _mm512_movepi8_mask(q);
    sc = picks.pick(sc16, c);
  }
  inline void add(const XPair& x, __m512& acc, __m128&) const {
    const __m512i s = _mm512_mask_sub_epi8(x.q, neg, _mm512_setzero_si512(), x.q);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, x.d), _mm512_cvtepi32_ps(idot_scaled(u, s, sc)), acc);
  }
};
#endif

#pragma GCC pop_options

}  // namespace tandem_quant
