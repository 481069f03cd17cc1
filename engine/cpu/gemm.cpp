// Linears for the CPU engine: y[M, N] = x[M, K] @ W^T (+ bias), with W packed once at load into column panels of
// 48 output columns, each panel contiguous and zero-padded past N: fp32 as [ceil(N / 48), K, 48]; bf16 as
// [ceil(N / 48), ceil(K / 2), 48, 2], the pairs (w[n, k], w[n, k + 1]) that one VDPBF16PS multiplies and adds
// into an fp32 lane (the portable path widens the same pairs). One layout at every instruction-set level.
//
// Why by hand: oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise, what vLLM's CPU build runs too) is
// slow at the row counts of decode, and below AVX-512 it has no bf16 matmul at all (its bf16 path needs
// AVX512-BW or AVX-NE-CONVERT). A simple register-blocked kernel suffices because a model's K (its hidden or
// intermediate size) is small: one panel's K x 48 weights sit in L2 while every 8-row block of x passes over
// it, so there is no K blocking and no packing of x. bench/bench_cpu_gemm_isa.py measures it against oneDNN and
// F.linear at a level.
//
// AVX-512 (the "avx512" build; intrinsics): 8 rows x 48 columns of fp32 sums in 24 zmm registers; per k (bf16:
// per pair of k), three weight vectors and one broadcast x value (pair) per row, 24 FMAs (VDPBF16PS, where the
// CPU has AVX512-BF16; without it this build is fp32 only).
// Portable (the "avx2" and "default" builds; GCC vector extensions, so one source is AVX2 + FMA under
// x86-64-v3 and SSE2 under x86-64): a block of up to 8 rows by one panel is computed as half panels of 24
// columns, a few rows a pass (4 fp32 / 3 bf16 rows on AVX2: 12 or 9 ymm sums; 2 / 1 on SSE2), the sums going
// to an L1 buffer for the epilogue; bf16 weight pairs are widened to fp32 in registers (a bf16's bits are the
// top half of its fp32) and x's rows once a call.
//
// Arithmetic, both paths: fp32: each output is one fp32 multiply-add chain over k in order, then + bias, as a
// plain dot product would; it differs from oneDNN's or MKL's order in rounding only (greedy equality with
// Hugging Face is what the real-model tests check). bf16: exact products summed in fp32 (AVX-512: by pairs;
// portable: k in order), + bias in fp32, rounded to bf16 once (nearest even, as c10::BFloat16; oneDNN's bf16
// matmul does the same in another order).
//
// gemm_silu_mul: a decoder MLP's gate/up linear with SiLU(gate) * up as the epilogue, each panel 24 gate columns
// and their 24 up columns, so the [M, 2 I] gate/up output is never stored and read back by a separate pass
// (fused.cpp's silu_mul, whose arithmetic the epilogue calls, including which columns PyTorch's SiLU takes
// as a scalar tail at the avx2 and default levels: the same bits).

#include <ATen/Parallel.h>
#include "ops.h"

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// gemm_silu_mul: AVX-512 F/BW/VL (the epilogue's masked vectors), or the portable path.
#if !defined(__AVX512F__) || (defined(__AVX512BW__) && defined(__AVX512VL__))
#define TANDEM_GEMM_SILU 1
#endif
namespace tandem_fused {  // engine/cpu/fused.cpp, every level
template <typename T>
void silu_mul_rows(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t cols, T* out,
                   int64_t ldo, int64_t col0, int64_t width);
}

namespace {

constexpr int64_t kPanel = 48, kHalf = kPanel / 2, kRows = 8;  // kRows: rows of x a micro-kernel call

#if defined(__AVX512F__)
// The 48 sums of one row (three vectors) + bias, stored in the first `cols` columns.
inline __mmask16 cols_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
inline void store_row(const __m512* acc, const float* bias, float* y, int64_t cols) {
  for (int c = 0; c < 3 && 16 * c < cols; ++c) {
    const __mmask16 mask = cols_mask(cols - 16 * c);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * c) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y + 16 * c, mask, _mm512_add_ps(acc[c], b));
  }
}

