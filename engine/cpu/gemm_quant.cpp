// Weight-only quantized linears for the CPU engine: y[M, N] = x[M, K] @ W^T (+ bias) with W in a GGUF file's
// own block layout (quant_blocks.h: Q8_0, Q4_1, Q5_0, Q4_K, Q6_K), kept as it is in the file
// (engine/cpu/quant.py), so a model's linears read its quantized bytes and nothing else. Each row of W is K / QK
// blocks (QK = 32, or 256 for the K-quants' super-blocks), rows one after the other ([N, K / QK * bytes] uint8).
//
// Two arithmetics; quant.py picks one per call (TANDEM_QUANT_ACTIVATIONS): int8 activations (llama.cpp's, the default:
// gemm_quant_int8.cpp) or fp32 activations, the exact path, here: each block of 32 weights (a K-quant's sub-block, with
// its super-block's header) is dequantized in registers into two vectors of 16 fp32 values (one zmm register under
// AVX-512, two ymm under AVX2, four xmm under SSE2), used for MR rows of x at once, then dropped; with more than MR
// rows of x (a prefill, a batch) a tile's NR rows are dequantized once a 64-row chunk of x into a small buffer every MR
// rows then read, the same values summed in the same order (the dequantization, not the multiply-adds, is what the
// exact path's time went to). Every product in a weight is exact in fp32 (d has 11 significant bits, d * sc at most 18,
// q at most 8), so d * q (+ m), d * (q - 16), (d * sc) * q - dmin * m and (d * sc) * (q - 32) (one rounding where there
// is a min, whether contracted to an FMA or not) are bit for bit the fp32 weights the `gguf` package's dequantize gives
// (numpy's products are exact too): the result is the fp32 GEMM of those weights, summed in this kernel's order (per
// output, 16 lane-wise fp32 multiply-add chains over k, then a fixed tree over the lanes, + bias), within gamma_{K+1}
// of the exact sum relative to sum |x| |w| (tests/test_cpu_gemm_quant.py checks that bound against gguf's dequantize).
//
// One source in GCC vectors and per-level intrinsics, compiled at every level as the rest of engine/cpu/.
// Work: tiles of NR rows of W (NR blocks' dequantized weights in registers) by MR rows of x; x is taken 64 rows
// at a time (its chunk stays in L2 while every tile passes over it) and the tiles are split over the threads.
// Every output is the same chain of sums whatever M, the chunking or the thread count.

#include "ops.h"

#include "quant_blocks.h"

#include <vector>

