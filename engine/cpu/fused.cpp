// Fused elementwise ops for the CPU decoder: residual add + RMSNorm, SiLU(gate) * up and the rotary
// embedding (in place), in fp32 and bf16.
//
// Why by hand: in eager PyTorch each of these is 3-8 separate ops (RoPE: 4 multiplies, a subtract, an add and a
// cat; the bf16 RMSNorm: upcast, pow, mean, add, rsqrt, two multiplies, downcast), each a pass over memory and a
// dispatch. On decode steps the dispatch dominates (a 30-layer model runs a few hundred elementwise ops a step);
// on long bf16 prefill chunks the passes cost as much as the AMX GEMMs. vLLM's CPU build
// has the same kernels in its own extension; torch.compile would fuse them too, at a compile cost per shape.
//
// Rounding follows the eager ops they replace: each intermediate eager PyTorch rounds to bf16 is rounded here
// (round-to-nearest-even, as c10::BFloat16 does): x1 * cos and x2 * sin before the subtract, SiLU(gate) before
// the multiply by up, the residual sum before the norm, the normalised row before HF's `weight * x.to(bf16)`.
// RoPE is the same products and sums in the same order (this file is compiled without FMA contraction), and
// SiLU is PyTorch's own arithmetic at the same instruction-set level (engine/cpu/kernels.py builds this file
// at PyTorch's): Sleef's 16-lane exp with AVX-512 (exact for widths of whole 32-value iterations), its 8-lane
// exp with AVX2 over the values PyTorch's loop takes as vectors and the scalar exp over its tail (exact for
// every width), the scalar exp at the default level; so both are exact in fp32 and bf16.
// The norm's fp32 sum of squares is summed in another order than PyTorch's cascade, so where the normalised
// value sits on a bf16 rounding boundary it can round the other way (1 ulp; <= 2 in the output after the
// weight's multiply) on ~1e-5 of the outputs (157 of 2.1M at 512 x 4096; tests/test_cpu_fused.py). In fp32
// such a last bit would break exact equality with HF, so the fp32 norm (rms_norm_f32, below) sums in
// PyTorch's own order instead.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/native/cpu/utils.h>  // CeilLog2: the cascade's level step, as PyTorch's sum computes it
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TANDEM_FUSED_AVX512 1
// The vector exp PyTorch's own AVX-512 kernels call (Vectorized<float>::exp), exported by libtorch_cpu: SiLU
// here computes exactly what torch's silu kernel computes, x / (1 + exp(-x)) in fp32.
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_FUSED_AVX2 1
// The vector exp of PyTorch's AVX2 kernels (Vectorized<float>::exp at ATEN_CPU_CAPABILITY=avx2).
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

#ifdef TANDEM_FUSED_AVX512

using tandem_simd::lanes;  // lanes [0, n) of 16 (a row's tail chunk)

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const at::BFloat16* p, __mmask16 m) {  // exact: a bf16's bits are the top half of its fp32
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// fp32 -> bf16 bits (in each lane's low half) by c10::BFloat16's rule: round to nearest even, NaN -> 0x7FC0.
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline void store(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(at::BFloat16* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// The value eager PyTorch would hold after storing `x` in a tensor of type T.
template <typename T>
inline __m512 rnd(__m512 x) {
  if constexpr (std::is_same<T, float>::value) return x;
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
}
#endif

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }

// Below: PyTorch's fp32 sum order at W lanes. Declared under the same pragma as its definition: a template's
// first declaration decides its instances' optimize attributes, and reassociation would reorder the sum.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
template <int W>
float torch_sum_of_squares(const float* h, int64_t d);
#pragma GCC pop_options

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, at::Tensor* residual_out, const at::Tensor& w,
                   at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* rop = residual_out ? residual_out->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> v(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * d;
      T* o = op + r * d;
#ifdef TANDEM_FUSED_AVX512
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = lanes(d - i);
        __m512 s = load(xr + i, m);
        if (rp) {
          s = rnd<T>(_mm512_add_ps(s, load(rp + r * d + i, m)));
          store(rop + r * d + i, m, s);
        }
        _mm512_mask_storeu_ps(v.data() + i, m, s);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(s, s));
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + feps);
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = lanes(d - i);
        const __m512 y = rnd<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, v.data() + i), vinv));
        store(o + i, m, _mm512_mul_ps(load(wp + i, m), y));  // w * (x * inv).to(bf16)
      }