// SILU (gemm_silu_mul): each panel holds 24 gate columns then the 24 matching up columns; the 8 x 48 sums
// (+ bias) go through an L1 buffer to SiLU(gate) * up, 24 outputs a row, `cols` of them kept.
template <int MR, typename T>
inline void store_silu(const __m512 (&acc)[MR][3], const float* bias, T* y, int64_t ldy, int64_t cols) {
#ifdef TANDEM_GEMM_SILU
  alignas(64) float sums[MR][kPanel];
  for (int m = 0; m < MR; ++m) store_row(acc[m], bias, sums[m], kPanel);
  tandem_fused::silu_mul_rows<T>(sums[0], sums[0] + kHalf, kPanel, MR, cols, y, ldy, 0, 0);
#endif
}

template <int MR, bool SILU>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                  int64_t ldy, int64_t cols, int64_t /* col0: the AVX-512 SiLU has no scalar tail */) {
  __m512 acc[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 3; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kPanel;
    const __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16), w2 = _mm512_load_ps(wk + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(b, w2, acc[m][2]);
    }
  }
  if constexpr (SILU) store_silu<MR>(acc, bias, y, ldy, cols);
  else
    for (int m = 0; m < MR; ++m) store_row(acc[m], bias, y + m * ldy, cols);
}

#if defined(__AVX512BF16__)
#define TANDEM_GEMM_BF16 1
template <int MR, bool SILU>
inline void micro(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t K, const float* bias,
                  at::BFloat16* y, int64_t ldy, int64_t cols, int64_t /* col0 */) {
  __m512 acc[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 3; ++c) acc[m][c] = _mm512_setzero_ps();
  auto step = [&](const at::BFloat16* wk, auto&& pair_of_row) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(wk), w1 = (__m512bh)_mm512_load_si512(wk + 32),
                   w2 = (__m512bh)_mm512_load_si512(wk + 64);
    for (int m = 0; m < MR; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair_of_row(m));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], b, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], b, w2);
    }
  };
  const int64_t pairs = K / 2;
  for (int64_t k2 = 0; k2 < pairs; ++k2)
    step(w + k2 * 2 * kPanel, [&](int m) {
      int32_t pair;  // (x[m, 2 k2], x[m, 2 k2 + 1]); 16-bit aligned only when K is odd
      std::memcpy(&pair, x + m * ldx + 2 * k2, sizeof(pair));
      return pair;
    });
  if (K % 2)  // the last k alone: its partner is a zero weight in the pack and a zero here (nothing past x's row)
    step(w + pairs * 2 * kPanel, [&](int m) {
      uint16_t last;
      std::memcpy(&last, x + m * ldx + K - 1, sizeof(last));
      return int32_t(last);
    });
  if constexpr (SILU) {
    store_silu<MR>(acc, bias, y, ldy, cols);
    return;
  }
  for (int m = 0; m < MR; ++m) {
    float sums[kPanel];
    store_row(acc[m], bias, sums, cols);
    for (int c = 0; c < 3 && 16 * c < cols; ++c) {
      const __mmask16 mask = cols_mask(cols - 16 * c);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, sums + 16 * c));
      _mm256_mask_storeu_epi16(y + m * ldy + 16 * c, mask, h);
    }
  }
}
#endif
#endif  // __AVX512F__

#if !defined(__AVX512F__)
// The portable path (avx2 and default levels): GCC vectors of the widest registers the build has, 8 floats in a
// ymm register under x86-64-v3 (a * b + c contracted to one FMA), 4 in an xmm one under x86-64 (SSE2: a
// multiply and an add). Compiled without the extension's -fassociative-math: with it GCC regroups a sum's chain
// (bf16: acc + (even + odd products)), out of k order and slower (the regrouped sums spill).
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
#define TANDEM_GEMM_BF16 1
using tandem_simd::kLanes;
using tandem_simd::vf;
using tandem_simd::vu;
typedef float vf_u __attribute__((vector_size(4 * kLanes), aligned(4)));  // loads and stores at any float's address
typedef uint32_t vu_u __attribute__((vector_size(4 * kLanes), aligned(4)));
constexpr int kVecs = kHalf / kLanes;  // vectors a row of 24 columns

