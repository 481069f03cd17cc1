// Linears for the CPU engine on AVX-512: y[M, N] = x[M, K] @ W^T (+ bias), with W packed once at load into
// column panels of 48 output columns, each panel contiguous and zero-padded past N: fp32 as [ceil(N / 48), K,
// 48]; bf16 (AVX512-BF16) as [ceil(N / 48), ceil(K / 2), 48, 2], the pairs (w[n, k], w[n, k + 1]) that one
// VDPBF16PS multiplies and adds into an fp32 lane.
//
// Why by hand: oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise, what vLLM's CPU build runs too) is
// slow at the row counts of decode. SmolLM2-135M's shapes on a 2-core AMD EPYC (Zen 4), each weight read
// once from DRAM as in a forward: at 1 row oneDNN streams the weight at 22-32 GB/s and this kernel at
// 34-52; at 16 rows 124-162 against 175-193 GFLOP/s; at 346 rows (prefill) 195-201 against 201-213. A
// simple register-blocked kernel suffices because a model's K (its hidden or intermediate size) is small:
// one panel's K x 48 weights sit in L2 while every 8-row block of x passes over it, so there is no K
// blocking and no packing of x.
//
// Micro-kernel: 8 rows x 48 columns of fp32 sums in 24 zmm registers; per k (bf16: per pair of k), three
// weight vectors and one broadcast x value (pair) per row, 24 FMAs (VDPBF16PS). fp32: each output is one fp32
// FMA chain over k in order, then + bias, as a plain dot product would; it differs from oneDNN's or MKL's
// order in rounding only (greedy equality with Hugging Face is what the real-model tests check). bf16: exact
// products summed in fp32 by pairs, + bias in fp32, rounded to bf16 once (nearest even), as oneDNN's bf16
// matmul does (in another order).
//
// gemm_silu_mul: a decoder MLP's gate/up linear with SiLU(gate) * up as the epilogue, each panel 24 gate columns
// and their 24 up columns, so the [M, 2 I] gate/up output is never stored and read back by a separate pass
// (cpu_fused.cpp's silu_mul, whose arithmetic the epilogue calls: the same bits). SmolLM2-135M, 2-core AMD
// EPYC, a 2004-token prefill step: bf16 1.23 -> 1.14-1.16 s, fp32 2.16-2.26 s either way; decode unchanged.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TANDEM_GEMM_SILU 1
namespace tandem_fused {  // engine/models/cpu_fused.cpp
template <typename T>
void silu_mul_rows(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t cols, T* out,
                   int64_t ldo, int64_t col0, int64_t width);
}
#endif

namespace {

constexpr int64_t kPanel = 48, kHalf = kPanel / 2;

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
                  int64_t ldy, int64_t cols) {
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
                  at::BFloat16* y, int64_t ldy, int64_t cols) {
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
// SILU: y[M, n] = SiLU(gate) * up, 24 columns of y a panel (store_silu).
template <bool SILU, typename T>
void run(const T* x, const T* w, int64_t panel_elems, const float* bias, T* y, int64_t M, int64_t K, int64_t n,
         int64_t panels) {
  using Micro = void (*)(const T*, int64_t, const T*, int64_t, const float*, T*, int64_t, int64_t);
  constexpr Micro table[9] = {nullptr,  micro<1, SILU>, micro<2, SILU>, micro<3, SILU>, micro<4, SILU>,
                              micro<5, SILU>, micro<6, SILU>, micro<7, SILU>, micro<8, SILU>};
  constexpr int64_t width = SILU ? kHalf : kPanel;  // columns of y a panel fills
  auto block = [&](int64_t p, int64_t m0) {  // rows [m0, m0 + 8) of panel p
    table[std::min<int64_t>(8, M - m0)](x + m0 * K, K, w + p * panel_elems, K, bias ? bias + p * kPanel : nullptr,
                                        y + m0 * n + p * width, n, std::min(width, n - p * width));
  };
  const int64_t threads = at::get_num_threads(), blocks = (M + 7) / 8;
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
        for (int64_t p = g; p < std::min(panels, g + group); ++p) block(p, 8 * b);
    }
  });
}
#endif

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
#if defined(__AVX512F__)
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
      TORCH_CHECK(false, name, ": bfloat16 needs AVX512-BF16 (see gemm_dtypes)");
#endif
    }
  }
  return y.view(out_shape);
#else
  TORCH_CHECK(false, name, " needs AVX-512 (gemm_dtypes is empty here)");
#endif
}

// x [..., K] @ the packed W^T (+ bias [N], float32 whatever the dtype: it is added to the fp32 sums) -> [..., N],
// in x's dtype (the pack's); `n` is W's row count (N).
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  return apply("gemm_linear", x, packed, bias, n, false);
}

// A gate/up linear and SiLU(gate) * up in one pass, nothing of the [..., 2 n] gate/up output stored: the pack
// holds, panel p, gate rows [24 p, 24 p + 24) then up rows [24 p, 24 p + 24) (zero rows past n; see
// engine/models/cpu_linear.py's GateUpPanels), and the bias (float32, or None) the same interleaved
// 48 * panels values. -> [..., n], bit for bit what silu_mul gives on gemm_linear's [gate, up] output.
at::Tensor gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
#ifdef TANDEM_GEMM_SILU
  return apply("gemm_silu_mul", x, packed, bias, n, true);
#else
  TORCH_CHECK(false, "gemm_silu_mul needs AVX-512 F/BW/VL (see gemm_silu)");
#endif
}

}  // namespace

void register_gemm(pybind11::module& m) {
  m.def("gemm_pack", &gemm_pack, "a weight [N, K] into gemm_linear's panels", pybind11::arg("weight"));
  m.def("gemm_linear", &gemm_linear, "x @ W^T (+ bias) with W packed by gemm_pack (CPU)", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemm_silu_mul", &gemm_silu_mul, "SiLU(x @ Wg^T) * (x @ Wu^T) with gate/up packed interleaved (CPU)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
#ifdef TANDEM_GEMM_SILU
  m.attr("gemm_silu") = true;
#else
  m.attr("gemm_silu") = false;
#endif
#if defined(TANDEM_GEMM_BF16)
  m.attr("gemm_dtypes") = pybind11::make_tuple("float32", "bfloat16");
#elif defined(__AVX512F__)
  m.attr("gemm_dtypes") = pybind11::make_tuple("float32");
#else
  m.attr("gemm_dtypes") = pybind11::make_tuple();
#endif
}