#else
      for (int64_t i = 0; i < d; ++i) {
        v[i] = rp ? rnd<T>(f32(xr[i]) + f32(rp[r * d + i])) : f32(xr[i]);
        if (rp) rop[r * d + i] = static_cast<T>(v[i]);
      }
      // In the order of PyTorch's own 8-lane fp32 sum: a plain running sum's larger rounding error put several
      // times more outputs on the other side of a bf16 rounding boundary (tests/test_cpu_fused.py's bound)
      const float acc = torch_sum_of_squares<8>(v.data(), d);
      const float inv = 1.f / std::sqrt(acc / static_cast<float>(d) + feps);
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(f32(wp[i]) * rnd<T>(v[i] * inv));
#endif
    }
  });
}

void check_rows(const at::Tensor& x, const char* name, bool fp32_too = false) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || (fp32_too && x.scalar_type() == at::kFloat), name,
              fp32_too ? " must be float32 or bfloat16, got " : " must be bfloat16, got ", x.scalar_type());
}

// bf16, HF Llama's RMSNorm: out = RMSNorm(x) (residual None), or residual_out = x + residual and
// out = RMSNorm(residual_out).
// Returns [out] or [out, residual_out].
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& w,
                                 double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "weight must be a contiguous [dim] tensor of x's dtype");
  auto out = at::empty_like(x);
  if (!residual.has_value()) {
    rms_norm_impl<at::BFloat16>(x, nullptr, nullptr, w, out, eps);
    return {out};
  }
  const at::Tensor& res = *residual;
  check_rows(res, "residual");
  TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual must match x");
  auto res_out = at::empty_like(x);
  rms_norm_impl<at::BFloat16>(x, &res, &res_out, w, out, eps);
  return {out, res_out};
}

// ---- fp32 RMSNorm, PyTorch's arithmetic bit for bit ----------------------------------------------------------
// F.rms_norm in fp32 on CPU is six eager ops (pow, sum, div, add eps, rsqrt, two multiplies) plus the residual
// add before it, a noticeable share of a prefill and more of a decode step, nearly all of it dispatch and
// passes over memory (docs/engine.md#fused-elementwise-ops-cpu_fusedcpp). Here it is one pass per row with the
// same roundings:
// x * x; the row's sum in the exact order of PyTorch's vectorized inner sum (ATen/native/cpu/SumKernel.cpp:
// Vectorized<float> accumulators of `W` lanes, the row read as (-1, 4) vectors, a cascade of 4 levels in steps
// of 2^max(4, ceil(log2(n)) / 4), then the 4 partials, then the scalar tail and the W lanes in order; a row
// under one vector as scalars, (-1, 4) likewise); / d; + eps; 1 / sqrt (Vectorized<float>::rsqrt); x * that;
// * weight. W is the lane count of PyTorch's float sum on this CPU, 8 or 16, which depends on the PyTorch build,
// found by trying both against F.rms_norm at load (engine/models/decoder.py fp32_norm_lanes);
// tests/test_cpu_fused.py compares the outputs bit for bit. Compiled without reassociation or contraction, so
// every add and multiply is the one written.

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")  // -fassociative-math (cpu_native's flags) would reorder the sums

// One Vectorized<float> of W lanes as a GCC vector: +, * are lane-wise, each lane's sum in its own order.
template <int W>
struct LaneVec;
template <>
struct LaneVec<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct LaneVec<8> {
  typedef float type __attribute__((vector_size(32)));
};