// Rows a pass, T the weights' type. AVX: fp32 4 rows, 4 x 3 sums + 3 weights + 1 broadcast = 16 ymm registers;
// bf16 3 rows, as its widening needs a register more (with 4 rows GCC spills sums). SSE2: 6 vectors a row.
#if defined(__AVX__)
template <typename T>
constexpr int kMR = std::is_same<T, float>::value ? 4 : 3;
#else
template <typename T>
constexpr int kMR = std::is_same<T, float>::value ? 2 : 1;
#endif

using tandem_simd::widen;

template <int R, int V>
inline void store_sums(const vf (&acc)[R][V], float* sums) {
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < V; ++c) *reinterpret_cast<vf_u*>(sums + m * kPanel + kLanes * c) = acc[m][c];
}

// sums[m * kPanel + c] = sum over k in order of x[m, k] * w(k, c), R rows by the V vectors of columns c at w
// (V = kVecs: a half panel, 24 columns; 2 kVecs: the whole panel). fp32: w(k, c) = w[k * kPanel + c], one
// multiply-add chain a sum.
template <int R, int V = kVecs>
inline void sums24(const float* x, int64_t ldx, const float* w, int64_t K, float* sums) {
  vf acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    const vf_u* wk = reinterpret_cast<const vf_u*>(w + k * kPanel);
    vf wv[V];
    for (int c = 0; c < V; ++c) wv[c] = wk[c];
    for (int m = 0; m < R; ++m) {
      const float b = x[m * ldx + k];
      for (int c = 0; c < V; ++c) acc[m][c] += b * wv[c];
    }
  }
  store_sums<R, V>(acc, sums);
}

// bf16: the pack's pairs (w(2 k2, c), w(2 k2 + 1, c)) as one 32-bit word at w[(k2 * kPanel + c) * 2], widened
// to fp32 in registers (even k: the low half shifted up; odd k: the high half) and multiply-added in fp32, k in
// order, with x already widened to fp32 (micro); a last odd k alone (its partner in the pack is zero).
template <int R, int V = kVecs>
inline void sums24(const float* x, int64_t ldx, const at::BFloat16* w, int64_t K, float* sums) {
  vf acc[R][V] = {};
  vf wv[V];
  auto madd = [&](int64_t k) {  // acc += x[:, k] * wv
    for (int m = 0; m < R; ++m) {
      const float b = x[m * ldx + k];
      for (int c = 0; c < V; ++c) acc[m][c] += b * wv[c];
    }
  };
  const int64_t pairs = K / 2;
  for (int64_t k2 = 0; k2 < pairs; ++k2) {
    const vu_u* wk = reinterpret_cast<const vu_u*>(w + k2 * 2 * kPanel);
    for (int c = 0; c < V; ++c) wv[c] = (vf)(wk[c] << 16);
    madd(2 * k2);
    for (int c = 0; c < V; ++c) wv[c] = (vf)(wk[c] & 0xFFFF0000u);
    madd(2 * k2 + 1);
  }
  if (K % 2) {
    const vu_u* wk = reinterpret_cast<const vu_u*>(w + pairs * 2 * kPanel);
    for (int c = 0; c < V; ++c) wv[c] = (vf)(wk[c] << 16);
    madd(K - 1);
  }
  store_sums<R, V>(acc, sums);
}

// R rows in passes of at most kMR rows (the weights of a half panel are read from L2 once a pass), as even as
// they go: a pass of R rows keeps R * kVecs sums in flight, one FMA chain each, and a pass of too few chains waits
// on the FMA's latency (Zen 3: 4 cycles, 2 a cycle, so 8 chains to keep it busy). 5 rows as 4 + 1 ran its
// second pass on 3 chains; as 3 + 2 it runs 9 and 6.
template <int R, typename T>
inline void rows_sums(const float* x, int64_t ldx, const T* w, int64_t K, float* sums) {
  constexpr int mr = kMR<T>;
  constexpr int passes = (R + mr - 1) / mr, first = (R + passes - 1) / passes;
  if constexpr (passes > 1) {
    sums24<first>(x, ldx, w, K, sums);
    rows_sums<R - first, T>(x + first * ldx, ldx, w, K, sums + first * kPanel);
  } else {
    sums24<R>(x, ldx, w, K, sums);
  }
}

