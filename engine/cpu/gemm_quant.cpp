// Weight-only quantized linears for the CPU engine: y[M, N] = x[M, K] @ W^T (+ bias) with W in a GGUF file's
// own block layout, kept as it is in the file (engine/cpu/quant.py), so a model's linears read its quantized
// bytes and nothing else:
//   Q8_0: blocks of 32 weights along K, 34 bytes: fp16 scale d, 32 int8 q;           w = d * q
//   Q4_1: blocks of 32 weights along K, 20 bytes: fp16 scale d, fp16 min m, 16 bytes of nibbles, weight j < 16
//         the low nibble of byte j and weight 16 + j its high nibble;                 w = d * q + m
// Each row of W is K / 32 blocks, rows one after the other ([N, K / 32 * bytes] uint8).
//
// Dequantized in registers, block by block: a block's 32 weights become two vectors of 16 fp32 values (one
// zmm register under AVX-512, two ymm under AVX2, four xmm under SSE2: GCC vector extensions, one source for
// every level, compiled at each as the rest of engine/cpu/), used for MR rows of x at once, then dropped. d * q
// is exact in fp32 (d has 11 significant bits, q at most 8), so d * q (+ m, one rounding, whether contracted to
// an FMA or not) is bit for bit the fp32 weight the `gguf` package's dequantize gives (numpy: d * q + m in
// fp32): the result is the fp32 GEMM of those weights, summed in this kernel's order (per output, 16 lane-wise
// fp32 multiply-add chains over k, then a fixed tree over the lanes, + bias), within gamma_{K+1} of the exact
// sum relative to sum |x| |w| (tests/test_cpu_gemm_quant.py checks that bound against gguf's dequantize).
//
// Work: tiles of NR rows of W (NR blocks' dequantized weights in registers) by MR rows of x; x is taken 64 rows
// at a time (its chunk stays in L2 while every tile passes over it) and the tiles are split over the threads.
// Every output is the same chain of sums whatever M, the chunking or the thread count.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>  // every level: SSE2 at least (x86-64 is the only target with SIMD levels)

namespace {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")  // the sums' order is the one the top describes, at every level

typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4)));  // loads at any float's address

