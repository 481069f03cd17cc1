// int8 activations for the CPU engine's quantized linears (gemm_quant.cpp has the entry points and the fp32 path;
// quant_blocks.h the block formats): llama.cpp's arithmetic, the default (TANDEM_QUANT_ACTIVATIONS=int8).
//
// x is quantized once a call, as ggml quantizes activations for these weight types, to Q8_0 blocks of its own
// (d_x = max |x| / 127, q_x = x / d_x rounded half away from zero, d_x rounded to fp16: gguf.quants' Q8_0
// quantizer bit for bit), and a block's products are integer dot products: 32 unsigned weight bytes by 32 signed
// x bytes summed 4 at a time into 8 int32 lanes (VPDPBUSD with AVX-512 VNNI, VPMADDUBSW + VPMADDWD with AVX2,
// 16-bit PMADDWD with SSE2), exact. Q4_1's nibbles are unsigned as they are; Q8_0's signed weights go in as |q|
// with their signs moved onto x (the sign trick: no weight-side data, so the resident weights stay the file's
// bytes). Per output and block, in fp32:
//   Q8_0:  d_w d_x * dot(q, q_x)                     Q4_1:  d_w d_x * dot(q, q_x)  +  m_w * (d_x * sum(q_x))
// d_w d_x and d_x * sum(q_x) are exact in fp32 (fp16 values, sums of 32 int8s), so each of the 8 lanes' terms a
// block is rounded once (an FMA into that lane's fp32 chain over the blocks; with SSE2, which has no FMA, a
// product then a sum); then a fixed tree over the lanes, Q4_1's min terms, + bias. tests/test_cpu_gemm_quant.py
// bounds the result against gguf's quantization of x times gguf's dequantized weights in fp64.
//
// AVX-512 takes two neighbouring blocks a zmm register; AVX2 and SSE2 one block at a time (one ymm, two xmm).
// Work as the fp32 path's: tiles of weight rows by rows of x, x 64 rows at a time, the tiles split over the
// threads; every output is the same chain of sums whatever M, the chunking or the thread count.

#include <ATen/ATen.h>

#include "quant_blocks.h"

namespace tandem_quant {
namespace {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")  // the sums' order is the one the top describes, at every level

typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));

