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
typedef float v4f __attribute__((vector_size(16)));

// ggml's blocks (the `gguf` package's layouts), 32 weights along K each:
//   Q8_0: 34 bytes: fp16 scale d, 32 int8 q;                                          w = d * q
//   Q4_1: 20 bytes: fp16 scale d, fp16 min m, 16 bytes of nibbles, weight j < 16 the low nibble of byte j and
//         weight 16 + j its high nibble;                                              w = d * q + m
constexpr int64_t kBlock = 32;
constexpr int64_t kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;  // ggml's type ids (gguf.GGMLQuantizationType)
template <int64_t QT>
constexpr int64_t kBlockBytes = QT == kGgmlQ8_0 ? 34 : 20;
constexpr int64_t kChunk = 64;  // rows of x a pass of the tiles

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

}  // namespace tandem_quant