namespace {

using namespace tandem_quant;

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")  // the sums' order is the one the top describes, at every level

// 16 bytes as 16 fp32 values, unsigned (U) or signed. By intrinsics: GCC 12 turns __builtin_convertvector from
// bytes to floats into 16 scalar conversions at every level.
#if defined(__AVX512F__)
template <bool U>
inline v16f bytes_to_float(__m128i b) {
  return (v16f)_mm512_cvtepi32_ps(U ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
}
#elif defined(__AVX2__)
template <bool U>
inline v8f bytes8_to_float(__m128i b) {  // the low 8 bytes
  return (v8f)_mm256_cvtepi32_ps(U ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
}
template <bool U>
inline v16f bytes_to_float(__m128i b) {
  return __builtin_shufflevector(bytes8_to_float<U>(b), bytes8_to_float<U>(_mm_srli_si128(b, 8)), 0, 1, 2, 3, 4,
                                 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else  // SSE2: widen by unpacking, with zeros (unsigned) or the value's own bits shifted down (signed)
template <bool U>
inline __m128i widen16(__m128i lo_or_hi8) {  // 8 bytes already unpacked to the 16-bit lanes' high halves
  return U ? _mm_srli_epi16(lo_or_hi8, 8) : _mm_srai_epi16(lo_or_hi8, 8);
}
template <bool U>
inline v4f words4_to_float(__m128i w16) {  // 4 16-bit values, unpacked to 32-bit lanes' high halves
  return (v4f)_mm_cvtepi32_ps(U ? _mm_srli_epi32(w16, 16) : _mm_srai_epi32(w16, 16));
}
template <bool U>
inline v16f bytes_to_float(__m128i b) {
  const __m128i lo = widen16<U>(_mm_unpacklo_epi8(b, b)), hi = widen16<U>(_mm_unpackhi_epi8(b, b));
  const v4f q0 = words4_to_float<U>(_mm_unpacklo_epi16(lo, lo)), q1 = words4_to_float<U>(_mm_unpackhi_epi16(lo, lo));
  const v4f q2 = words4_to_float<U>(_mm_unpacklo_epi16(hi, hi)), q3 = words4_to_float<U>(_mm_unpackhi_epi16(hi, hi));
  const v8f a = __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f c = __builtin_shufflevector(q2, q3, 0, 1, 2, 3, 4, 5, 6, 7);
  return __builtin_shufflevector(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif
// Tile shapes by the registers a level has: MR x NR accumulators of 16 lanes plus 2 NR weight vectors.
#if defined(__AVX512F__)
constexpr int kMR = 4, kNR = 4;  // 16 + 8 zmm
#elif defined(__AVX__)
constexpr int kMR = 2, kNR = 2;  // (4 + 4) x 2 ymm
#else
constexpr int kMR = 1, kNR = 2;  // (2 + 4) x 4 xmm
#endif

// Block b (32 weights along K) of a weight row as two 16-lane fp32 vectors, gguf's values bit for bit (numpy's
// products are exact, and so are these: the same values whatever the order; Q4_1's and Q4_K's one rounding is
// numpy's, contracted to an FMA or not).
template <int64_t QT>
inline void dequant(const uint8_t* row, int64_t b, v16f& w0, v16f& w1);

template <>
inline void dequant<kGgmlQ8_0>(const uint8_t* row, int64_t b, v16f& w0, v16f& w1) {
  const uint8_t* blk = row + b * kBlockBytes<kGgmlQ8_0>;
  const v16f d = v16f{} + half_to_float(blk);
  w0 = bytes_to_float<false>(load16(blk + 2)) * d;
  w1 = bytes_to_float<false>(load16(blk + 18)) * d;
}

template <>
inline void dequant<kGgmlQ4_1>(const uint8_t* row, int64_t b, v16f& w0, v16f& w1) {
  const uint8_t* blk = row + b * kBlockBytes<kGgmlQ4_1>;
  const v16f d = v16f{} + half_to_float(blk), m = v16f{} + half_to_float(blk + 2);
  const __m128i qs = load16(blk + 4), low = _mm_set1_epi8(0x0F);
  w0 = bytes_to_float<true>(_mm_and_si128(qs, low)) * d + m;
  w1 = bytes_to_float<true>(_mm_and_si128(_mm_srli_epi16(qs, 4), low)) * d + m;
}

template <>
inline void dequant<kGgmlQ5_0>(const uint8_t* row, int64_t b, v16f& w0, v16f& w1) {
  const uint8_t* blk = row + b * kBlockBytes<kGgmlQ5_0>;
  const v16f d = v16f{} + half_to_float(blk);
  const uint32_t qh = load_u32(blk + 2);
  const __m128i qs = load16(blk + 6), low = _mm_set1_epi8(0x0F), sixteen = _mm_set1_epi8(16);
  const __m128i q0 = _mm_or_si128(_mm_and_si128(qs, low), bit4_bytes16(qh));
  const __m128i q1 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), low), bit4_bytes16(qh >> 16));
  w0 = bytes_to_float<false>(_mm_sub_epi8(q0, sixteen)) * d;  // d * (q - 16), as numpy: -0 where d < 0, q = 16
  w1 = bytes_to_float<false>(_mm_sub_epi8(q1, sixteen)) * d;
}

template <>
inline void dequant<kGgmlQ4_K>(const uint8_t* row, int64_t b, v16f& w0, v16f& w1) {
  const uint8_t* sb = row + b / 8 * kBlockBytes<kGgmlQ4_K>;
  const int j = int(b % 8);
  int sc, m;
  q4k_scale_min(sb + 4, j, sc, m);
  const v16f dsc = v16f{} + half_to_float(sb) * float(sc), dm = v16f{} + half_to_float(sb + 2) * float(m);
  const uint8_t* qs = sb + 16 + 32 * (j / 2);
  const __m128i low = _mm_set1_epi8(0x0F), shift = _mm_cvtsi32_si128(4 * (j % 2));
  w0 = bytes_to_float<true>(_mm_and_si128(_mm_srl_epi16(load16(qs), shift), low)) * dsc - dm;
  w1 = bytes_to_float<true>(_mm_and_si128(_mm_srl_epi16(load16(qs + 16), shift), low)) * dsc - dm;
}

// Q6_K's 16 q - 32 of sub-block s (of its super-block `sb`) from byte 16 k on, as signed bytes.
inline __m128i q6k_bytes16(const uint8_t* sb, int s, int k) {
  const int h = s / 4;
  const __m128i ql = load16(sb + 64 * h + 32 * (s & 1) + 16 * k), qh = load16(sb + 128 + 32 * h + 16 * k);
  const __m128i lo = _mm_and_si128(_mm_srl_epi16(ql, _mm_cvtsi32_si128(4 * ((s >> 1) & 1))), _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srl_epi16(qh, _mm_cvtsi32_si128(2 * (s & 3))), _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

template <>
inline void dequant<kGgmlQ6_K>(const uint8_t* row, int64_t b, v16f& w0, v16f& w1) {
  const uint8_t* sb = row + b / 8 * kBlockBytes<kGgmlQ6_K>;
  const int s = int(b % 8);
  const float d = half_to_float(sb + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192 + 2 * s);
  w0 = bytes_to_float<false>(q6k_bytes16(sb, s, 0)) * (v16f{} + d * float(sc[0]));
  w1 = bytes_to_float<false>(q6k_bytes16(sb, s, 1)) * (v16f{} + d * float(sc[1]));
}

// Block b of R rows of x (ldx apart) times NR weight rows' block b (w0, w1: its two 16-lane halves), into acc.
template <int R>
inline void madd_block(const float* x, int64_t ldx, int64_t b, const v16f* w0, const v16f* w1,
                       v16f (&acc)[R][kNR]) {
  for (int m = 0; m < R; ++m) {
    const v16f x0 = *reinterpret_cast<const v16f_u*>(x + m * ldx + b * kBlock);
    const v16f x1 = *reinterpret_cast<const v16f_u*>(x + m * ldx + b * kBlock + 16);
    for (int r = 0; r < kNR; ++r) {
      acc[m][r] += x0 * w0[r];
      acc[m][r] += x1 * w1[r];
    }
  }
}

template <int R>
inline void store_tile(const v16f (&acc)[R][kNR], int nr, const float* bias, float* y, int64_t ldy) {
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < nr; ++r) y[m * ldy + r] = lanes_sum(acc[m][r]) + (bias ? bias[r] : 0.f);
}

// y[m, r] (+ bias[r]) for R rows of x (ldx apart) by NR rows of W at `w` (row_bytes apart; rows past `nr` repeat
// the last and are not stored).
template <int64_t QT, int R>
inline void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int nr, int64_t blocks,
                 const float* bias, float* y, int64_t ldy) {
  const uint8_t* rows[kNR];
  for (int r = 0; r < kNR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  v16f acc[R][kNR] = {};
  constexpr int subs = kQK<QT> / kBlock;  // blocks a stored block (a K-quant's super-block): j a constant below
  for (int64_t g = 0; g < blocks / subs; ++g) {
    for (int r = 0; r < kNR; ++r) prefetch_ahead<kBlockBytes<QT>>(rows[r] + g * kBlockBytes<QT>);
#pragma GCC unroll 8
    for (int j = 0; j < subs; ++j) {
      const int64_t b = g * subs + j;
      v16f w0[kNR], w1[kNR];
      for (int r = 0; r < kNR; ++r) dequant<QT>(rows[r], b, w0[r], w1[r]);
      madd_block<R>(x, ldx, b, w0, w1, acc);
    }
  }
  store_tile<R>(acc, nr, bias, y, ldy);
}

// A tile's NR weight rows, every block dequantized once (rows past `nr` repeat the last) into `buf`, as tile()
// holds them in registers: block b's w0 of the NR rows at buf + 2 NR b, their w1 right after.
template <int64_t QT>
inline void dequant_tile(const uint8_t* w, int64_t row_bytes, int nr, int64_t blocks, v16f* buf) {
  const uint8_t* rows[kNR];
  for (int r = 0; r < kNR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < kNR; ++r) dequant<QT>(rows[r], b, buf[2 * kNR * b + r], buf[2 * kNR * b + kNR + r]);
}

// tile() with the weights taken from dequant_tile's buffer: the same products summed in the same order.
template <int R>
inline void tile_dequantized(const float* x, int64_t ldx, const v16f* buf, int nr, int64_t blocks,
                             const float* bias, float* y, int64_t ldy) {
  v16f acc[R][kNR] = {};
  for (int64_t b = 0; b < blocks; ++b) madd_block<R>(x, ldx, b, buf + 2 * kNR * b, buf + 2 * kNR * b + kNR, acc);
  store_tile<R>(acc, nr, bias, y, ldy);
}

template <int64_t QT>
void run(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = K / kBlock, row_bytes = K / kQK<QT> * kBlockBytes<QT>;
  if (M > kMR) {  // several tiles of x: each weight tile is dequantized once a chunk of x, not once a tile of it
    using Tile = void (*)(const float*, int64_t, const v16f*, int, int64_t, const float*, float*, int64_t);
    static constexpr Tile table[4] = {tile_dequantized<1>, tile_dequantized<kMR >= 2 ? 2 : 1>,
                                      tile_dequantized<kMR >= 3 ? 3 : 1>, tile_dequantized<kMR >= 4 ? 4 : 1>};
    const int64_t tiles = (N + kNR - 1) / kNR;
    for (int64_t c0 = 0; c0 < M; c0 += kChunk) {  // for_tiles' chunks and split, a tile's rows of x together
      const int64_t c1 = std::min(M, c0 + kChunk);
      at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
        std::vector<v16f> buf(2 * blocks * kNR);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n0 = t * kNR;
          const int nr = int(std::min<int64_t>(kNR, N - n0));
          dequant_tile<QT>(w + n0 * row_bytes, row_bytes, nr, blocks, buf.data());
          for (int64_t m0 = c0; m0 < c1; m0 += kMR)
            table[std::min<int64_t>(kMR, c1 - m0) - 1](x + m0 * K, K, buf.data(), nr, blocks,
                                                        bias ? bias + n0 : nullptr, y + m0 * N + n0, N);
        }
      });
    }
    return;
  }
  using Tile = void (*)(const float*, int64_t, const uint8_t*, int64_t, int, int64_t, const float*, float*, int64_t);
  static constexpr Tile table[4] = {tile<QT, 1>, tile<QT, kMR >= 2 ? 2 : 1>, tile<QT, kMR >= 3 ? 3 : 1>,
                                    tile<QT, kMR >= 4 ? 4 : 1>};
  for_tiles<kMR, kNR>(M, N, [&](int64_t m0, int r, int64_t n0, int nr) {
    table[r - 1](x + m0 * K, K, w + n0 * row_bytes, row_bytes, nr, blocks, bias ? bias + n0 : nullptr,
                 y + m0 * N + n0, N);
  });
}

#pragma GCC pop_options

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// The exact path on the packed layout (gemm_quant_int8.cpp describes it): per unit and weight t of the block, the 16
// rows' quants (a byte, or a nibble, of each lane's dword) dequantized to 16 fp32 weights, gguf's bit for bit (an FMA
// d * q + m: d * q is exact), then an FMA of x[t] into one of four chains a row of x (t mod 4) for all 16 outputs.
// Per output: the four chains over k, then (c0 + c1) + (c2 + c3), + bias.
template <int64_t QT, int R>
inline void tile_packed_f32(const float* x, int64_t ldx, const uint8_t* w, int nr, int64_t blocks, const float* bias,
                            float* y, int64_t ldy) {
  constexpr int64_t scales = QT == kGgmlQ4_1 ? 256 : 512;  // the unit's d (then Q4_1's m) after its quants
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(QT == kGgmlQ4_1 ? 0x0F : 0xFF);
  for (int64_t j = 0; j < blocks; ++j) {
    const uint8_t* unit = w + j * kUnitBytes<QT>;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + scales)));
    const __m512 mw = QT == kGgmlQ4_1
                          ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + scales + 32)))
                          : _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int t = 0; t < kBlock; ++t) {
      // Q4_1: weight t is the low (t < 16) or high nibble of byte t % 4 of dword (t % 16) / 4; Q8_0: byte t % 4 of
      // dword t / 4, less 128
      const int k = QT == kGgmlQ4_1 ? (t % 16) / 4 : t / 4;
      const int shift = 8 * (t % 4) + (QT == kGgmlQ4_1 ? 4 * (t / 16) : 0);
      __m512i q = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(unit + 64 * k), shift), mask);
      if constexpr (QT == kGgmlQ8_0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(128));
      const __m512 wt = QT == kGgmlQ4_1 ? _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), mw)
                                        : _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
      for (int m = 0; m < R; ++m)
        acc[m][t % 4] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + j * kBlock + t]), wt, acc[m][t % 4]);
    }
  }
  const __mmask16 keep = __mmask16((1u << nr) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int m = 0; m < R; ++m) {
    __m512 out = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    if (bias) out = _mm512_add_ps(out, b);
    _mm512_mask_storeu_ps(y + m * ldy, keep, out);
  }
}

