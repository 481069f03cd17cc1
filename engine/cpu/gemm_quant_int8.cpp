// int8 activations for the CPU engine's quantized linears (gemm_quant.cpp has the entry points and the fp32 path;
// quant_blocks.h the block formats; quant_ints.h and quant_pairs.h the weights' integer forms): llama.cpp's
// arithmetic, the default (TANDEM_QUANT_ACTIVATIONS=int8).
//
// x is quantized once a call, as ggml quantizes activations for Q8_0, Q4_1 and Q5_0 weights, to Q8_0 blocks of its
// own (d_x = max |x| / 127, q_x = x / d_x rounded half away from zero, d_x rounded to fp16: gguf.quants' Q8_0
// quantizer bit for bit); K-quant weights take the same 32-value blocks (ggml quantizes x to Q8_K's 256 for them:
// here x is quantized once whatever the types of the linears it meets, and more finely). A block's products are
// integer dot products: 32 unsigned weight bytes by 32 signed x bytes summed 4 at a time into 8 int32 lanes
// (VPDPBUSD with AVX-512 VNNI, VPMADDUBSW + VPMADDWD with AVX2, 16-bit PMADDWD with SSE2), exact; K-quants'
// integer sub-block scales multiply those sums, exact. Per output and block j of 32 weights, in fp32:
//   Q8_0:  d_w d_x * dot(q, q_x)                  Q4_1:  d_w d_x * dot(q, q_x)  +  m_w * (d_x * sum(q_x))
//   Q5_0:  d_w d_x * dot(q - 16, q_x)             Q4_K:  d d_x * sc_j dot(q, q_x)  +  (-dmin m_j) * (d_x * sum(q_x))
//   Q6_K:  d d_x * (sc_2j dot(q - 32, q_x) over weights 0-15  +  sc_2j+1 dot(q - 32, q_x) over 16-31)
// d_w d_x (d: the super-block's for K-quants), -dmin m_j and d_x * sum(q_x) are exact in fp32 (fp16 values, 6-bit
// integers, sums of 32 int8s), so each of the 8 lanes' terms a block is rounded once (an FMA into that lane's fp32
// chain over the blocks; with SSE2, which has no FMA, a product then a sum), and so is each min term (Q4_1's in a
// chain of their own; Q4_K's a super-block's 8 at once, into 8 of the lanes' chains); then a fixed tree over the
// lanes, Q4_1's min terms, + bias. tests/test_cpu_gemm_quant.py bounds the result against gguf's quantization of
// x times gguf's dequantized weights in fp64.
//
// AVX-512 takes two neighbouring blocks a zmm register; AVX2 and SSE2 one block at a time (one ymm, two xmm): the
// ymm tiles were measured 1.3-1.9x slower at the AVX-512 level, VNNI and 32 registers notwithstanding. Work as the
// fp32 path's: tiles of weight rows by rows of x, x 64 rows at a time, the tiles split over the threads; every
// output is the same chain of sums whatever M, the chunking or the thread count.

#include "ops.h"
#include "quant_pairs.h"

