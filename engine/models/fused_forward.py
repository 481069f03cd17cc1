"""The fused CUDA forward of DecoderLM: each decoder layer in eight kernel launches.

    1 add_rms_norm     the previous layer's MLP output added to the residual stream, then input_layernorm
    2 qkv_proj         one GEMM (q/k/v concatenated at load, engine/models/loader.py; Qwen's bias: addmm)
    3 rope_store       q/k norm (Qwen3, Gemma 3), RoPE (Phi's partial rotary), q out, k/v into the paged cache
    4 attention        the Triton paged-attention kernel (engine/attention/triton_paged.py); a split key
                       range (decode on a GPU with idle SMs) is merged by its last split, not a second launch
    5 o_proj           one GEMM
    6 add_rms_norm     residual add + post_attention_layernorm (Gemma: post_attention_layernorm of o_proj's
                       output, added, then pre_feedforward_layernorm, in the same kernel)
    7 gate_up_act      the gate/up GEMM with act(gate) * up in its epilogue (a LoRA-wrapped gate/up: its own
                       launches, then act_mul)
    8 down_proj        one GEMM; its output is added (Gemma: post_feedforward_layernorm'd) by the next
                       layer's kernel 1, or by the final norm

Kernels 1, 3, 6, 7 are engine/models/fused_kernels.py. Same arithmetic as the eager path up to summation
order (see that module), so fp32 greedy output equals Hugging Face's. Every dense family runs it: Llama,
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3; LoRA wrappers and tensor-parallel row-parallel linears are
called as the modules they are (so their own launches add to the count). Mixture-of-experts families are
refused by name and keep the eager path. The CPU never runs this: it has its own fused kernels
(engine/cpu/fused.cpp); on CPU tensors it runs only under Triton's interpreter, for the tests.

`layer_launches` is the launch plan as code: the simulated device prices a forward with it
(engine/sim/cost_model.py) and tests/test_fused_forward.py counts a real decode step's launches against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import triton_paged
from engine.attention.metadata import AttentionMetadata
from engine.models import fused_kernels as fk
from engine.models.decoder import MLP, DecoderLM, ModelSpec, RMSNorm


@dataclass(frozen=True, slots=True)
class LayerLaunches:
    """What one decoder layer launches: PyTorch kernels (the GEMMs), Triton kernels, and view-only operators
    (no kernel, host dispatch only)."""

    aten: int
    triton: int
    views: int

    @property
    def kernels(self) -> int:
        return self.aten + self.triton


def refusal(spec: ModelSpec) -> str | None:
    """Why the fused forward cannot run `spec`, or None when it can."""
    if spec.moe is not None:
        return (f"{spec.family} is a mixture-of-experts model (its routed layers keep the eager path with the "
                "fused-MoE kernels)")
    if spec.hidden_act not in fk.ACTIVATIONS:
        return f"hidden_act {spec.hidden_act!r} has no fused epilogue (valid: {', '.join(fk.ACTIVATIONS)})"
    return None


def layer_launches(spec: ModelSpec, tp: int = 1) -> LayerLaunches:
    """The fused layer's launches for `spec` (see the module doc): the q/k/v, o and down GEMMs (PyTorch's),
    five Triton kernels (two norms, RoPE + store, attention, gate/up + act); `tp` > 1 adds the two
    all-reduces (o_proj, down_proj). LoRA adds its wrappers' own launches (not counted here)."""
    reason = refusal(spec)
    if reason is not None:
        raise ValueError(f"the fused forward does not run this model: {reason}")
    return LayerLaunches(aten=3 + (2 if tp > 1 else 0), triton=5, views=LAYER_VIEWS)


# View-only operators a fused layer dispatches on the host: attention's output reshaped for o_proj (F.linear
# reaches the dispatcher as one operator under inference mode, its weight transpose inside it).
LAYER_VIEWS = 1