template <int64_t QT>
void run_packed_f32(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  using Tile = void (*)(const float*, int64_t, const uint8_t*, int, int64_t, const float*, float*, int64_t);
  static constexpr Tile table[4] = {tile_packed_f32<QT, 1>, tile_packed_f32<QT, 2>, tile_packed_f32<QT, 3>,
                                    tile_packed_f32<QT, 4>};
  const int64_t blocks = K / kBlock, group_bytes = blocks * kUnitBytes<QT>;
  for_groups(M, N, [&](int64_t m0, int rows, int64_t g, int64_t n0, int nr) {
    table[rows - 1](x + m0 * K, K, w + g * group_bytes, nr, blocks, bias ? bias + n0 : nullptr, y + m0 * N + n0, N);
  });
}
#endif

// The fp32 path on the packed layout (a build with kPackedKernels; qtype Q8_0 or Q4_1).
void gemm_fp32_packed(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,
                      int64_t K, int64_t N) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  if (qtype == kGgmlQ8_0) return run_packed_f32<kGgmlQ8_0>(x, w, bias, y, M, K, N);
  return run_packed_f32<kGgmlQ4_1>(x, w, bias, y, M, K, N);
#else
  (void)qtype, (void)x, (void)w, (void)bias, (void)y, (void)M, (void)K, (void)N;
