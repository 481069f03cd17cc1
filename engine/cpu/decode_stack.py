"""A pre-norm decoder's layers run for a CPU decode-only step in one call (bindings.cpp's DecodeStack).

At one stream a small model's decode step on CPU is as much Python as kernels: each layer makes some fifteen
Python calls around its eight kernel calls (norms, linears, attention, SiLU * up). DecodeStack makes the same
kernel calls, in DecoderLayer.forward_fused's order and on the same tensors, from C++, so the result is the same
bits; `CpuDecodeStack` builds it once per model and KV cache and hands a step to it when the step can go:

- the model: every layer pre-norm with the CPU kernels (residual add + RMSNorm, RoPE in place, SiLU * up), a
  dense MLP, and linears DecodeStack runs: a quantized linear of one part (engine/cpu/quant.py, packed or in the
  file's layout), or gemm.cpp's panels (a plain linear, or gate/up with the SiLU epilogue); no LoRA wrapper, no
  q/k norm, no local RoPE table, the caches in the model's dtype, every kernel from the attention backend's
  module, and no forward hooks on the layers when it is built (it calls no module). Anything else keeps the
  Python layers (`CpuDecodeStack.reason` says why);
- the step: every row a one-token decode in every KV group, and no row selection (`keep`).
"""

from __future__ import annotations

from torch import nn

from engine.cpu.linear import FusedGateUp, PackedLinear, Panels
from engine.cpu.quant import GGML_TYPE_IDS, QuantLinear, int8_activations


def _linear(module, kernels) -> tuple | None:
    """(kind, weight, outputs, ggml type, bias) as DecodeStack takes a linear, or None where it cannot run it."""
    if type(module) is QuantLinear and len(module.parts) == 1 and module.parts[0].kernels is kernels:
        part = module.parts[0]
        return 0 if part.packed else 1, part._store, part.rows, GGML_TYPE_IDS[part.qtype], module.bias
    if type(module) is FusedGateUp and module.packed.kernels is kernels:
        return 3, module.packed.panels, module.packed.inter, 0, module.bias
    if type(module) is PackedLinear and type(module.packed) is Panels and module.packed.kernels is kernels:
        return 2, module.packed.panels, module.out_features, 0, module.bias
    return None


class CpuDecodeStack:
    """DecoderLM's decode steps through DecodeStack where they can go (the module's docstring)."""

    def __init__(self):
        self.stack = None
        self.kv_caches = None  # the caches the stack was built for (a model's KV cache is made once)
        self.groups = 1
        self.backend = None  # the layers' attention backend (CpuPagedAttention)
        self.reason: str | None = None  # why this model's layers stay in Python; None while it can go

    def __call__(self, model, x, rope, kv_caches, meta):
        """(h, residual) after every layer, as DecoderLM._forward_fused's loop gives them, or None: that loop
        runs this step."""
        if self.reason is not None:
            return None
        if kv_caches is not self.kv_caches:
            self.stack, self.kv_caches = self._build(model, kv_caches), kv_caches
            if self.stack is None:
                return None
        args = []
        for g in range(self.groups):
            m = meta.for_group(g)
            unit = self.backend.decode_unit(m)
            if unit is None:
                return None
            args.append([m.slot_mapping, unit.blocks, unit.lens])
        cos, sin = rope if rope is not None else (None, None)
        return self.stack.run(x, args, cos, sin, int8_activations())

    def _build(self, model, kv_caches):
        reason, stack = self._check(model, kv_caches)
        if reason is not None:
            self.reason = reason
            return None
        return stack

    def _check(self, model, kv_caches) -> tuple[str | None, object]:
        layers = model.layers
        attn0 = layers[0].self_attn
        kernels = getattr(attn0.backend, "kernel", None)
        if kernels is None or not hasattr(kernels, "DecodeStack") or not hasattr(attn0.backend, "decode_unit"):
            return "the attention backend is not the CPU kernels'", None
        self.backend = attn0.backend
        norm = model.norm_kernel
        lanes = 0 if norm is kernels else getattr(norm, "lanes", None) if getattr(norm, "kernels", None) is kernels \
            else None
        if lanes is None or model.spec.sandwich_norms or model.rotary_local is not None:
            return "not a pre-norm model with the CPU norm kernel", None
        if any(m._forward_hooks or m._forward_pre_hooks for m in layers.modules()) or \
                nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return "forward hooks on the layers (the stack would not call them)", None
        norms, linears, windows, softcaps = [], [], [], []
        dtype = layers[0].input_layernorm.weight.dtype
        for i, (layer, (k, v)) in enumerate(zip(layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.rope_kernel is not kernels or attn.q_norm is not None or attn.backend is not attn0.backend:
                return f"layer {i}: no in-place RoPE kernel (q/k norms)", None
            if getattr(mlp, "kernel", None) is not kernels or not hasattr(mlp, "gate_up_proj"):
                return f"layer {i}: not a dense MLP with the SiLU * up kernel", None
            parts = [_linear(attn.qkv_proj, kernels), _linear(attn.o_proj, kernels), _linear(mlp.gate_up_proj, kernels),
                     _linear(mlp.down_proj, kernels)]
            if None in parts or any(p[0] == 3 for p in parts[:2] + parts[3:]):
                return f"layer {i}: a linear the stack does not run (LoRA, oneDNN, several parts)", None
            if k.dtype != dtype or v.dtype != dtype:
                return "the KV cache is not in the model's dtype", None
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            linears += parts
            windows.append(attn.layer.sliding_window or 0)
            softcaps.append(attn.layer.softcap or 0.0)
        self.groups = max(model.kv_group) + 1
        eps = layers[0].input_layernorm.eps
        stack = kernels.DecodeStack(norms, linears, list(model.kv_group), windows, softcaps, [k for k, _ in kv_caches],
                                    [v for _, v in kv_caches], eps, lanes, attn0.num_heads, attn0.num_kv_heads,
                                    attn0.scale)
        return None, stack
