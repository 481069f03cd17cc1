// What the CPU engine's quantized linears share (engine/cpu/gemm_quant.cpp: fp32 activations and the entry
// points; gemm_quant_int8.cpp: int8 activations): ggml's block formats, fp16 conversions, the fixed trees that sum
// a vector's lanes, and the walk over a GEMM's tiles. Compiled into both at each instruction-set level.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>  // every level: SSE2 at least (x86-64 is the only target with SIMD levels)

namespace tandem_quant {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")  // the sums' order is the one the kernels describe, at every level

typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4)));  // loads at any float's address
typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef float v4f __attribute__((vector_size(16)));

// ggml's blocks (the `gguf` package's layouts, as gguf.quants' dequantize_blocks reads them). A row of a weight is
// K / QK of them, QK = 32 weights along K, or 256 for the K-quants' super-blocks (8 sub-blocks of 32):
//   Q8_0:  34 bytes: fp16 scale d, 32 int8 q;                                         w = d * q
//   Q4_1:  20 bytes: fp16 scale d, fp16 min m, 16 bytes of nibbles, weight j < 16 the low nibble of byte j and
//          weight 16 + j its high nibble;                                             w = d * q + m
//   Q5_0:  22 bytes: fp16 d, uint32 qh, 16 bytes qs: q (5 bits) = Q4_1's nibble of weight j | bit j of qh << 4;
//                                                                                      w = d * (q - 16)
//   Q4_K: 144 bytes a super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_j and mins m_j (q4k_scale_min),
//          128 bytes qs: sub-block 2c the low nibbles of qs[32c, 32c + 32), 2c + 1 their high nibbles;
//                                                                                      w = (d * sc_j) * q - dmin * m_j
//   Q6_K: 210 bytes a super-block: ql[128], qh[64], int8 scales sc[16], fp16 d; weight t = 128 h + i (i < 128):
//          q (6 bits) = the nibble of ql[64 h + i % 64] (low for i < 64, high above) | bits 2 (i / 32), 2 (i / 32) + 1
//          of qh[32 h + i % 32] << 4;                                                 w = (d * sc[t / 16]) * (q - 32)
// Every product above is exact in fp32 (d: 11 significant bits, d * sc at most 17 (Q4_K) or 18 (Q6_K), q at most
// 8), so each weight is one rounding (Q4_1's and Q4_K's min) or none away from exact.
constexpr int64_t kBlock = 32;  // weights a block along K; a K-quant's sub-block; x's blocks on the int8 path
constexpr int64_t kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ8_0 = 8, kGgmlQ4_K = 12, kGgmlQ6_K = 14;  // ggml's type ids
template <int64_t QT>
constexpr bool kKQuant = QT == kGgmlQ4_K || QT == kGgmlQ6_K;
template <int64_t QT>
constexpr int64_t kQK = kKQuant<QT> ? 256 : kBlock;  // weights a stored block (ggml's QK)
template <int64_t QT>
constexpr int64_t kBlockBytes = QT == kGgmlQ8_0   ? 34
                                : QT == kGgmlQ4_1 ? 20
                                : QT == kGgmlQ5_0 ? 22
                                : QT == kGgmlQ4_K ? 144
                                                  : 210;  // bytes of a stored block
constexpr int64_t kChunk = 64;  // rows of x a pass of the tiles

// A decode step streams a model's weights from DRAM, each once: the tiles ask for the lines kPrefetch bytes ahead
// of each group of blocks they read, one every 64 bytes of it (a row's later blocks, or the next tiles' rows).
// Measured on Zen 4 at one row of x: up to 2x faster (Q6_K; 2.7x on the fp32 path) where the hardware prefetchers
// fall behind.
constexpr int64_t kPrefetch = 4096;
template <int64_t Bytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t o = 0; o < Bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + o, _MM_HINT_T0);
}

inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