#endif
}

// The types gemm_q_linear runs, in gemm_q_types' order.
struct QType {
  int64_t id;
  const char* name;
  int64_t qk, bytes;  // weights and bytes a stored block
};
template <int64_t QT>
constexpr QType qtype_of(const char* name) {
  return {QT, name, kQK<QT>, kBlockBytes<QT>};
}
constexpr QType kQTypes[] = {qtype_of<kGgmlQ8_0>("Q8_0"), qtype_of<kGgmlQ4_1>("Q4_1"), qtype_of<kGgmlQ5_0>("Q5_0"),
                             qtype_of<kGgmlQ4_K>("Q4_K"), qtype_of<kGgmlQ6_K>("Q6_K")};

const QType& find_qtype(int64_t qtype) {
  for (const QType& t : kQTypes)
    if (t.id == qtype) return t;
  TORCH_CHECK(false, "gemm_q_linear: ggml type ", qtype,
              " is not supported; valid: 8 (Q8_0), 3 (Q4_1), 6 (Q5_0), 12 (Q4_K), 14 (Q6_K)");
}

void gemm_fp32(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K,
               int64_t N) {
  switch (qtype) {
    case kGgmlQ8_0: return run<kGgmlQ8_0>(x, w, bias, y, M, K, N);
    case kGgmlQ4_1: return run<kGgmlQ4_1>(x, w, bias, y, M, K, N);
    case kGgmlQ5_0: return run<kGgmlQ5_0>(x, w, bias, y, M, K, N);
    case kGgmlQ4_K: return run<kGgmlQ4_K>(x, w, bias, y, M, K, N);
    default: return run<kGgmlQ6_K>(x, w, bias, y, M, K, N);
  }
}