namespace tandem_quant {
namespace {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")  // the sums' order is the one the top describes, at every level

typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// One block of 32 values of x as ggml's Q8_0 (gguf.quants' Q8_0.quantize_blocks, bit for bit): d = max |x| / 127
// and q = x * (1 / d) rounded half away from zero, in fp32; returns d's fp16 bits (nearest even), writes q and
// sum(q). No contraction: x * (1 / d) is rounded to fp32 before it is split into whole and fraction, as numpy
// rounds it.
__attribute__((optimize("fp-contract=off"))) inline uint16_t quantize_block(const float* x, int8_t* q, int32_t& sum) {
  const v16f x0 = *reinterpret_cast<const v16f_u*>(x), x1 = *reinterpret_cast<const v16f_u*>(x + 16);
  const v16u magnitude = v16u{} + 0x7FFFFFFFu;
  const v16f a0 = (v16f)((v16u)x0 & magnitude), a1 = (v16f)((v16u)x1 & magnitude);
  const v16f a = a0 > a1 ? a0 : a1;
  // max |x| by halving (exact in any order); a loop of std::max took ~2% of a one-stream decode step
  const v8f h8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f l8 = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8f m8 = h8 > l8 ? h8 : l8;
  const v4f h4 = __builtin_shufflevector(m8, m8, 0, 1, 2, 3), l4 = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const v4f m4 = h4 > l4 ? h4 : l4;
  const float amax = std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
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
  const int8_t* q;     // [M, k2]
  const float* ds;     // [M, k2 / 32, 2]: each block's d (its fp16 value) and s = d * sum(q), exact in fp32
                       // (11 + 12 significant bits)
  const int32_t* sum;  // [M, k2 / 32]: each block's sum(q)
  int64_t k2, blocks;  // the padded row, and the blocks of x in it
  const int8_t* q_row(int64_t i) const { return q + i * k2; }
  const float* ds_row(int64_t i) const { return ds + i * (k2 / kBlock * 2); }
  const int32_t* sum_row(int64_t i) const { return sum + i * (k2 / kBlock); }
};

// x [M, K] quantized into `store` (allocated here), rows split over the threads.
Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, at::Tensor& store) {
  const int64_t blocks = K / kBlock, padded = (blocks + 1) / 2 * 2, k2 = padded * kBlock;
  store = at::empty({M * (k2 + 12 * padded)}, at::kByte);
  int8_t* q = reinterpret_cast<int8_t*>(store.data_ptr<uint8_t>());
  float* ds = reinterpret_cast<float*>(q + M * k2);  // M * k2: a multiple of 64 bytes
  const Q8Rows rows{q, ds, reinterpret_cast<int32_t*>(ds + M * padded * 2), k2, blocks};
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      int8_t* qi = q + i * k2;
      float* dsi = const_cast<float*>(rows.ds_row(i));
      int32_t* sums = const_cast<int32_t*>(rows.sum_row(i));
      for (int64_t b = 0; b < blocks; ++b) {
        dsi[2 * b] = half_value(quantize_block(x + i * K + b * kBlock, qi + b * kBlock, sums[b]));
        dsi[2 * b + 1] = dsi[2 * b] * float(sums[b]);
      }
      if (padded > blocks) {
        std::memset(qi + K, 0, kBlock);
        dsi[2 * blocks] = dsi[2 * blocks + 1] = 0.f;
        sums[blocks] = 0;
      }
    }
  });
  return rows;
}

#if defined(__AVX512F__)
// Four weight rows a tile, two where a min-term accumulator per output takes registers (Q4_1) or where four were
// slower at one row of x (Q6_K, measured: 1.6x from DRAM and 3-6% in cache at M = 1, against 5-8% faster at 16).
template <int64_t QT>
constexpr int kNR8 = QT == kGgmlQ4_1 || QT == kGgmlQ6_K ? 2 : 4;
constexpr int kMR8 = 4;

// Blocks 2p and 2p + 1 of row i of x.
template <int64_t QT>
inline XPair x_pair(const Q8Rows& x, int64_t i, int64_t p) {
  XPair xp;
  xp.q = _mm512_loadu_si512(x.q_row(i) + p * 2 * kBlock);
  xp.ds = _mm_loadu_ps(x.ds_row(i) + p * 4);
  xp.d = spread2(xp.ds);
  if constexpr (QT == kGgmlQ5_0) {  // -16 sum(q_x) of each block into lanes 0 and 8
    const __m128i sums = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.sum_row(i) + 2 * p));
    const __m128i seed = _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sums, 4));
    xp.seed = _mm512_maskz_expand_epi32(0x0101, _mm512_castsi128_si512(seed));
  }
  return xp;
}