template <int W>
float torch_sum_of_squares(const float* h, int64_t d) {
  constexpr int64_t levels = 4, rows = 4;  // multi_row_sum's num_levels; row_sum's ilp_factor
  if (d < W) {  // under one vector PyTorch sums scalars (scalar_inner_sum): the row as (-1, 4), tail, partials
    float p[rows] = {};
    const int64_t size_ilp = d / rows;  // < 4: one cascade level
    for (int64_t i = 0; i < size_ilp; ++i)
      for (int64_t k = 0; k < rows; ++k) p[k] += h[i * rows + k] * h[i * rows + k];
    for (int64_t e = size_ilp * rows; e < d; ++e) p[0] += h[e] * h[e];
    for (int64_t k = 1; k < rows; ++k) p[0] += p[k];
    return p[0];
  }
  using V = typename LaneVec<W>::type;
  auto sq = [h](int64_t v) {
    V x;
    std::memcpy(&x, h + v * W, sizeof(V));
    return x * x;
  };
  const int64_t vec_size = d / W, size_ilp = vec_size / rows;
  const int64_t level_power = std::max<int64_t>(4, at::native::utils::CeilLog2(size_ilp) / levels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  V acc[levels][rows] = {};
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < rows; ++k) acc[0][k] += sq(i * rows + k);
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < rows; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = V{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int64_t k = 0; k < rows; ++k) acc[0][k] += sq(i * rows + k);
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < rows; ++k) acc[0][k] += acc[j][k];
  V partial = acc[0][0];
  for (int64_t v = size_ilp * rows; v < vec_size; ++v) partial += sq(v);
  for (int64_t k = 1; k < rows; ++k) partial += acc[0][k];
  float total = 0.f;
  for (int64_t e = vec_size * W; e < d; ++e) total += h[e] * h[e];
  for (int l = 0; l < W; ++l) total += partial[l];
  return total;
}

template <int W>
void rms_norm_f32_impl(const float* xp, const float* rp, float* hp, const float* wp, float* op, int64_t rows,
                       int64_t d, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * d;
      const float* h = x;
      if (rp) {  // the residual stream: x + residual, as eager's add (alpha 1: one rounding)
        float* hr = hp + r * d;
        const float* res = rp + r * d;
        for (int64_t e = 0; e < d; ++e) hr[e] = x[e] + res[e];
        h = hr;
      }
      const float var = torch_sum_of_squares<W>(h, d) / static_cast<float>(d);
      const float inv = 1.f / std::sqrt(var + eps);
      float* o = op + r * d;
      for (int64_t e = 0; e < d; ++e) o[e] = (h[e] * inv) * wp[e];
    }
  });
}

// fp32 F.rms_norm(x [+ residual]) bit for bit on a CPU whose PyTorch kernels are `lanes` wide (16 or 8).
// Returns [out] or [out, x + residual].
std::vector<at::Tensor> rms_norm_f32(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& w, double eps, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous float32 [rows, dim] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "weight must be a contiguous float32 [dim] tensor");
  TORCH_CHECK(lanes == 16 || lanes == 8, "lanes must be 16 (AVX-512) or 8 (AVX2), got ", lanes);
  const float* rp = nullptr;
  at::Tensor h;
  if (residual.has_value()) {
    const at::Tensor& res = *residual;
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == at::kFloat && res.is_contiguous(),
                "residual must be a contiguous float32 tensor shaped like x");
    rp = res.data_ptr<float>();
    h = at::empty_like(x);
  }
  auto out = at::empty_like(x);
  auto run = lanes == 16 ? &rms_norm_f32_impl<16> : &rms_norm_f32_impl<8>;
  run(x.data_ptr<float>(), rp, rp ? h.data_ptr<float>() : nullptr, w.data_ptr<float>(), out.data_ptr<float>(),
      x.size(0), x.size(1), static_cast<float>(eps));
  if (h.defined()) return {out, h};  // not `rp`: an empty residual (zero rows) has no data pointer
  return {out};
}

#pragma GCC pop_options

#ifdef TANDEM_FUSED_AVX512
// SiLU of 16 lanes as eager PyTorch computes it for a tensor of type T: x / (1 + exp(-x)) in fp32, stored as T.
template <typename T>
inline __m512 silu16(__m512 x) {
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), x);
  return rnd<T>(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_expf16_u10(neg))));
}

// A bf16 gate has 65,536 possible values, so its SiLU (rounded to bf16 before the multiply by up, as eager's
// bf16 silu stores it) is looked up: silu16 run once over every bit pattern, kept as fp32 (256 KB, in L2).
// The same arithmetic, so the same bits; a gather instead of Sleef's exp and a division per 16 values.
const float* silu_bf16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; i += 16) {
      const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(int32_t(i)), _mm512_setr_epi32(
          0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm512_storeu_ps(t.data() + i, silu16<at::BFloat16>(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))));
    }
    return t;
  }();
  return table.data();
}

