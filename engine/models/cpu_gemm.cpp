// fp32 linears for the CPU engine on AVX-512: y[M, N] = x[M, K] @ W^T (+ bias), with W packed once at load
// into column panels of 48: [ceil(N / 48), K, 48], each panel's K rows of 48 consecutive output columns
// contiguous (zero-padded past N).
//
// Why by hand: oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise, what vLLM's CPU build runs too) is
// slow at the row counts of decode. SmolLM2-135M's shapes on a 2-core AMD EPYC (Zen 4), each weight read
// once from DRAM as in a forward: at 1 row oneDNN streams the weight at 22-32 GB/s and this kernel at
// 34-52; at 16 rows 124-162 against 175-193 GFLOP/s; at 346 rows (prefill) 195-201 against 201-213. A
// simple register-blocked kernel suffices because a model's K (its hidden or intermediate size) is small:
// one panel's K x 48 weights sit in L2 while every 8-row block of x passes over it, so there is no K
// blocking and no packing of x.
//
// Micro-kernel: 8 rows x 48 columns of fp32 sums in 24 zmm registers; per k, three weight vectors and one
// broadcast x value per row, 24 FMAs. Each output is one fp32 FMA chain over k in order, then + bias, as a
// plain dot product would; it differs from oneDNN's or MKL's order in rounding only (greedy equality with
// Hugging Face is what the real-model tests check).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 48;

#if defined(__AVX512F__)
template <int MR>
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
  for (int c = 0; c < 3 && 16 * c < cols; ++c) {
    const __mmask16 mask = cols - 16 * c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - 16 * c)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * c) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + 16 * c, mask, _mm512_add_ps(acc[m][c], b));
  }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr Micro kMicro[9] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>, micro<7>, micro<8>};
#endif

// w [N, K] -> [ceil(N / 48), K, 48] float32, zero past N.
at::Tensor pack_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_f32: a 2-D float32 weight");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto out = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = src[(p * kPanel + j) * K + k];
  });
  return out;
}

// x [..., K] float32 @ the packed W^T (+ bias [N]) -> [..., N]; `n` is W's row count (N).
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "linear_f32: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "linear_f32: not a pack");
  const int64_t K = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(x.size(-1) == K, "linear_f32: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "linear_f32: n does not match the pack");
  const auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto y = at::empty({M, n}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "linear_f32: bias of ", n, " floats");
  }
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Panels in groups of ~512 KB (in L2 together) per thread, each group passed over by every 8-row block.
  const int64_t group = std::max<int64_t>(1, (512 << 10) / (K * kPanel * int64_t(sizeof(float))));
  if (M > 0)
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t g = p0; g < p1; g += group) {
        const int64_t g1 = std::min(p1, g + group);
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
          const Micro f = kMicro[std::min<int64_t>(8, M - m0)];
          for (int64_t p = g; p < g1; ++p)
            f(xp + m0 * K, K, wp + p * K * kPanel, K, bp ? bp + p * kPanel : nullptr, yp + m0 * n + p * kPanel, n,
              std::min(kPanel, n - p * kPanel));
        }
      }
    });
  return y.view(out_shape);
#else
  TORCH_CHECK(false, "linear_f32 needs AVX-512 (gemm_available() is False here)");
#endif
}

bool gemm_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

void register_gemm(pybind11::module& m) {
  m.def("gemm_available", &gemm_available, "whether linear_f32 is built (AVX-512)");
  m.def("pack_f32", &pack_f32, "fp32 weight [N, K] into linear_f32's panels", pybind11::arg("weight"));
  m.def("linear_f32", &linear_f32, "x @ W^T (+ bias) with W packed by pack_f32 (CPU, fp32)", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
