// The Python module: every op of the kernel sources (engine/cpu/ops.h), bound here, in the one source that
// includes pybind11 and PyTorch's Python headers; and DecodeStack, which calls them from C++.

#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace {

using tandem_ops::kDecode, tandem_ops::kFused, tandem_ops::kGemm, tandem_ops::kPrefill, tandem_ops::kQuant;

// A pre-norm decoder's layers for a decode-only step, each layer the calls DecoderLayer.forward_fused makes, in its
// order, from C++: residual add + RMSNorm, the qkv linear, decode_attend, o, residual add + RMSNorm, gate/up with
// SiLU * up, down. The same kernels on the same tensors, so the same bits; what goes is the Python between them
// (about 30 us a layer at one row). engine/models/decoder.py's CpuDecodeStack builds it once per model and kv cache.
struct Linear {
  int64_t kind;  // 0: quantized, packed layout; 1: quantized, file layout; 2: gemm.cpp's panels; 3: gate/up panels
                 // with the SiLU * up epilogue (gemm_silu_mul)
  at::Tensor weight;
  int64_t n, qtype;  // outputs (3: the intermediate width); ggml type (0, 1)
  c10::optional<at::Tensor> bias;
};
using LinearArgs = std::tuple<int64_t, at::Tensor, int64_t, int64_t, c10::optional<at::Tensor>>;

at::Tensor run_linear(const Linear& l, const at::Tensor& x, bool int8_x) {
  if (l.kind <= 1) return tandem_quant::linear(x, l.weight, l.qtype, l.bias, l.n, l.kind == 0, int8_x);
  if (l.kind == 2) return tandem_gemm::linear(x, l.weight, l.bias, l.n);
  return tandem_gemm::linear_silu_mul(x, l.weight, l.bias, l.n);
}

class DecodeStack {
 public:
  // norms: 2 a layer (input, post-attention); linears: 4 a layer (qkv, o, gate_up, down); per layer its KV group,
  // window (0: none) and soft-cap (0: none), its K and V caches; lanes: the fp32 norm's (0: the bf16 norm).
  DecodeStack(std::vector<at::Tensor> norms, const std::vector<LinearArgs>& linears, std::vector<int64_t> groups,
              std::vector<int64_t> windows, std::vector<double> softcaps, std::vector<at::Tensor> k_caches,
              std::vector<at::Tensor> v_caches, double eps, int64_t lanes, int64_t heads, int64_t kv_heads,
              double scale)
      : norms_(std::move(norms)), groups_(std::move(groups)), windows_(std::move(windows)),
        softcaps_(std::move(softcaps)), k_(std::move(k_caches)), v_(std::move(v_caches)), eps_(eps), lanes_(lanes),
        heads_(heads), kv_heads_(kv_heads), scale_(scale) {
    const size_t layers = groups_.size();
    TORCH_CHECK(norms_.size() == 2 * layers && linears.size() == 4 * layers && windows_.size() == layers &&
                    softcaps_.size() == layers && k_.size() == layers && v_.size() == layers,
                "DecodeStack: 2 norms, 4 linears, a group, window, soft-cap and K/V caches a layer");
    for (const auto& [kind, weight, n, qtype, bias] : linears) {
      TORCH_CHECK(kind >= 0 && kind <= 3, "DecodeStack: linear kind ", kind, " is not 0-3");
      linears_.push_back(Linear{kind, weight, n, qtype, bias});
    }
  }

  // h [T, hidden] (the embedding, or the previous stage's), every row a decode; per KV group (slots [T] int64,
  // block tables [T, W] int32, lengths [T] int32); cos / sin [T, 1, half] or None. Returns {h, residual}, what the
  // last layer's forward_fused returns.
  std::vector<at::Tensor> run(const at::Tensor& h, const std::vector<std::vector<at::Tensor>>& group_args,
                              const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                              bool int8_x) const {
    at::Tensor x = h;
    c10::optional<at::Tensor> residual;
    for (size_t i = 0; i < groups_.size(); ++i) {
      const Linear* l = &linears_[4 * i];
      std::vector<at::Tensor> nr = tandem_fused::add_rms_norm(x.contiguous(), residual, norms_[2 * i], eps_, lanes_);
      residual = residual.has_value() ? nr[1] : x;
      const at::Tensor qkv = run_linear(l[0], nr[0], int8_x);
      const auto& g = group_args.at(groups_[i]);
      TORCH_CHECK(g.size() == 3, "DecodeStack: a KV group's slots, block tables and lengths");
      const at::Tensor a = tandem_ops::kDecode.decode_attend(qkv, cos, sin, k_[i], v_[i], g[0], g[1], g[2], heads_, kv_heads_, scale_,
                                         windows_[i], softcaps_[i]);
      nr = tandem_fused::add_rms_norm(run_linear(l[1], a, int8_x).contiguous(), residual, norms_[2 * i + 1], eps_,
                                      lanes_);
      residual = nr[1];
      const at::Tensor act = l[2].kind == 3 ? run_linear(l[2], nr[0], int8_x)
                                            : tandem_fused::silu_and_mul(run_linear(l[2], nr[0], int8_x).contiguous());
      x = run_linear(l[3], act, int8_x);
    }
    return {x, residual.value_or(x)};
  }

  size_t layers() const { return groups_.size(); }