// Rows taken over the whole panel (2 kVecs vectors a row) in one pass before the rest go by half panels: one row
// (decode; 2 kVecs chains), and with 8-float vectors the first two fp32 rows of any larger block (12 chains in 12
// of the 16 ymm registers). Two rows by half panels were two passes of 6 chains, each waiting on the FMA's
// latency (bench/README.md, "GEMM at a few rows", has the before and after). A row's sums are the same
// chains over k in order whichever pass computes them (tests/test_cpu_gemm.py checks the bits). bf16 widens its
// weights in registers and has none to spare.
template <int ROWS, typename T>
constexpr int kWhole = ROWS == 1 ? 1 : (std::is_same<T, float>::value && kLanes == 8) ? 2 : 0;

// fp32 -> bf16 by c10::BFloat16's rule: round to nearest even, NaN -> 0x7FC0.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(r);
}
inline void store_row(const float* s, float* y, int64_t cols) { std::memcpy(y, s, cols * sizeof(float)); }
inline void store_row(const float* s, at::BFloat16* y, int64_t cols) {
  uint16_t* out = reinterpret_cast<uint16_t*>(y);
  for (int64_t c = 0; c < cols; ++c) out[c] = bf16_bits(s[c]);
}

// ROWS rows of x by one panel: the 48 sums a row (the second 24 only where kept) into an L1 buffer, + bias,
// then stored (in T: bf16 rounded once) or, SILU, turned into 24 SiLU(gate) * up a row by fused.cpp's
// arithmetic, as columns [col0, col0 + cols) of rows ldy wide (where PyTorch's SiLU takes its scalar tail).
template <int ROWS, bool SILU, typename T>
void micro(const T* x, int64_t ldx, const T* w, int64_t K, const float* bias, T* y, int64_t ldy, int64_t cols,
           int64_t col0) {
  alignas(64) float sums[ROWS][kPanel];
  constexpr int64_t pair = sizeof(T) == 2 ? 2 : 1;  // values a pack column holds per k (row of the pack)
  const int64_t kept = SILU ? kPanel : cols;         // sums needed a row
  const float* xf = nullptr;                          // x in fp32
  int64_t ldf = ldx;
  if constexpr (std::is_same<T, float>::value) {
    xf = x;
  } else {  // bf16 rows widened once a call (not once per k and weight vector)
    static thread_local std::vector<float> wide;
    if (int64_t(wide.size()) < ROWS * K) wide.resize(ROWS * K);
    for (int m = 0; m < ROWS; ++m)
      for (int64_t k = 0; k < K; ++k) wide[m * K + k] = widen(x[m * ldx + k]);
    xf = wide.data(), ldf = K;
  }
  constexpr int whole = kWhole<ROWS, T>;
  bool halves = true;
  if constexpr (whole > 0) {
    if (kept > kHalf) {  // `whole` rows over the whole panel in one pass, the rest by half panels
      sums24<whole, 2 * kVecs>(xf, ldf, w, K, sums[0]);
      if constexpr (ROWS > whole)
        for (int64_t h = 0; h * kHalf < kept; ++h)
          rows_sums<ROWS - whole, T>(xf + whole * ldf, ldf, w + h * kHalf * pair, K, sums[whole] + h * kHalf);
      halves = false;
    }
  }
  if (halves)
    for (int64_t h = 0; h * kHalf < kept; ++h)
      rows_sums<ROWS, T>(xf, ldf, w + h * kHalf * pair, K, sums[0] + h * kHalf);
  if (bias)
    for (int m = 0; m < ROWS; ++m)
      for (int64_t c = 0; c < kept; ++c) sums[m][c] += bias[c];
  if constexpr (SILU) {
    tandem_fused::silu_mul_rows<T>(sums[0], sums[0] + kHalf, kPanel, ROWS, cols, y, ldy, col0, ldy);
  } else {
    for (int m = 0; m < ROWS; ++m) store_row(sums[m], y + m * ldy, cols);
  }
}
#pragma GCC pop_options
#endif  // !__AVX512F__