// A block's 32 bytes (weights or quantized x) and the integer dot product of two: 8 int32 lanes, each the sum of
// 4 products, exact.
#if defined(__AVX2__)  // the avx2 and avx512 builds: one ymm register
typedef __m256i Bytes32;
inline Bytes32 load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline Bytes32 join(__m128i lo, __m128i hi) { return _mm256_set_m128i(hi, lo); }
// Unsigned bytes u by signed bytes s. Without VNNI, VPMADDUBSW's pair sums saturate at int16's 32767, which
// they never reach here: u <= 128 and |s| <= 127 (2 * 128 * 127 = 32512).
inline v8i idot(Bytes32 u, Bytes32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return (v8i)_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return (v8i)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#else  // SSE2: two xmm registers, bytes widened to 16 bits and multiplied in pairs (PMADDWD)
struct Bytes32 {
  __m128i lo, hi;
};
inline Bytes32 load32(const void* p) {
  return {load16(p), load16(static_cast<const uint8_t*>(p) + 16)};
}
inline Bytes32 join(__m128i lo, __m128i hi) { return {lo, hi}; }
inline __m128i dot16(__m128i a, __m128i b) {  // signed by signed
  const __m128i a0 = _mm_srai_epi16(_mm_unpacklo_epi8(a, a), 8), a1 = _mm_srai_epi16(_mm_unpackhi_epi8(a, a), 8);
  const __m128i b0 = _mm_srai_epi16(_mm_unpacklo_epi8(b, b), 8), b1 = _mm_srai_epi16(_mm_unpackhi_epi8(b, b), 8);
  return _mm_add_epi32(_mm_madd_epi16(a0, b0), _mm_madd_epi16(a1, b1));
}
// Signed by signed: the weights' bytes are Q8_0's signed q as they are, or Q4_1's nibbles (below 128: the same).
inline v8i idot(Bytes32 w, Bytes32 x) {
  return __builtin_shufflevector((v4i)dot16(w.lo, x.lo), (v4i)dot16(w.hi, x.hi), 0, 1, 2, 3, 4, 5, 6, 7);
}
#endif

// A block's weights as bytes (once per block and weight row), and their integer dot product with a block of a
// row of quantized x.
template <int64_t QT>
struct Ints;

template <>
struct Ints<kGgmlQ8_0> {
#if defined(__AVX2__)
  Bytes32 u, q;  // |q| as unsigned bytes (-128 is 128) and q, whose signs go onto x
  inline void load(const uint8_t* blk) {
    q = load32(blk + 2);
    u = _mm256_abs_epi8(q);
  }
  inline v8i dot(Bytes32 x) const { return idot(u, _mm256_sign_epi8(x, q)); }
#else
  Bytes32 q;  // signed by signed (SSE2)
  inline void load(const uint8_t* blk) { q = load32(blk + 2); }
  inline v8i dot(Bytes32 x) const { return idot(q, x); }
#endif
};

template <>
struct Ints<kGgmlQ4_1> {
  Bytes32 u;  // the nibbles as bytes, in weight order
  inline void load(const uint8_t* blk) {
    const __m128i qs = load16(blk + 4), low = _mm_set1_epi8(0x0F);
    u = join(_mm_and_si128(qs, low), _mm_and_si128(_mm_srli_epi16(qs, 4), low));
  }
  inline v8i dot(Bytes32 x) const { return idot(u, x); }
};

// One block of 32 values of x as ggml's Q8_0 (gguf.quants' Q8_0.quantize_blocks, bit for bit): d = max |x| / 127
// and q = x * (1 / d) rounded half away from zero, in fp32; returns d's fp16 bits (nearest even), writes q and
// sum(q). No contraction: x * (1 / d) is rounded to fp32 before it is split into whole and fraction, as numpy
// rounds it.
__attribute__((optimize("fp-contract=off"))) inline uint16_t quantize_block(const float* x, int8_t* q, int32_t& sum) {
  const v16f x0 = *reinterpret_cast<const v16f_u*>(x), x1 = *reinterpret_cast<const v16f_u*>(x + 16);
  const v16u magnitude = v16u{} + 0x7FFFFFFFu;
  const v16f a0 = (v16f)((v16u)x0 & magnitude), a1 = (v16f)((v16u)x1 & magnitude);
  const v16f a = a0 > a1 ? a0 : a1;
  float amax = 0.f;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, a[i]);
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const v16f half = v16f{} + 0.5f;
  sum = 0;
  for (int h = 0; h < 2; ++h) {
    const v16f v = (h ? x1 : x0) * id;
    const v16i t = __builtin_convertvector(v, v16i);          // toward zero
    const v16f frac = v - __builtin_convertvector(t, v16f);   // exact
    const v16i r = t - (v16i)(frac >= half) + (v16i)(frac <= -half);  // a comparison is -1 where true
    for (int j = 0; j < 16; ++j) {
      q[16 * h + j] = int8_t(r[j]);
      sum += r[j];
    }
  }
  return half_bits(d);
}

// x's rows quantized, what the int8 tiles read. A row is padded to an even number of blocks with zeros (q = 0,
// d = s = 0): the AVX-512 tiles take blocks two at a time.
struct Q8Rows {
  const int8_t* q;   // [M, k2]
  const float* ds;   // [M, k2 / 32, 2]: each block's d (its fp16 value) and s = d * sum(q), exact in fp32
                     // (11 + 12 significant bits)
  int64_t k2, blocks;  // the padded row, and the blocks of x in it
  const int8_t* q_row(int64_t i) const { return q + i * k2; }
  const float* ds_row(int64_t i) const { return ds + i * (k2 / kBlock * 2); }
};

// x [M, K] quantized into `store` (allocated here), rows split over the threads.
Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, at::Tensor& store) {
  const int64_t blocks = K / kBlock, padded = (blocks + 1) / 2 * 2, k2 = padded * kBlock;
  store = at::empty({M * (k2 + 8 * padded)}, at::kByte);
  int8_t* q = reinterpret_cast<int8_t*>(store.data_ptr<uint8_t>());
  const Q8Rows rows{q, reinterpret_cast<float*>(q + M * k2), k2, blocks};  // M * k2: a multiple of 64 bytes
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      int8_t* qi = q + i * k2;
      float* ds = const_cast<float*>(rows.ds_row(i));
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t sum;
        ds[2 * b] = half_value(quantize_block(x + i * K + b * kBlock, qi + b * kBlock, sum));
        ds[2 * b + 1] = ds[2 * b] * float(sum);
      }
      if (padded > blocks) {
        std::memset(qi + K, 0, kBlock);
        ds[2 * blocks] = ds[2 * blocks + 1] = 0.f;
      }
    }
  });
  return rows;
}