// y[m, r] (+ bias[r]) for R rows of quantized x from row m0 by kNR8 rows of W at `w` (as `tile`): a group (two
// blocks, or a super-block) of every weight row at a time, a pair of blocks by R rows of x at a time.
template <int64_t QT, int R>
inline void tile8(const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t row_bytes, int nr, const float* bias,
                  float* y, int64_t ldy) {
  constexpr int NR = kNR8<QT>, P = kPairs<QT>;
  constexpr int64_t bytes = kGroupBytes<QT>;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  __m512 acc[R][NR];
  __m128 accm[R][NR];
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps(), accm[m][r] = _mm_setzero_ps();
  // group g of every row (src[r]) by x's blocks
  const auto group = [&](const uint8_t* const* src, int64_t g) __attribute__((always_inline)) {
    Pair<QT> wp[NR];
    for (int r = 0; r < NR; ++r) prefetch_ahead<bytes>(src[r]);
    for (int r = 0; r < NR; ++r) wp[r].head(src[r]);
    for (int c = 0; c < P; ++c) {
      for (int r = 0; r < NR; ++r) wp[r].load(c);
      const int64_t p = g * P + c;
      for (int m = 0; m < R; ++m) {
        const XPair xp = x_pair<QT>(x, m0 + m, p);
        for (int r = 0; r < NR; ++r) wp[r].add(xp, acc[m][r], accm[m][r]);
      }
    }
    if constexpr (QT == kGgmlQ4_K)  // the super-block's min terms
      for (int m = 0; m < R; ++m) {
        const __m512 ds = _mm512_loadu_ps(x.ds_row(m0 + m) + 16 * g);
        for (int r = 0; r < NR; ++r) wp[r].finish(ds, acc[m][r]);
      }
  };
  const int64_t groups = x.blocks / (2 * P);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src[NR];
    for (int r = 0; r < NR; ++r) src[r] = rows[r] + g * bytes;
    group(src, g);
  }
  if constexpr (P == 1) {
    if (x.blocks % 2) {  // the last block beside a block of zeros (as x's padding)
      uint8_t tail[NR][bytes] = {};
      const uint8_t* src[NR];
      for (int r = 0; r < NR; ++r) src[r] = (uint8_t*)std::memcpy(tail[r], rows[r] + groups * bytes, bytes / 2);
      group(src, groups);
    }
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

// y[m, r] (+ bias[r]) for R rows of quantized x from row m0 by kNR8 rows of W at `w` (as `tile`): a group of every
// weight row at a time, a block by R rows of x at a time; Q4_1's min terms in block order.
template <int64_t QT, int R>
inline void tile8(const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t row_bytes, int nr, const float* bias,
                  float* y, int64_t ldy) {
  constexpr int NR = kNR8<QT>;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  v8f acc[R][NR] = {};
  float mins[R][NR] = {};
  for (int64_t g = 0; g < x.blocks / kSubs<QT>; ++g) {
    Ints<QT> wq[NR];
    for (int r = 0; r < NR; ++r) prefetch_ahead<kBlockBytes<QT>>(rows[r] + g * kBlockBytes<QT>);
    for (int r = 0; r < NR; ++r) wq[r].head(rows[r] + g * kBlockBytes<QT>);
    for (int j = 0; j < kSubs<QT>; ++j) {
      for (int r = 0; r < NR; ++r) wq[r].load(j);
      const int64_t b = g * kSubs<QT> + j;
      for (int m = 0; m < R; ++m) {
        const Bytes32 xq = load32(x.q_row(m0 + m) + b * kBlock);
        const float* ds = x.ds_row(m0 + m) + 2 * b;
        const v8f dx = v8f{} + ds[0];
        for (int r = 0; r < NR; ++r) {  // d_w d_x exact; one rounding into the lane's chain
          acc[m][r] = fmadd((v8f{} + wq[r].d) * dx, __builtin_convertvector(wq[r].dot(xq), v8f), acc[m][r]);
          if constexpr (QT == kGgmlQ4_1) mins[m][r] = fmadd(wq[r].m, ds[1], mins[m][r]);
        }
      }
    }
    if constexpr (QT == kGgmlQ4_K)  // the super-block's min terms, block j's into lane j
      for (int m = 0; m < R; ++m) {
        const v8f_u* ds = reinterpret_cast<const v8f_u*>(x.ds_row(m0 + m) + 16 * g);
        const v8f s = __builtin_shufflevector(ds[0], ds[1], 1, 3, 5, 7, 9, 11, 13, 15);
        for (int r = 0; r < NR; ++r) acc[m][r] = fmadd(wq[r].negm, s, acc[m][r]);
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
  const int64_t row_bytes = K / kQK<QT> * kBlockBytes<QT>;
  for_tiles<kMR8, NR>(M, N, [&](int64_t m0, int r, int64_t n0, int nr) {
    table[r - 1](xq, m0, w + n0 * row_bytes, row_bytes, nr, bias ? bias + n0 : nullptr, y + m0 * N + n0, N);
  });
}


#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// The packed layout (quant.py's pack_rows; AVX-512 VNNI builds, Q8_0 and Q4_1): 16 weight rows a group, and a group's
// block j of every row together in 16 x (the block's bytes), the groups one after another along N, a group's blocks
// along K. In one such unit, 64 bytes k hold each of the 16 rows' dword k of its block's quants (lane l: row
// 16 g + l), then the 16 rows' fp16 d, then (Q4_1) their fp16 m. Q4_1's quant dwords are the file's bytes (dword k's
// low nibbles: weights 4k .. 4k + 3; its high nibbles: 16 + 4k ..); Q8_0's are q + 128, unsigned (VPDPBUSD's
// operand, with each block of x's sum started at -128 sum(q_x)). So a VPDPBUSD of a dword of every row with the same
// 4 bytes of x broadcast adds 4 products to each of 16 rows' lane, and a block's 8 of them leave each row's whole
// integer dot product with x's block in one lane, exact. Per output and block of 32, in fp32:
//   Q8_0:  d_w d_x * dot  into the output's one chain;   Q4_1:  the same, and m_w * (d_x sum(q_x)) into a second
// each rounded once (d_w d_x and d_x sum(q_x) exact, as above); then the chains' sum and + bias. Every output is the
// same chain whatever M, the chunking or the thread count; fewer roundings than the tiles above (one term a block,
// not 8), and about a quarter of their instructions a weight at one row of x (no unpacking across lanes, no
// scale spread per pair): a decode step's linears stream at DRAM speed instead of the tiles' compute speed.
inline __m512i x4(const int8_t* p) {  // 4 bytes of x in every lane (VPDPBUSD's broadcast operand)
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// y[m, r] (+ bias[r]) for R rows of quantized x from row m0 by the nr (<= 16) rows of the group at `w`.
template <int64_t QT, int R>
inline void tile_packed(const Q8Rows& x, int64_t m0, const uint8_t* w, int nr, const float* bias, float* y,
                        int64_t ldy) {
  __m512 acc[R], mins[R];
  for (int m = 0; m < R; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t j = 0; j < x.blocks; ++j) {
    const uint8_t* unit = w + j * kUnitBytes<QT>;
    if constexpr (QT == kGgmlQ4_1) {
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        const __m512i z = _mm512_loadu_si512(unit + 64 * k);
        lo[k] = _mm512_and_si512(z, low);
        hi[k] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
      }
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 256)));
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 288)));
      for (int m = 0; m < R; ++m) {
        const int8_t* xq = x.q_row(m0 + m) + j * kBlock;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          s0 = _mm512_dpbusd_epi32(s0, lo[k], x4(xq + 4 * k));
          s1 = _mm512_dpbusd_epi32(s1, hi[k], x4(xq + 16 + 4 * k));
        }
        const float* ds = x.ds_row(m0 + m) + 2 * j;
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ds[0])),
                                 _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[m]);
        mins[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[1]), mins[m]);
      }
    } else {
      __m512i u[8];
      for (int k = 0; k < 8; ++k) u[k] = _mm512_loadu_si512(unit + 64 * k);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 512)));
      for (int m = 0; m < R; ++m) {
        const int8_t* xq = x.q_row(m0 + m) + j * kBlock;
        __m512i s0 = _mm512_set1_epi32(-128 * x.sum_row(m0 + m)[j]), s1 = _mm512_setzero_si512();
        for (int k = 0; k < 8; k += 2) {
          s0 = _mm512_dpbusd_epi32(s0, u[k], x4(xq + 4 * k));
          s1 = _mm512_dpbusd_epi32(s1, u[k + 1], x4(xq + 4 * k + 4));
        }
        const float* ds = x.ds_row(m0 + m) + 2 * j;
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ds[0])),
                                 _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[m]);
      }
    }
  }
  const __mmask16 keep = __mmask16((1u << nr) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int m = 0; m < R; ++m) {
    __m512 out = QT == kGgmlQ4_1 ? _mm512_add_ps(acc[m], mins[m]) : acc[m];
    if (bias) out = _mm512_add_ps(out, b);
    _mm512_mask_storeu_ps(y + m * ldy, keep, out);
  }
}