class FusedDecoder:
    """Runs `model`'s layers through the fused kernels; DecoderLM.forward hands over to it once the embedding
    is done (DecoderLM.use_gpu_kernels)."""

    def __init__(self, model: DecoderLM, attention: triton_paged.TritonPagedAttention):
        reason = refusal(model.spec)
        if reason is not None:
            raise ValueError(f"the fused forward does not run this model: {reason}")
        if not isinstance(attention, triton_paged.TritonPagedAttention):
            raise ValueError("the fused forward writes the KV cache itself and needs the 'triton' attention "
                             f"backend, not {getattr(attention, 'name', type(attention).__name__)!r}")
        self.model, self.attention = model, attention
        self.act = model.spec.hidden_act

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, keep: torch.Tensor | None) -> torch.Tensor:
        """x [T, hidden]: the embedded tokens (or the previous stage's hidden states); as DecoderLM.forward."""
        model = self.model
        h, residual, pending = x, None, None
        last = len(model.layers) - 1
        for i, (layer, kv) in enumerate(zip(model.layers, kv_caches)):
            h, residual, pending = self.layer(layer, h, residual, pending, positions, kv,
                                              meta.for_group(model.kv_group[i]), keep if i == last else None)
        if model.is_last:
            return self._norm(model.norm, h, residual, pending)[0]
        return residual + (pending(h) if pending is not None else h)  # a pipeline stage hands on the stream

    def layer(self, layer, h, residual, pending: RMSNorm | None, positions, kv, meta, keep):
        """One decoder layer. Takes and returns (h, residual, pending): the stream is residual + h, or
        residual + pending(h) (Gemma's post-feedforward norm, applied by the next kernel that reads it);
        residual None: h is the stream."""
        x, residual = self._norm(layer.input_layernorm, h, residual, pending)
        attn = layer.self_attn
        qkv = attn.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        rotary = self.model.rotary_local if layer.local_rope else self.model.rotary
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, attn.q_norm.unit_offset) \
            if attn.q_norm is not None else ()
        q = fk.rope_store(qkv, positions, rotary.cos, rotary.sin, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                          kv[0], kv[1], meta.slot_mapping, *norms, k_scale=attn.k_scale, v_scale=attn.v_scale)
        o = triton_paged.paged_attention_triton(q, kv[0], kv[1], meta, attn.scale, attn.layer.sliding_window,
                                                self.attention.block_n, self.attention.num_splits,
                                                softcap=attn.layer.softcap, merge_in_kernel=True,
                                                k_scale=attn.k_scale, v_scale=attn.v_scale)
        o = o.view(o.shape[0], attn.q_size)
        if keep is not None:
            o, residual = o.index_select(0, keep), residual.index_select(0, keep)
        a = attn.o_proj(o)
        if layer.sandwich:
            x, residual = self._norm(layer.pre_feedforward_layernorm, a, residual, layer.post_attention_layernorm)
            return self.mlp(layer.mlp, x), residual, layer.post_feedforward_layernorm
        x, residual = self._norm(layer.post_attention_layernorm, a, residual, None)
        return self.mlp(layer.mlp, x), residual, None

    @staticmethod
    def _norm(norm: RMSNorm, h, residual, pending: RMSNorm | None):
        """(norm(stream), stream) for the stream residual + pending(h) (or + h, or h alone)."""
        pre = pending.weight if pending is not None and residual is not None else None
        if pending is not None and residual is None:  # a pending norm always comes with a residual
            raise ValueError("a pending post-norm without a residual stream")
        return fk.add_rms_norm(h, residual, norm.weight, norm.eps, norm.unit_offset, pre)

    def mlp(self, mlp: MLP, x: torch.Tensor) -> torch.Tensor:
        gate_up = mlp.gate_up_proj
        if type(gate_up) is nn.Linear:  # the GEMM with act(gate) * up in its epilogue
            act = fk.gate_up_act(x, gate_up.weight, gate_up.bias, self.act)
        else:  # a wrapper (LoRA) computes gate/up itself
            act = fk.act_mul(gate_up(x), self.act)
        return mlp.down_proj(act)


def wanted(setting: bool | None, spec: ModelSpec, device: torch.device, backend) -> bool:
    """EngineConfig.fused_forward resolved for this model: None (auto) = on CUDA with the Triton attention
    backend, for every family `refusal` accepts; True = required (ValueError naming why it cannot run);
    False = off."""
    reasons = []
    if getattr(backend, "name", None) != "triton":
        reasons.append(f"it needs the 'triton' attention backend, not {getattr(backend, 'name', backend)!r}")
    elif not triton_paged.usable_on(device):
        reasons.append(f"its Triton kernels run on cuda (or on cpu under TRITON_INTERPRET=1), not {device.type}")
    if (reason := refusal(spec)) is not None:
        reasons.append(reason)
    if setting is None:
        return device.type == "cuda" and not reasons
    if setting and reasons:
        raise ValueError(f"fused_forward=True cannot run here: {'; '.join(reasons)}")
    return bool(setting)