#if defined(__AVX512F__)
// Two neighbouring blocks of a weight row in zmm registers, and their products with two blocks of a row of x:
// 16 int32 lanes (VPDPBUSD; VPMADDUBSW + VPMADDWD without VNNI), lanes 0-7 the first block's, 8-15 the second's.
inline __m512i idot(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
// acc += [p0 x 8, p2 x 8] * S: lane 0 of p scales the first block's lanes, lane 2 the second's.
inline __m512 scaled_add(__m128 p, __m512i sums, __m512 acc) {
  const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(pick, _mm512_castps128_ps512(p)), _mm512_cvtepi32_ps(sums), acc);
}
inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int64_t QT>
struct Pair;

template <>
struct Pair<kGgmlQ4_1> {
  __m512i u;  // the 64 nibbles as bytes, in weight order
  __m128 dm;  // [d, m] of each block
  inline void load(const uint8_t* blk) {
    // [qs0, qs0, qs1, qs1], every other 128 bits shifted down by a nibble, masked: [low0, high0, low1, high1]
    const __m512i qs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(load16(blk + 4))),
                                          _mm256_broadcastsi128_si256(load16(blk + 24)), 1);
    const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                           0x0004000400040004, 0, 0);
    u = _mm512_and_si512(_mm512_srlv_epi16(qs, shift), _mm512_set1_epi8(0x0F));
    dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(load_i32(blk)), load_i32(blk + 20), 1));
  }
  // ds: x's [d, s] of the two blocks. accm's lanes 1 and 3 gather the min terms (0 and 2: unused).
  inline void add(__m512i xq, __m128 ds, __m512& acc, __m128& accm) const {
    const __m128 p = _mm_mul_ps(dm, ds);  // [d_w d_x (exact), m_w s_x] of each block
    accm = _mm_add_ps(accm, p);
    acc = scaled_add(p, idot(u, xq), acc);
  }
};

template <>
struct Pair<kGgmlQ8_0> {
  __m512i u;      // |q| as unsigned bytes (-128 is 128)
  __mmask64 neg;  // q < 0: those bytes of x are negated (the sign trick)
  __m128 d;       // [d, 0] of each block
  inline void load(const uint8_t* blk) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(load32(blk + 2)), load32(blk + 36), 1);
    u = _mm512_abs_epi8(q);
    neg = _mm512_movepi8_mask(q);
    uint16_t d0, d1;
    std::memcpy(&d0, blk, sizeof(d0));
    std::memcpy(&d1, blk + 34, sizeof(d1));
    d = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(d0), d1, 2));
  }
  inline void add(__m512i xq, __m128 ds, __m512& acc, __m128&) const {
    const __m512i s = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
    acc = scaled_add(_mm_mul_ps(d, ds), idot(u, s), acc);
  }
};

// Q4_1 keeps a min-term accumulator per output beside the 16-lane one, so fewer weight rows a tile.
template <int64_t QT>
constexpr int kNR8 = QT == kGgmlQ8_0 ? 4 : 2;
constexpr int kMR8 = 4;

// y[m, r] (+ bias[r]) for R rows of quantized x from row m0 by kNR8 rows of W at `w` (as `tile`).
template <int64_t QT, int R>
inline void tile8(const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t row_bytes, int nr, const float* bias,
                  float* y, int64_t ldy) {
  constexpr int NR = kNR8<QT>;
  constexpr int64_t bytes = kBlockBytes<QT>;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  __m512 acc[R][NR];
  __m128 accm[R][NR];
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps(), accm[m][r] = _mm_setzero_ps();
  // blocks 2p and 2p + 1 of every row (src[r]) by those of x
  const auto pair = [&](const uint8_t* const* src, int64_t p) __attribute__((always_inline)) {
    Pair<QT> wp[NR];
    for (int r = 0; r < NR; ++r) wp[r].load(src[r]);
    for (int m = 0; m < R; ++m) {
      const __m512i xq = _mm512_loadu_si512(x.q_row(m0 + m) + p * 2 * kBlock);
      const __m128 ds = _mm_loadu_ps(x.ds_row(m0 + m) + p * 4);
      for (int r = 0; r < NR; ++r) wp[r].add(xq, ds, acc[m][r], accm[m][r]);
    }
  };
  const int64_t pairs = x.blocks / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* src[NR];
    for (int r = 0; r < NR; ++r) src[r] = rows[r] + p * 2 * bytes;
    pair(src, p);
  }
  if (x.blocks % 2) {  // the last block beside a block of zeros (as x's padding)
    uint8_t tail[NR][2 * bytes] = {};
    const uint8_t* src[NR];
    for (int r = 0; r < NR; ++r) src[r] = (uint8_t*)std::memcpy(tail[r], rows[r] + 2 * pairs * bytes, bytes);
    pair(src, pairs);
  }
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < nr; ++r) {
      float sum = lanes_sum((v16f)acc[m][r]);
      if constexpr (QT == kGgmlQ4_1) sum += accm[m][r][1] + accm[m][r][3];
      y[m * ldy + r] = sum + (bias ? bias[r] : 0.f);
    }
}
#else
template <int64_t QT>
constexpr int kNR8 = 2;
#if defined(__AVX__)
constexpr int kMR8 = 2;
#else
constexpr int kMR8 = 1;
#endif

