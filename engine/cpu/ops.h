// The module's ops as each kernel source exports them to bindings.cpp, the one source that includes pybind11 and
// PyTorch's Python headers.
//
// Why: parsing those headers (torch/extension.h) was most of each source's compile, in every source at every
// instruction-set level (docs/engine.md, "Build and instruction-set levels", has the times). The kernel sources
// include only ATen's tensor and parallel headers and hand their ops over as tables of function pointers, so the
// ops themselves keep internal linkage (GCC inlines a static function called once where it would not inline an
// external one, so the kernels compile as they did).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace tandem_ops {

using OptTensor = c10::optional<at::Tensor>;

// fused.cpp (its signatures and contracts are documented there)
struct FusedOps {
  std::vector<at::Tensor> (*rms_norm)(const at::Tensor& x, const OptTensor& residual, const at::Tensor& w,
                                      double eps);
  std::vector<at::Tensor> (*rms_norm_f32)(const at::Tensor& x, const OptTensor& residual, const at::Tensor& w,
                                          double eps, int64_t lanes);
  at::Tensor (*silu_mul)(const at::Tensor& gate_up);
  void (*rope_)(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
};
extern const FusedOps kFused;

// decode_attention.cpp
struct DecodeOps {
  at::Tensor (*paged_decode)(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                             double softcap);
  at::Tensor (*decode_attend)(const at::Tensor& qkv, const OptTensor& cos, const OptTensor& sin,
                              const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads,
                              int64_t kv_heads, double scale, int64_t window, double softcap);
};
extern const DecodeOps kDecode;

// prefill_attention.cpp
struct PrefillOps {
  void (*paged_prefill)(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& q_len,
                        const at::Tensor& seq_len, double scale, int64_t window, double softcap, at::Tensor& out,
                        int64_t k_pack_bytes);
  bool bf16_probs;  // bf16 prefill multiplies bf16-rounded probabilities (the AVX512-BF16 path)
};
extern const PrefillOps kPrefill;

// gemm.cpp
struct GemmOps {
  at::Tensor (*pack)(const at::Tensor& weight);
  at::Tensor (*linear)(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t n);
  at::Tensor (*silu_mul)(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t n);
  bool silu;  // gemm_silu_mul fuses the SiLU * up epilogue at this level
  bool bf16;  // bf16 weights (AVX512-BF16 or the widening paths)
};
extern const GemmOps kGemm;

// gemm_quant.cpp
struct QuantOps {
  at::Tensor (*linear)(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const OptTensor& bias,
                       bool int8_x);
  at::Tensor (*packed)(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, const OptTensor& bias,
                       int64_t out_features, bool int8_x);
  at::Tensor (*packed_rows)(const at::Tensor& packed, int64_t qtype, const at::Tensor& rows);
  at::Tensor (*quantize_q8_0)(const at::Tensor& x);
  std::vector<const char*> types;  // the ggml types `linear` runs
  bool packed_kernels;             // Q8_0 and Q4_1 in the packed layout
};
extern const QuantOps kQuant;

}  // namespace tandem_ops

// What DecodeStack (bindings.cpp) calls, one layer's kernels at a time.
namespace tandem_fused {  // fused.cpp
void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& w, double eps, int64_t lanes);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
}  // namespace tandem_fused
namespace tandem_gemm {  // gemm.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n);
}  // namespace tandem_gemm
namespace tandem_quant {  // gemm_quant.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias,
                  int64_t n, bool packed, bool int8_x);
}  // namespace tandem_quant