 private:
  std::vector<at::Tensor> norms_;
  std::vector<Linear> linears_;
  std::vector<int64_t> groups_, windows_;
  std::vector<double> softcaps_;
  std::vector<at::Tensor> k_, v_;
  double eps_;
  int64_t lanes_, heads_, kv_heads_;
  double scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every op runs without the GIL, as PyTorch's own ops do: a served replica's Serve thread ships chunks while the
  // engine thread is in here (a norm over a long prefill chunk takes long enough to matter).
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  using pybind11::arg;
  // fused.cpp
  m.def("rms_norm", kFused.rms_norm, "[residual add +] RMSNorm (CPU)", arg("x"), arg("residual"), arg("weight"),
        arg("eps"), nogil());
  m.def("rms_norm_f32", kFused.rms_norm_f32, "[residual add +] RMSNorm, fp32, PyTorch's arithmetic (CPU)", arg("x"),
        arg("residual"), arg("weight"), arg("eps"), arg("lanes"), nogil());
  m.def("silu_mul", kFused.silu_mul, "SiLU(gate) * up (CPU)", arg("gate_up"), nogil());
  m.def("rope_", kFused.rope_, "rotary embedding in place (CPU)", arg("x"), arg("cos"), arg("sin"), arg("heads"),
        arg("head_dim"), nogil());

  // prefill_attention.cpp
  m.def("paged_prefill", kPrefill.paged_prefill, "paged prefill attention (CPU)", arg("q"), arg("k_cache"),
        arg("v_cache"), arg("block_tables"), arg("q_start"), arg("q_len"), arg("seq_len"), arg("scale"),
        arg("window"), arg("softcap"), arg("out"), arg("k_pack_bytes") = int64_t(8) << 20, nogil());
  m.attr("prefill_dtypes") = pybind11::make_tuple("float32", "bfloat16");  // at every level
  m.attr("prefill_head_sizes") = pybind11::make_tuple(64, 128, 256);        // at every level, in both dtypes
  m.attr("prefill_bf16_probs") = kPrefill.bf16_probs;

  // gemm.cpp
  m.def("gemm_pack", kGemm.pack, "a weight [N, K] into gemm_linear's panels", arg("weight"));
  m.def("gemm_linear", kGemm.linear, "x @ W^T (+ bias) with W packed by gemm_pack (CPU)", arg("x"), arg("packed"),
        arg("bias"), arg("n"), nogil());
  m.def("gemm_silu_mul", kGemm.silu_mul, "SiLU(x @ Wg^T) * (x @ Wu^T) with gate/up packed interleaved (CPU)",
        arg("x"), arg("packed"), arg("bias"), arg("n"), nogil());
  m.attr("gemm_silu") = kGemm.silu;
  if (kGemm.bf16) m.attr("gemm_dtypes") = pybind11::make_tuple("float32", "bfloat16");
  else m.attr("gemm_dtypes") = pybind11::make_tuple("float32");  // AVX-512 without AVX512-BF16

  // gemm_quant.cpp
  m.def("gemm_q_linear", kQuant.linear, "x @ W^T (+ bias) with W in GGUF blocks of gemm_q_types (CPU)", arg("x"),
        arg("weight"), arg("qtype"), arg("bias"), arg("int8_x"), nogil());
  m.def("gemm_q_packed", kQuant.packed, "x @ W^T (+ bias), W in the packed layout of gemm_q_packed_types (CPU)",
        arg("x"), arg("packed"), arg("qtype"), arg("bias"), arg("out_features"), arg("int8_x"), nogil());
  m.def("packed_rows", kQuant.packed_rows, "rows of a packed weight in the file's block layout (CPU)", arg("packed"),
        arg("qtype"), arg("rows"), nogil());
  m.def("quantize_q8_0", kQuant.quantize_q8_0, "x's Q8_0 blocks as gemm_q_linear's int8 path quantizes it (CPU)",
        arg("x"), nogil());
  pybind11::tuple names(kQuant.types.size());
  for (size_t i = 0; i < kQuant.types.size(); ++i) names[i] = kQuant.types[i];
  m.attr("gemm_q_types") = names;
  m.attr("gemm_q_packed_types") = kQuant.packed_kernels ? pybind11::make_tuple("Q8_0", "Q4_1") : pybind11::tuple();

  // decode_attention.cpp
  m.def("paged_decode", kDecode.paged_decode, "paged decode attention (CPU)", arg("q"), arg("k_cache"),
        arg("v_cache"), arg("block_tables"), arg("seq_lens"), arg("scale"), arg("window") = 0, arg("softcap") = 0.0,
        nogil());
  m.def("decode_attend", kDecode.decode_attend, "a decode-only step's attention for one layer from its qkv (CPU)",
        arg("qkv"), arg("cos"), arg("sin"), arg("k_cache"), arg("v_cache"), arg("slots"), arg("block_tables"),
        arg("seq_lens"), arg("heads"), arg("kv_heads"), arg("scale"), arg("window"), arg("softcap"), nogil());
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<at::Tensor>, const std::vector<LinearArgs>&, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          double, int64_t, int64_t, int64_t, double>(),
           arg("norms"), arg("linears"), arg("groups"), arg("windows"), arg("softcaps"), arg("k_caches"),
           arg("v_caches"), arg("eps"), arg("lanes"), arg("heads"), arg("kv_heads"), arg("scale"))
      .def("run", &DecodeStack::run, arg("h"), arg("group_args"), arg("cos"), arg("sin"), arg("int8_x"), nogil())
      .def_property_readonly("layers", &DecodeStack::layers);
}