template <int64_t QT>
void run_packed(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  using Tile = void (*)(const Q8Rows&, int64_t, const uint8_t*, int, const float*, float*, int64_t);
  static constexpr Tile table[4] = {tile_packed<QT, 1>, tile_packed<QT, 2>, tile_packed<QT, 3>, tile_packed<QT, 4>};
  at::Tensor store;
  const Q8Rows xq = quantize_rows(x, M, K, store);
  const int64_t group_bytes = K / kBlock * kUnitBytes<QT>;
  for_groups(M, N, [&](int64_t m0, int rows, int64_t g, int64_t n0, int nr) {
    table[rows - 1](xq, m0, w + g * group_bytes, nr, bias ? bias + n0 : nullptr, y + m0 * N + n0, N);
  });
}
#endif

#pragma GCC pop_options

}  // namespace

void gemm_int8(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K,
               int64_t N) {
  switch (qtype) {
    case kGgmlQ8_0: return run8<kGgmlQ8_0>(x, w, bias, y, M, K, N);
    case kGgmlQ4_1: return run8<kGgmlQ4_1>(x, w, bias, y, M, K, N);
    case kGgmlQ5_0: return run8<kGgmlQ5_0>(x, w, bias, y, M, K, N);
    case kGgmlQ4_K: return run8<kGgmlQ4_K>(x, w, bias, y, M, K, N);
    default: return run8<kGgmlQ6_K>(x, w, bias, y, M, K, N);
  }
}

void gemm_int8_packed(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,
                      int64_t K, int64_t N) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  if (qtype == kGgmlQ8_0) return run_packed<kGgmlQ8_0>(x, w, bias, y, M, K, N);
  return run_packed<kGgmlQ4_1>(x, w, bias, y, M, K, N);
#else
  (void)qtype, (void)x, (void)w, (void)bias, (void)y, (void)M, (void)K, (void)N;
#endif
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