inline float half_value(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_value(h);
}
inline uint16_t half_bits(float f) {  // round to nearest even, as numpy's astype(float16)
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  return c10::detail::fp16_ieee_from_fp32_value(f);
#endif
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Q4_K's scale and min of sub-block j from its super-block's 12 bytes `s` (gguf's Q4_K.get_scale_min): 6 bits
// each, j < 4 in the low bits of s[j] and s[j + 4], j >= 4 split over s[j + 4]'s nibbles and the top 2 bits of
// s[j - 4] and s[j].
inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All 8 of Q4_K's scales and mins from a super-block's 12 bytes `s`: bytes 0-7 sc_0..7, 8-15 m_0..7 (llama.cpp's
// unpacking, word by word).
inline __m128i q4k_scales_mins(const uint8_t* s) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
  return _mm_setr_epi32(int(a & six), int((c & four) | (((a >> 6) & two) << 4)), int(b & six),
                        int(((c >> 4) & four) | (((b >> 6) & two) << 4)));
}

// The low 16 bits of `bits` as 16 bytes, 0x10 where the bit is set (Q5_0's fifth bits, in place).
inline __m128i bit4_bytes16(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm_maskz_mov_epi8(__mmask16(bits), _mm_set1_epi8(0x10));
#else
#if defined(__SSSE3__)  // byte i takes bits' byte i / 8 ...
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(int(bits)), _mm_set_epi64x(0x0101010101010101, 0));
#else  // (SSE2: by unpacking it with itself, 2, 4, then 8 copies of each byte)
  __m128i spread = _mm_cvtsi32_si128(int(bits));
  spread = _mm_unpacklo_epi8(spread, spread);
  spread = _mm_unpacklo_epi16(spread, spread);
  spread = _mm_unpacklo_epi32(spread, spread);
#endif
  // ... then its bit i % 8 is tested
  const __m128i bit = _mm_set1_epi64x(int64_t(0x8040201008040201));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(0x10));
#endif
}

inline float lanes_sum(const v16f& v) {  // a fixed tree: 8 pairs, 4, 2, 1
  float t[16];
  std::memcpy(t, &v, sizeof(t));
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}
inline float lanes_sum(const v8f& v) {  // 4 pairs, 2, 1
  float t[8];
  std::memcpy(t, &v, sizeof(t));
  for (int w = 4; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// Every MR x NR tile of y[M, N]: `tile(m0, rows, n0, cols)`, x kChunk rows at a time, a chunk's tiles split
// over the threads, a few a task: decode's single row still spreads a 576-row linear over every thread.
template <int MR, int NR, typename Tile>
void for_tiles(int64_t M, int64_t N, const Tile& tile) {
  const int64_t tiles = (N + NR - 1) / NR;
  for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
    const int64_t c1 = std::min(M, c0 + kChunk);
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t m0 = c0; m0 < c1; m0 += MR)
          tile(m0, int(std::min<int64_t>(MR, c1 - m0)), t * NR, int(std::min<int64_t>(NR, N - t * NR)));
    });
  }
}

#pragma GCC pop_options

// gemm_quant_int8.cpp: y[M, N] = x[M, K] @ W^T (+ bias) with x quantized to int8 blocks, and that quantization
// alone (x's `blocks` blocks into Q8_0 blocks, the `gguf` package's bytes).
void gemm_int8(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K,
               int64_t N);
void quantize_blocks_q8_0(const float* x, int64_t blocks, uint8_t* out);
// The same product with W in the packed layout (gemm_quant_int8.cpp; quant.py's pack_rows): [ceil(N / 16), K / 32 *
// 16 * block bytes] uint8, qtype Q8_0 or Q4_1, in a build with kPackedKernels (a no-op elsewhere).
void gemm_int8_packed(int64_t qtype, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,
                      int64_t K, int64_t N);
// The packed layout: 16 weight rows a group, a group's block j of all 16 rows together (a unit).
constexpr int kGroupRows = 16;
template <int64_t QT>
constexpr int64_t kUnitBytes = kGroupRows * kBlockBytes<QT>;  // 320 (Q4_1) or 544 (Q8_0)

// Every group of the packed layout by up to 4 rows of x: `tile(m0, rows, g, n0, nr)` (group g's first output n0,
// its nr <= 16 outputs), x kChunk rows at a time, a chunk's groups split over the threads.
template <typename Tile>
void for_groups(int64_t M, int64_t N, const Tile& tile) {
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
    const int64_t c1 = std::min(M, c0 + kChunk);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * kGroupRows;
        for (int64_t m0 = c0; m0 < c1; m0 += 4)
          tile(m0, int(std::min<int64_t>(4, c1 - m0)), g, n0, int(std::min<int64_t>(kGroupRows, N - n0)));
      }
    });
  }
}
// Whether this build has the packed kernels, for Q8_0 and Q4_1: with AVX-512 VNNI, not elsewhere.
constexpr bool kPackedKernels =
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    true;
#else
    false;
#endif

}  // namespace tandem_quant