// y = x @ W^T (+ bias) over the packed panels, `panel_elems` elements apart. The work is split into items of
// a group of panels (~512 KB together, so they stay in L2) by a run of 8-row blocks of x, handed out from a
// shared counter group by group: the threads pass over one group together, and a thread that loses its core
// for a while (to another process: on a small host Ray's own processes wake every few ms) leaves its share
// to the others instead of making them wait for it at the end: with a static split, every such stall cost
// every thread. Items are ~16 micro-kernel calls (tens to hundreds of microseconds), or single panels when x
// has few rows (decode), so there are several per thread. SmolLM2-135M, 2-core AMD EPYC, a 2,040-token
// prefill step beside 5 processes that wake 100 times a second (as Ray's do): fp32 2.29 -> 2.25 s, bf16
// 1.26 -> 1.17 s (medians of 3 and 2 alternated runs; without them, no change beyond noise). Every output is
// the same chain of sums however the work is split.
// SILU: y[M, n] = SiLU(gate) * up, 24 columns of y a panel. Both paths' micro-kernels take (up to) 8 rows.
template <bool SILU, typename T>
void run(const T* x, const T* w, int64_t panel_elems, const float* bias, T* y, int64_t M, int64_t K, int64_t n,
         int64_t panels) {
  using Micro = void (*)(const T*, int64_t, const T*, int64_t, const float*, T*, int64_t, int64_t, int64_t);
  constexpr Micro table[kRows + 1] = {nullptr,        micro<1, SILU>, micro<2, SILU>, micro<3, SILU>, micro<4, SILU>,
                                      micro<5, SILU>, micro<6, SILU>, micro<7, SILU>, micro<8, SILU>};
  constexpr int64_t width = SILU ? kHalf : kPanel;  // columns of y a panel fills
  auto block = [&](int64_t p, int64_t m0) {  // rows [m0, m0 + 8) of panel p
    table[std::min<int64_t>(kRows, M - m0)](x + m0 * K, K, w + p * panel_elems, K,
                                            bias ? bias + p * kPanel : nullptr, y + m0 * n + p * width, n,
                                            std::min(width, n - p * width), p * width);
  };
  const int64_t threads = at::get_num_threads(), blocks = (M + kRows - 1) / kRows;
  const int64_t in_l2 = std::max<int64_t>(1, (512 << 10) / (panel_elems * int64_t(sizeof(T))));
  const int64_t group = std::max<int64_t>(1, std::min(in_l2, panels / (4 * threads)));  // panels an item
  const int64_t groups = (panels + group - 1) / group;
  const int64_t per = std::clamp<int64_t>(std::min(16 / group, groups * blocks / (4 * threads)), 1, blocks);
  const int64_t runs = (blocks + per - 1) / per, items = groups * runs;  // runs of `per` 8-row blocks
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {  // each thread: items till none left
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t g = i / runs * group, b0 = i % runs * per;
      for (int64_t b = b0; b < std::min(blocks, b0 + per); ++b)
        for (int64_t p = g; p < std::min(panels, g + group); ++p) block(p, kRows * b);
    }
  });
}

// w [N, K] -> its panels (see the top), zero past N (and past K for bf16's last pair): element (n, k) of panel
// n / 48 at [k / PAIR][n % 48][k % PAIR].
template <typename T, int64_t PAIR>
at::Tensor pack_panels(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel, rows = (K + PAIR - 1) / PAIR;
  auto out = PAIR == 1 ? at::zeros({panels, K, kPanel}, w.options())
                       : at::zeros({panels, rows, kPanel, PAIR}, w.options());
  const T* src = w.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k)
          dst[((p * rows + k / PAIR) * kPanel + j) * PAIR + k % PAIR] = src[(p * kPanel + j) * K + k];
  });
  return out;
}

at::Tensor gemm_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "gemm_pack: a 2-D weight");
  const auto w = weight.contiguous();
  if (w.scalar_type() == at::kFloat) return pack_panels<float, 1>(w);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemm_pack: float32 or bfloat16, got ", w.scalar_type());
  return pack_panels<at::BFloat16, 2>(w);
}