// x [..., K] float32 @ W^T (+ bias [N] float32) -> [..., N] float32, W [N, K / QK * block bytes] uint8 in
// ggml type `qtype`'s blocks; x quantized to int8 blocks (int8_x) or fp32 as it is.
at::Tensor gemm_q_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                         const c10::optional<at::Tensor>& bias, bool int8_x) {
  const QType& t = find_qtype(qtype);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemm_q_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "gemm_q_linear: the weight must be a contiguous 2-D uint8 tensor of blocks");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(K % t.qk == 0, "gemm_q_linear: x has ", K, " features; ", t.name, " weights take a multiple of ",
              t.qk);
  TORCH_CHECK(weight.size(1) == K / t.qk * t.bytes, "gemm_q_linear: x has ", K, " features; the weight's rows hold ",
              weight.size(1), " bytes, ", weight.size(1) / t.bytes * t.qk, " features of ", t.bytes,
              "-byte blocks of ", t.qk);
  const auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "gemm_q_linear: a float32 bias of ", N,
                " values, got ", bias->scalar_type(), " of ", bias->numel());
    b = bias->contiguous();
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const float* xp = xc.data_ptr<float>();
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    (int8_x ? gemm_int8 : gemm_fp32)(qtype, xp, wp, bp, yp, M, K, N);
  }
  return y.view(out_shape);
}