// 16 bytes as 16 fp32 values, unsigned (U) or signed. By intrinsics: GCC 12 turns __builtin_convertvector from
// bytes to floats into 16 scalar conversions at every level.
#if defined(__AVX512F__)
template <bool U>
inline v16f bytes_to_float(__m128i b) {
  return (v16f)_mm512_cvtepi32_ps(U ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
}
#elif defined(__AVX2__)
typedef float v8f __attribute__((vector_size(32)));
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
typedef float v4f __attribute__((vector_size(16)));
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
  typedef float v8f __attribute__((vector_size(32)));
  const v8f a = __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f c = __builtin_shufflevector(q2, q3, 0, 1, 2, 3, 4, 5, 6, 7);
  return __builtin_shufflevector(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

constexpr int64_t kBlock = 32;
constexpr int64_t kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;  // ggml's type ids (gguf.GGMLQuantizationType)

// Tile shapes by the registers a level has: MR x NR accumulators of 16 lanes plus 2 NR weight vectors.
#if defined(__AVX512F__)
constexpr int kMR = 4, kNR = 4;  // 16 + 8 zmm
#elif defined(__AVX__)
constexpr int kMR = 2, kNR = 2;  // (4 + 4) x 2 ymm
#else
constexpr int kMR = 1, kNR = 2;  // (2 + 4) x 4 xmm
#endif
constexpr int64_t kChunk = 64;  // rows of x a pass of the tiles

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

template <int64_t QT>
struct Format;

template <>
struct Format<kGgmlQ8_0> {
  static constexpr int64_t bytes = 34;
  static inline void dequant(const uint8_t* blk, v16f& w0, v16f& w1) {
    const v16f d = v16f{} + half_to_float(blk);
    w0 = bytes_to_float<false>(load16(blk + 2)) * d;
    w1 = bytes_to_float<false>(load16(blk + 18)) * d;
  }
};

template <>
struct Format<kGgmlQ4_1> {
  static constexpr int64_t bytes = 20;
  static inline void dequant(const uint8_t* blk, v16f& w0, v16f& w1) {
    const v16f d = v16f{} + half_to_float(blk), m = v16f{} + half_to_float(blk + 2);
    const __m128i qs = load16(blk + 4), low = _mm_set1_epi8(0x0F);
    w0 = bytes_to_float<true>(_mm_and_si128(qs, low)) * d + m;
    w1 = bytes_to_float<true>(_mm_and_si128(_mm_srli_epi16(qs, 4), low)) * d + m;
  }
};

inline float lanes_sum(const v16f& v) {  // a fixed tree: 8 pairs, 4, 2, 1
  float t[16];
  std::memcpy(t, &v, sizeof(t));
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// y[m, r] (+ bias[r]) for R rows of x (ldx apart) by NR rows of W at `w` (row_bytes apart; rows past `nr` repeat
// the last and are not stored).
template <int64_t QT, int R>
inline void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int nr, int64_t blocks,
                 const float* bias, float* y, int64_t ldy) {
  constexpr int64_t bytes = Format<QT>::bytes;
  const uint8_t* rows[kNR];
  for (int r = 0; r < kNR; ++r) rows[r] = w + std::min(r, nr - 1) * row_bytes;
  v16f acc[R][kNR] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    v16f w0[kNR], w1[kNR];
    for (int r = 0; r < kNR; ++r) Format<QT>::dequant(rows[r] + b * bytes, w0[r], w1[r]);
    for (int m = 0; m < R; ++m) {
      const v16f x0 = *reinterpret_cast<const v16f_u*>(x + m * ldx + b * kBlock);
      const v16f x1 = *reinterpret_cast<const v16f_u*>(x + m * ldx + b * kBlock + 16);
      for (int r = 0; r < kNR; ++r) {
        acc[m][r] += x0 * w0[r];
        acc[m][r] += x1 * w1[r];
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int r = 0; r < nr; ++r) y[m * ldy + r] = lanes_sum(acc[m][r]) + (bias ? bias[r] : 0.f);
}

template <int64_t QT>
void run(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  using Tile = void (*)(const float*, int64_t, const uint8_t*, int64_t, int, int64_t, const float*, float*, int64_t);
  static constexpr Tile table[4] = {tile<QT, 1>, tile<QT, kMR >= 2 ? 2 : 1>, tile<QT, kMR >= 3 ? 3 : 1>,
                                    tile<QT, kMR >= 4 ? 4 : 1>};
  const int64_t blocks = K / kBlock, row_bytes = blocks * Format<QT>::bytes, tiles = (N + kNR - 1) / kNR;
  for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - c0);
    // a few tiles a task: decode's single row still spreads a 576-row linear over every thread
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kNR;
        const int nr = int(std::min<int64_t>(kNR, N - n0));
        for (int64_t m0 = c0; m0 < c0 + rows; m0 += kMR) {
          const int r = int(std::min<int64_t>(kMR, c0 + rows - m0));
          table[r - 1](x + m0 * K, K, w + n0 * row_bytes, row_bytes, nr, blocks, bias ? bias + n0 : nullptr,
                       y + m0 * N + n0, N);
        }
      }
    });
  }
}

#pragma GCC pop_options

int64_t block_bytes(int64_t qtype) {
  TORCH_CHECK(qtype == kGgmlQ8_0 || qtype == kGgmlQ4_1, "gemm_q_linear: ggml type ", qtype,
              " is not supported; valid: 8 (Q8_0), 3 (Q4_1)");
  return qtype == kGgmlQ8_0 ? Format<kGgmlQ8_0>::bytes : Format<kGgmlQ4_1>::bytes;
}

// x [..., K] float32 @ W^T (+ bias [N] float32) -> [..., N] float32, W [N, K / 32 * block bytes] uint8 in
// ggml type `qtype`'s blocks.
at::Tensor gemm_q_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                         const c10::optional<at::Tensor>& bias) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemm_q_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "gemm_q_linear: the weight must be a contiguous 2-D uint8 tensor of blocks");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(K % kBlock == 0 && weight.size(1) == K / kBlock * bytes, "gemm_q_linear: x has ", K,
              " features; the weight's rows hold ", weight.size(1), " bytes, ", weight.size(1) / bytes * kBlock,
              " features of ", bytes, "-byte blocks of 32");
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
    if (qtype == kGgmlQ8_0)
      run<kGgmlQ8_0>(xc.data_ptr<float>(), weight.data_ptr<uint8_t>(), bp, y.data_ptr<float>(), M, K, N);
    else
      run<kGgmlQ4_1>(xc.data_ptr<float>(), weight.data_ptr<uint8_t>(), bp, y.data_ptr<float>(), M, K, N);
  }
  return y.view(out_shape);
}

}  // namespace

void register_gemm_quant(pybind11::module& m) {
  m.def("gemm_q_linear", &gemm_q_linear, "x @ W^T (+ bias) with W in GGUF Q8_0 / Q4_1 blocks (CPU)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("qtype"), pybind11::arg("bias"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("gemm_q_types") = pybind11::make_tuple("Q8_0", "Q4_1");
}