// One row: SiLU(g) * u over `width` values into o (T's type), from gate and up of type Tin (T, or the fused
// GEMM's fp32 sums): bf16 rounds them to bf16 first, as a stored bf16 gate/up output is (exact when Tin is T),
// and looks the SiLU up in `table`.
template <typename T, typename Tin>
inline void silu_mul_row(const Tin* g, const Tin* u, int64_t width, T* o, const float* table, int64_t = 0) {
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 m = lanes(width - i);
    const __m512 gv = load(g + i, m);
    __m512 silu;
    if constexpr (std::is_same<T, at::BFloat16>::value)
      silu = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, bf16_bits(gv), table, 4);
    else
      silu = silu16<T>(gv);
    store(o + i, m, _mm512_mul_ps(silu, rnd<T>(load(u + i, m))));
  }
}
#endif

#ifndef TANDEM_FUSED_AVX512
// SiLU as PyTorch's silu kernel computes it at this level for a row of `width`: its vectorized loop takes the
// row 2 vectors at a time (16 lanes on AVX2: x / (1 + exp(-x)) with Sleef's 8-lane exp) and the rest as scalars
// (std::exp); at the "default" level its vectors are scalar std::exp too. So every width is exact in fp32.
inline float silu_scalar(float x) { return x / (1.f + std::exp(-x)); }
#ifdef TANDEM_FUSED_AVX2
inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
constexpr int64_t kSiluVector = 16;  // lanes an iteration of PyTorch's vectorized loop (2 x 8)
#else
constexpr int64_t kSiluVector = 1;  // no vector arithmetic: all scalar
#endif
// Where PyTorch's vectorized loop leaves a row of `width` to its scalar tail.
inline int64_t silu_vector_end(int64_t width) { return kSiluVector > 1 ? width / kSiluVector * kSiluVector : 0; }

// bf16 gates through a table of every bf16 value's SiLU rounded to bf16 (as the AVX-512 path), built with the
// vector arithmetic (PyTorch's bf16 silu converts to fp32 vectors; rows' scalar tails may differ by that exp).
const float* silu_bf16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      const uint32_t bits = i << 16;
      float x;
      std::memcpy(&x, &bits, sizeof(x));
      t[i] = x;
    }
    int64_t i = 0;
#ifdef TANDEM_FUSED_AVX2
    for (; i < 65536; i += 8) _mm256_storeu_ps(t.data() + i, silu8(_mm256_loadu_ps(t.data() + i)));
#endif
    for (; i < 65536; ++i) t[i] = silu_scalar(t[i]);
    for (float& y : t) y = rnd<at::BFloat16>(y);
    return t;
  }();
  return table.data();
}

// fp32: values [0, vector_end) of the row by the vector arithmetic, the rest as PyTorch's scalar tail.
template <typename T, typename Tin>
inline void silu_mul_row(const Tin* g, const Tin* u, int64_t width, T* o, const float* table, int64_t vector_end) {
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    for (int64_t i = 0; i < width; ++i)
      o[i] = static_cast<T>(table[static_cast<T>(f32(g[i])).x] * rnd<T>(f32(u[i])));
    return;
  } else {
    int64_t i = 0;
#ifdef TANDEM_FUSED_AVX2
    for (; i + 8 <= std::min(width, vector_end); i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
#endif
    for (; i < width; ++i) o[i] = silu_scalar(g[i]) * u[i];
  }
}
#endif

template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* table = std::is_same<T, at::BFloat16>::value ? silu_bf16_table() : nullptr;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * width;
#ifdef TANDEM_FUSED_AVX512
      silu_mul_row(g, g + width, width, op + r * width, table);
#else
      silu_mul_row(g, g + width, width, op + r * width, table, silu_vector_end(width));
#endif
    }
  });
}

// gate_up [rows, 2 * I] (gate columns, then up) -> SiLU(gate) * up [rows, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up", true);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_impl<float>(gate_up, out);
  else silu_mul_impl<at::BFloat16>(gate_up, out);
  return out;
}