// x [..., K] float32 @ W^T (+ bias [N]) -> [..., N] float32, W [N, K] in the packed layout
// (gemm_quant_int8.cpp's tile_packed; quant.py's pack_rows): [ceil(N / 16), K / 32 * 16 * block bytes] uint8.
at::Tensor gemm_q_packed(const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                         const c10::optional<at::Tensor>& bias, int64_t N, bool int8_x) {
  const QType& t = find_qtype(qtype);
  TORCH_CHECK(kPackedKernels && (qtype == kGgmlQ8_0 || qtype == kGgmlQ4_1), "gemm_q_packed: no packed kernel for ",
              t.name, " in this build; valid: gemm_q_packed_types");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemm_q_packed: x must be float32, got ", x.scalar_type());
  const int64_t K = x.size(-1), groups = (N + 15) / 16;
  TORCH_CHECK(N > 0 && K % t.qk == 0, "gemm_q_packed: x has ", K, " features; ", t.name, " weights take a multiple of ",
              t.qk, " (and N > 0)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == groups && packed.size(1) == K / t.qk * 16 * t.bytes,
              "gemm_q_packed: ", N, " outputs of ", K, " features packed are a contiguous uint8 [", groups, ", ",
              K / t.qk * 16 * t.bytes, "]; got ", packed.scalar_type(), " ", packed.sizes());
  const auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "gemm_q_packed: a float32 bias of ", N,
                " values, got ", bias->scalar_type(), " of ", bias->numel());
    b = bias->contiguous();
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M > 0) {
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    (int8_x ? gemm_int8_packed : gemm_fp32_packed)(qtype, xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), bp,
                                                    y.data_ptr<float>(), M, K, N);
  }
  return y.view(out_shape);
}