// gemm_linear, or with `silu` gemm_silu_mul: y [M, n] in x's dtype (the pack's), `width` columns of y a panel.
at::Tensor apply(const char* name, const at::Tensor& x, const at::Tensor& packed,
                 const c10::optional<at::Tensor>& bias, int64_t n, bool silu) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.is_contiguous() && packed.size(-1) == (bf16 ? 2 : kPanel) && packed.dim() == (bf16 ? 4 : 3),
              name, ": not a gemm_pack result");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), name, ": x is ", x.scalar_type(), ", the weight ",
              packed.scalar_type());
  const int64_t panels = packed.size(0), K = x.size(-1), width = silu ? kHalf : kPanel;
  TORCH_CHECK(bf16 ? (K + 1) / 2 == packed.size(1) : K == packed.size(1), name, ": x has ", K,
              " features, the weight ", bf16 ? 2 * packed.size(1) - 1 : packed.size(1),
              bf16 ? " or one more" : "");
  TORCH_CHECK(n > (panels - 1) * width && n <= panels * width, name, ": n does not match the pack");
  const auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0), nb = silu ? panels * kPanel : n;  // bias values: silu's follow the panels
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto y = at::empty({M, n}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == nb, name, ": a float32 bias of ", nb,
                " values, got ", bias->scalar_type(), " of ", bias->numel());
    b = bias->contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (M > 0 && n > 0) {
    auto go = [&](auto* xp, auto* wp, int64_t panel_elems, auto* yp) {
      if (silu) run<true>(xp, wp, panel_elems, bp, yp, M, K, n, panels);
      else run<false>(xp, wp, panel_elems, bp, yp, M, K, n, panels);
    };
    if (!bf16) {
      go(xc.data_ptr<float>(), packed.data_ptr<float>(), K * kPanel, y.data_ptr<float>());
    } else {
#ifdef TANDEM_GEMM_BF16
      go(xc.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), packed.size(1) * 2 * kPanel,
         y.data_ptr<at::BFloat16>());
#else
      TORCH_CHECK(false, name, ": bfloat16 on an AVX-512 build needs AVX512-BF16 (see gemm_dtypes)");
#endif
    }
  }
  return y.view(out_shape);
}

// x [..., K] @ the packed W^T (+ bias [N], float32 whatever the dtype: it is added to the fp32 sums) -> [..., N],
// in x's dtype (the pack's); `n` is W's row count (N).
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  return apply("gemm_linear", x, packed, bias, n, false);
}

// A gate/up linear and SiLU(gate) * up in one pass, nothing of the [..., 2 n] gate/up output stored: the pack
// holds, panel p, gate rows [24 p, 24 p + 24) then up rows [24 p, 24 p + 24) (zero rows past n; see
// engine/cpu/linear.py's GateUpPanels), and the bias (float32, or None) the same interleaved
// 48 * panels values. -> [..., n], bit for bit what silu_mul gives on gemm_linear's [gate, up] output.
at::Tensor gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
#ifdef TANDEM_GEMM_SILU
  return apply("gemm_silu_mul", x, packed, bias, n, true);
#else
  TORCH_CHECK(false, "gemm_silu_mul on an AVX-512 build needs AVX-512 BW/VL (see gemm_silu)");
#endif
}

}  // namespace

namespace tandem_gemm {  // gemm.cpp's entry points for the other sources of the module (decode_layers)
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n) {
  return gemm_linear(x, packed, bias, n);
}
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  return gemm_silu_mul(x, packed, bias, n);
}
}  // namespace tandem_gemm

#ifdef TANDEM_GEMM_SILU
constexpr bool kSilu = true;
#else
constexpr bool kSilu = false;
#endif
#ifdef TANDEM_GEMM_BF16
constexpr bool kBf16 = true;
#else  // AVX-512 without AVX512-BF16
constexpr bool kBf16 = false;
#endif
const tandem_ops::GemmOps tandem_ops::kGemm{&gemm_pack, &gemm_linear, &gemm_silu_mul, kSilu, kBf16};