template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  const int64_t tokens = x.size(0), stride = x.stride(0), half = cos.size(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * half;
      const T* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = xp + t * stride + h * head_dim;
#ifdef TANDEM_FUSED_AVX512
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = lanes(half - i);
          const __m512 x1 = load(p + i, m), x2 = load(p + half + i, m), ci = load(c + i, m), si = load(s + i, m);
          store(p + i, m, _mm512_sub_ps(rnd<T>(_mm512_mul_ps(x1, ci)), rnd<T>(_mm512_mul_ps(x2, si))));
          store(p + half + i, m, _mm512_add_ps(rnd<T>(_mm512_mul_ps(x2, ci)), rnd<T>(_mm512_mul_ps(x1, si))));
        }
#else
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(p[i]), x2 = f32(p[half + i]), ci = f32(c[i]), si = f32(s[i]);
          p[i] = static_cast<T>(rnd<T>(x1 * ci) - rnd<T>(x2 * si));
          p[half + i] = static_cast<T>(rnd<T>(x2 * ci) + rnd<T>(x1 * si));
        }
#endif
      }
    }
  });
}

// Rotate (rotate-half convention) the first `heads` heads of every row of x [tokens, >= heads * head_dim] in
// place; cos/sin [tokens, half] in x's dtype; dims past 2 * half in each head pass through (partial rotary).
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, width] with contiguous rows");
  TORCH_CHECK(x.size(1) >= heads * head_dim, "x is narrower than heads * head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.is_contiguous()
                  && sin.is_contiguous() && 2 * cos.size(1) <= head_dim,
              "cos/sin must be contiguous [tokens, half] with 2 * half <= head_dim");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtype mismatch");
  if (x.scalar_type() == at::kFloat) rope_impl<float>(x, cos, sin, heads, head_dim);
  else if (x.scalar_type() == at::kBFloat16) rope_impl<at::BFloat16>(x, cos, sin, heads, head_dim);
  else TORCH_CHECK(false, "rope_ supports float32 and bfloat16, got ", x.scalar_type());
}

}  // namespace

namespace tandem_fused {
// The fused gate/up GEMM's epilogue (engine/cpu/gemm.cpp): `rows` rows of `cols` (<= 24) gate sums at
// gate[r * ld] and up sums at up[r * ld], fp32 with the bias added -> SiLU(gate) * up in out[r * ldo], T's type.
// They are columns [col0, col0 + cols) of rows `width` wide: where PyTorch's SiLU would take a column as a
// scalar tail (AVX2, default), so does this.
// What silu_mul computes from the same sums stored by the unfused GEMM: in bf16 gate and up are rounded to bf16
// first, as that GEMM's output is, and the SiLU is the same table; so the bits are the same either way.
template <typename T>
void silu_mul_rows(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t cols, T* out,
                   int64_t ldo, int64_t col0, int64_t width) {
  const float* table = std::is_same<T, at::BFloat16>::value ? silu_bf16_table() : nullptr;
#ifdef TANDEM_FUSED_AVX512
  const int64_t vector_end = 0;
#else
  const int64_t vector_end = std::max<int64_t>(0, silu_vector_end(width) - col0);
#endif
  for (int64_t r = 0; r < rows; ++r)
    silu_mul_row(gate + r * ld, up + r * ld, cols, out + r * ldo, table, vector_end);
}
template void silu_mul_rows<float>(const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t,
                                   int64_t);
template void silu_mul_rows<at::BFloat16>(const float*, const float*, int64_t, int64_t, int64_t, at::BFloat16*,
                                          int64_t, int64_t, int64_t);
// This file's ops for the other sources of the module (decode_attention.cpp's decode_attend and decode_layers).
void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  rope_(x, cos, sin, heads, head_dim);
}
// [residual add +] RMSNorm: the fp32 kernel at `lanes` (8 or 16), or with lanes 0 the bf16 one; {out, stream}.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& w, double eps, int64_t lanes) {
  return lanes ? rms_norm_f32(x, residual, w, eps, lanes) : rms_norm(x, residual, w, eps);
}
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return silu_mul(gate_up); }
}  // namespace tandem_fused

const tandem_ops::FusedOps tandem_ops::kFused{&rms_norm, &rms_norm_f32, &silu_mul, &rope_};