// Rows of a weight in the packed layout back in the file's layout: packed [groups, B * 16 * block bytes] uint8 ->
// [len(rows), B * block bytes] (an embedding's lookup, and QuantWeight.data). Any build: plain byte moves.
at::Tensor packed_rows(const at::Tensor& packed, int64_t qtype, const at::Tensor& rows) {
  TORCH_CHECK(qtype == kGgmlQ8_0 || qtype == kGgmlQ4_1, "packed_rows: the packed layout is Q8_0's or Q4_1's");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed_rows: packed must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong, "packed_rows: rows must be int64");
  const int64_t bytes = qtype == kGgmlQ8_0 ? kBlockBytes<kGgmlQ8_0> : kBlockBytes<kGgmlQ4_1>;
  const int64_t head = qtype == kGgmlQ8_0 ? 2 : 4, unit = kGroupRows * bytes, blocks = packed.size(1) / unit;
  const uint8_t flip = qtype == kGgmlQ8_0 ? 0x80 : 0;  // Q8_0's quants are stored + 128
  const auto ids = rows.reshape({-1}).contiguous();
  const int64_t n = ids.numel(), limit = packed.size(0) * kGroupRows;
  auto out = at::empty({n, blocks * bytes}, packed.options());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < limit, "packed_rows: row ", ip[i], " is out of range");
    const int64_t lane = ip[i] % kGroupRows;
    const uint8_t* group = src + ip[i] / kGroupRows * packed.size(1);
    for (int64_t j = 0; j < blocks; ++j) {
      const uint8_t* u = group + j * unit;
      uint8_t* o = dst + (i * blocks + j) * bytes;
      for (int64_t s = 0; s < head; s += 2) std::memcpy(o + s, u + (bytes - head) * kGroupRows + 16 * s + 2 * lane, 2);
      for (int64_t k = 0; k < (bytes - head) / 4; ++k)
        for (int b = 0; b < 4; ++b) o[head + 4 * k + b] = u[64 * k + 4 * lane + b] ^ flip;
    }
  }
  return out;
}

// x [..., K] float32 -> [..., K / 32 * 34] uint8: its Q8_0 blocks as the int8 path quantizes it (and as
// gguf.quants.quantize would write them), for tests.
at::Tensor quantize_q8_0(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) % kBlock == 0,
              "quantize_q8_0: x must be float32 with a multiple of 32 features");
  const auto xc = x.contiguous();
  const int64_t blocks = xc.numel() / kBlock;
  auto out_shape = x.sizes().vec();
  out_shape.back() = x.size(-1) / kBlock * kBlockBytes<kGgmlQ8_0>;
  auto out = at::empty(out_shape, x.options().dtype(at::kByte));
  quantize_blocks_q8_0(xc.data_ptr<float>(), blocks, out.data_ptr<uint8_t>());
  return out;
}

}  // namespace

namespace tandem_quant {  // this file's entry points for the other sources of the module (decode_layers)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias,
                  int64_t n, bool packed, bool int8_x) {
  return packed ? gemm_q_packed(x, weight, qtype, bias, n, int8_x) : gemm_q_linear(x, weight, qtype, bias, int8_x);
}
}  // namespace tandem_quant

const tandem_ops::QuantOps tandem_ops::kQuant{
    &gemm_q_linear, &gemm_q_packed, &packed_rows, &quantize_q8_0,
    [] {
      std::vector<const char*> names;
      for (const QType& t : kQTypes) names.push_back(t.name);
      return names;
    }(),
    kPackedKernels};