// a * b + c rounded once where the level has FMA (explicitly: GCC's contraction of `a * b + c` can differ between
// the tiles' instantiations, and a row's output must not depend on the tile it fell in), twice without.
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
inline v8f fmadd(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// y[m, r] (+ bias[r]) for R rows of quantized x from row m0 by kNR8 rows of W at `w` (as `tile`): a block at a
// time, Q4_1's min terms in block order.
template <int64_t QT, int R>
inline void tile8(const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t row_bytes, int nr, const float* bias,
                  float* y, int64_t ldy) {
  constexpr int NR = kNR8<QT>;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  v8f acc[R][NR] = {};
  float mins[R][NR] = {};
  for (int64_t b = 0; b < x.blocks; ++b) {
    Ints<QT> wq[NR];
    v8f dw[NR];
    float mw[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = rows[r] + b * kBlockBytes<QT>;
      wq[r].load(blk);
      dw[r] = v8f{} + half_to_float(blk);
      mw[r] = QT == kGgmlQ4_1 ? half_to_float(blk + 2) : 0.f;
    }
    for (int m = 0; m < R; ++m) {
      const Bytes32 xq = load32(x.q_row(m0 + m) + b * kBlock);
      const float* ds = x.ds_row(m0 + m) + 2 * b;
      const v8f dx = v8f{} + ds[0];
      for (int r = 0; r < NR; ++r) {  // d_w d_x exact; one rounding into the lane's chain
        acc[m][r] = fmadd(dw[r] * dx, __builtin_convertvector(wq[r].dot(xq), v8f), acc[m][r]);
        if constexpr (QT == kGgmlQ4_1) mins[m][r] = fmadd(mw[r], ds[1], mins[m][r]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < nr; ++r) y[m * ldy + r] = lanes_sum(acc[m][r]) + mins[m][r] + (bias ? bias[r] : 0.f);
}
#endif

template <int64_t QT>
void run8(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  constexpr int NR = kNR8<QT>;
  using Tile = void (*)(const Q8Rows&, int64_t, const uint8_t*, int64_t, int, const float*, float*, int64_t);
  static constexpr Tile table[4] = {tile8<QT, 1>, tile8<QT, kMR8 >= 2 ? 2 : 1>, tile8<QT, kMR8 >= 3 ? 3 : 1>,
                                    tile8<QT, kMR8 >= 4 ? 4 : 1>};
  at::Tensor store;
  const Q8Rows xq = quantize_rows(x, M, K, store);
  const int64_t row_bytes = xq.blocks * kBlockBytes<QT>;
  for_tiles<kMR8, NR>(M, N, [&](int64_t m0, int r, int64_t n0, int nr) {
    table[r - 1](xq, m0, w + n0 * row_bytes, row_bytes, nr, bias ? bias + n0 : nullptr, y + m0 * N + n0, N);
  });
}

#pragma GCC pop_options

}  // namespace

void gemm_int8(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K,
               int64_t N) {
  if (qtype == kGgmlQ8_0)
    run8<kGgmlQ8_0>(x, w, bias, y, M, K, N);
  else
    run8<kGgmlQ4_1>(x, w, bias, y, M, K, N);
}

void quantize_blocks_q8_0(const float* x, int64_t blocks, uint8_t* out) {
  at::parallel_for(0, blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      int32_t sum;
      uint8_t* blk = out + i * kBlockBytes<kGgmlQ8_0>;
      const uint16_t d = quantize_block(x + i * kBlock, reinterpret_cast<int8_t*>(blk + 2), sum);
      std::memcpy(blk, &d, sizeof(d));
    }
  });
}

}  // namespace tandem_quant
