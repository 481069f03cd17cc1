"""One decoder-only transformer covering the Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3
families, and the mixture-of-experts Qwen2-MoE, Qwen3-MoE and Mixtral (routed layers: engine/models/moe.py).

The families differ only in switches read from config.json (engine/models/loader.py): q/k/v bias (Qwen2,
Llama's attention_bias), per-head q/k RMSNorm (Qwen3, Gemma 3), sliding window (Mistral, Phi-3) or
sliding and global layers alternating (Gemma), tied embeddings, RoPE theta and scaling, partial rotary
dimensions (Phi-4-mini). Gemma adds (1 + weight) RMSNorms, norms after attention and around the MLP,
embeddings scaled by sqrt(hidden_size), its own query scale, soft-capped attention scores and final logits
(Gemma 2) and a separate RoPE table for its local layers (Gemma 3).
Tokens are flattened across sequences ([num_tokens, hidden]); attention goes through a paged backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata, LayerAttention
from engine.cpu.decode_stack import CpuDecodeStack
from engine.cpu.linear import FusedGateUp, fused_gate_up, pack_linears, pack_weight, packed_linear
from engine.models.moe import MoESpec, SparseMoeBlock

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The architecture facts the engine needs, normalised from an HF config."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    hidden_act: str
    # Switches the Llama family leaves at these defaults.
    layer_types: tuple[str, ...] = ()  # per layer, HF's names; () = every layer sliding iff sliding_window
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), all in fp32
    sandwich_norms: bool = False  # Gemma: norm the attention output, and pre/post-norm the MLP
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), rounded to the model dtype
    attn_scale: float | None = None  # None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: cap * tanh(score / cap) on the attention scores
    final_softcap: float | None = None  # Gemma 2: the same on the final logits
    rotary_dim: int | None = None  # None = head_dim; Phi-3's partial_rotary_factor rotates the first dims only
    local_rope: bool = False  # Gemma 3: sliding layers read their own RoPE table (DecoderLM.rotary_local)
    moe: MoESpec | None = None  # MoE families: which layers route over experts, and how (engine/models/moe.py)

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer types {bad} are not supported; valid: {', '.join(LAYER_TYPES)}")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(f"MoE layer pattern has {len(self.moe.sparse_layers)} entries for "
                             f"{self.num_layers} layers")

    def is_sliding(self, layer: int) -> bool:
        if self.layer_types:
            return self.layer_types[layer] == "sliding_attention" and self.sliding_window is not None
        return self.sliding_window is not None

    def layer_attention(self, layer: int) -> LayerAttention:
        """What global layer `layer` tells the attention backend on every call."""
        return LayerAttention(self.sliding_window if self.is_sliding(layer) else None, self.attn_softcap)


LAYER_TYPES = ("full_attention", "sliding_attention")


class RMSNorm(nn.Module):
    """Same arithmetic as HF's LlamaRMSNorm (fp32 statistics, weight applied in the input dtype), or with
    `unit_offset` as HF's GemmaRMSNorm (the stored weight is w and the scale 1 + w, applied in fp32)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.unit_offset:
            scale = 1.0 + self.weight.float()
            if dtype == torch.float32:
                return F.rms_norm(x, self.weight.shape, scale, self.eps)
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(dtype)
        if dtype == torch.float32:  # one fused kernel, bit-identical to the arithmetic below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype, HF Gemma 2's order; x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


@functools.cache
def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`: HF multiplies Gemma's embeddings by sqrt(hidden_size) cast to the model
    dtype (55.4256 becomes 55.5 in bf16), not by the exact constant."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()  # host memory: a CPU scalar, once per dtype


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once (rotate-half convention)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        # [P, D / 2]: HF's tables repeat these for the second half of each head (apply_rope uses them so)
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` as [T, 1, D / 2] in `dtype`: looked up once per forward, used by every
        layer."""
        return (self.cos.index_select(0, positions).to(dtype)[:, None, :],
                self.sin.index_select(0, positions).to(dtype)[:, None, :])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated (rotate-half convention), bit-identical to HF's x * cos + rotate_half(x) * sin
    but on the halves: broadcasting [T, 1, D] tables over the heads made each of HF's ops far slower on CPU
    at long prompts (docs/engine.md#models). Tables narrower than D / 2
    (partial rotary, Phi-4-mini) rotate the first 2 * width dims and pass the rest through, as HF does."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    if 2 * half == x.shape[-1]:
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        offset = spec.norm_unit_offset
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, offset) if spec.qk_norm else None
        self.scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim ** -0.5
        self.layer = spec.layer_attention(layer)  # this layer's window and soft-cap, passed on every call
        self.backend = backend
        self.rope_kernel = None  # CPU: cpu_fused's in-place RoPE (DecoderLM.use_cpu_kernels)
        # An fp8 KV cache's per-tensor scales (stored = x / scale), vLLM's k_scale / v_scale: 1.0 unless
        # calibrated, and fixed once the cache holds data (engine/kv_dtype.py). fp32 scalars on the model's
        # device, read by the kernels (no host sync, CUDA-graph safe); kept out of the checkpoint's tensors.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def reset_kv_scales(self, device: torch.device) -> None:
        """Scales of 1.0 in fp32 on `device`: after to_empty (which leaves buffers uninitialised) and the model's
        dtype cast."""
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(x, rope, kv, meta))

    def attend(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """Every row's K/V into the cache and its attention output before o_proj, [T, heads * head_dim]."""
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.rope_kernel is not None:  # the CPU backend takes a decode step from qkv in one kernel call
            whole = getattr(self.backend, "decode_qkv", None)
            o = None if whole is None else whole(qkv, rope, kv[0], kv[1], meta, self.scale, self.layer, h,
                                                 self.num_kv_heads)
            if o is not None:
                return o
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, d)  # [T, H + Hkv, D]: q heads, then k heads
        if self.rope_kernel is not None:  # q and k rotated in place inside qkv, one pass
            self.rope_kernel.rope_(qkv, rope[0][:, 0], rope[1][:, 0], h + self.num_kv_heads, d)
            q, k = qk[:, :h], qk[:, h:]
        elif self.q_norm is None:  # q and k rotated together: one set of elementwise ops for both
            qk = apply_rope(qk, *rope)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q, k = apply_rope(self.q_norm(qk[:, :h]), *rope), apply_rope(self.k_norm(qk[:, h:]), *rope)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, d)
        o = self.backend.forward(q, k, v, kv[0], kv[1], meta, self.scale, self.layer, k_scale=self.k_scale,
                                 v_scale=self.v_scale)
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__()
        if spec.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported; valid: {sorted(_ACTIVATIONS)}")
        inter = intermediate_size or spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=spec.mlp_bias)
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.kernel = None  # CPU: cpu_fused's silu_mul (DecoderLM.use_cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if isinstance(self.gate_up_proj, FusedGateUp):  # not when a LoRA wrapper needs gate and up
                return self.down_proj(self.gate_up_proj.silu_mul(x))
            return self.down_proj(self.kernel.silu_mul(self.gate_up_proj(x).contiguous()))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


def feed_forward(spec: ModelSpec, layer: int) -> nn.Module:
    """Global layer `layer`'s MLP: dense, or on an MoE family's routed layers the experts (with Qwen2-MoE's
    shared expert, a dense MLP of its own width)."""
    moe = spec.moe
    if moe is None or not moe.sparse_layers[layer]:
        return MLP(spec)
    shared = MLP(spec, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    return SparseMoeBlock(spec.hidden_size, moe, shared)


class DecoderLayer(nn.Module):
    """Pre-norm (Llama): x + attn(norm(x)), then x + mlp(post_attention_layernorm(x)). Sandwich (Gemma): the
    attention output is normed by post_attention_layernorm, the MLP gets pre_ and post_feedforward_layernorm
    (HF's names, so checkpoints map one to one)."""

    def __init__(self, spec: ModelSpec, backend, layer: int):
        super().__init__()
        norm = functools.partial(RMSNorm, spec.hidden_size, spec.rms_norm_eps, spec.norm_unit_offset)
        self.input_layernorm = norm()
        self.self_attn = Attention(spec, backend, layer)
        self.post_attention_layernorm = norm()
        self.mlp = feed_forward(spec, layer)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.local_rope = spec.local_rope and spec.is_sliding(layer)  # reads DecoderLM's local table

    def forward(self, x, rope, kv, meta, keep: torch.Tensor | None = None):
        """`keep` (row indices): every row's K/V is cached, but only these rows go on past the attention, and
        come out in keep's order (DecoderLM.forward)."""
        a = self.self_attn.attend(self.input_layernorm(x), rope, kv, meta)
        if keep is not None:
            a, x = a.index_select(0, keep), x.index_select(0, keep)
        if not self.sandwich:
            x = x + self.self_attn.o_proj(a)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(a))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, rope, kv, meta, kernel,
                      keep: torch.Tensor | None = None):
        """The pre-norm layer with each residual add fused into the norm after it (cpu_fused's bf16 rms_norm):
        takes and returns (h, residual), the stream being h + residual; residual None = h is the stream.
        `keep` as in forward."""
        h, residual = add_rms_norm(kernel, self.input_layernorm, h, residual)
        a = self.self_attn.attend(h, rope, kv, meta)
        if keep is not None:
            a, residual = a.index_select(0, keep), residual.index_select(0, keep)
        h, residual = add_rms_norm(kernel, self.post_attention_layernorm, self.self_attn.o_proj(a), residual)
        return self.mlp(h), residual


class Fp32Norm:
    """cpu_fused's fp32 residual add + RMSNorm (PyTorch's arithmetic bit for bit: same products, same sum
    order), bound to the vector width PyTorch's own sum kernel uses on this CPU; `rms_norm` as the bf16 one."""

    def __init__(self, kernels, lanes: int):
        self.kernels, self.lanes = kernels, lanes

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        return self.kernels.rms_norm_f32(x, residual, weight, eps, self.lanes)


@functools.cache
def fp32_norm_lanes(kernels, dim: int, eps: float) -> int | None:
    """The lane count (8 or 16) at which cpu_fused's rms_norm_f32 gives exactly this PyTorch's fp32
    F.rms_norm(x + residual) on rows of `dim`, checked here on random rows; None if neither does (another
    PyTorch build summing in another order): the eager norm stays. The width is the PyTorch build's and the
    CPU's, so it is checked rather than assumed."""
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(64, dim, generator=g), torch.randn(64, dim, generator=g) * 8
    w = torch.randn(dim, generator=g)
    want = F.rms_norm(x + res, (dim,), w, eps)
    for lanes in (8, 16):
        out, stream = kernels.rms_norm_f32(x, res, w, eps, lanes)
        if torch.equal(out, want) and torch.equal(stream, x + res):
            return lanes
    return None


def add_rms_norm(kernel, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor | None):
    """(norm(h + residual), h + residual), or (norm(h), h) when residual is None."""
    if residual is None:
        return kernel.rms_norm(h.contiguous(), None, norm.weight, norm.eps)[0], h
    return kernel.rms_norm(h.contiguous(), residual, norm.weight, norm.eps)


class DecoderLM(nn.Module):
    """Causal LM over a paged KV cache. `forward` returns hidden states; `logits` projects chosen rows.

    `layers=(start, end)` builds one pipeline stage: only decoder layers [start, end) (indexed locally from
    0, so `kv_caches` holds this stage's layers only), the embedding on the first stage, the final norm and
    LM head on the last (which also keeps the embedding when the checkpoint ties it to the head).
    `rotary_local` is Gemma 3's table for its sliding layers (None elsewhere).
    """

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding | None, backend,
                 layers: tuple[int, int] | None = None, rotary_local: RotaryEmbedding | None = None):
        super().__init__()
        self.spec = spec
        self.layer_range = layers or (0, spec.num_layers)
        start, end = self.layer_range
        if not 0 <= start < end <= spec.num_layers:
            raise ValueError(f"layer range {self.layer_range} is not within [0, {spec.num_layers}]")
        self.is_first, self.is_last = start == 0, end == spec.num_layers
        tied_head = self.is_last and spec.tie_word_embeddings
        self.embed_tokens = (nn.Embedding(spec.vocab_size, spec.hidden_size)
                             if self.is_first or tied_head else None)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, i) for i in range(start, end))
        # Each layer's KV group (engine/kv_groups.py): which of a step's AttentionMetadata.groups it attends with;
        # the runner sets it when its cache has sliding-window groups.
        self.kv_group: tuple[int, ...] = (0,) * len(self.layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_unit_offset) if self.is_last else None
        self.rotary = rotary
        self.rotary_local = rotary_local
        self.lm_head = (nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
                        if self.is_last and not spec.tie_word_embeddings else None)
        self.head_packed = None  # the LM head packed for the CPU (pack_for_cpu)
        self.norm_kernel = None  # CPU pre-norm models: fused residual add + RMSNorm (use_cpu_kernels)
        self.cpu_stack = CpuDecodeStack()  # their decode steps' layers in one call, where they can go
        self.fused = None  # CUDA: the fused forward's layers (use_gpu_kernels)
        # Tensor parallelism (engine/models/tp.py): gathers the head's vocabulary shards to rank 0; None = whole head.
        self.vocab_gather = None

    def reset_kv_scales(self, device: torch.device) -> None:
        """Every layer's fp8 KV scales to 1.0 (Attention.reset_kv_scales); the loaders call it after to_empty."""
        for layer in self.layers:
            layer.self_attn.reset_kv_scales(device)

    def pack_for_cpu(self) -> None:
        """Loaded CPU model: every linear and the LM head packed for the CPU's GEMM (engine/cpu/linear.py:
        Tandem's for fp32 on AVX-512, oneDNN's otherwise). The untied head's plain weight is dropped; a tied one
        stays the embedding."""
        for layer in self.layers:  # SiLU(gate) * up in the gate/up GEMM's epilogue where use_cpu_kernels allows
            mlp = layer.mlp
            if isinstance(mlp, MLP) and self._cpu_silu_mul() and type(mlp.gate_up_proj) is nn.Linear:
                mlp.gate_up_proj = fused_gate_up(mlp.gate_up_proj) or mlp.gate_up_proj
        pack_linears(self.layers)
        if self.is_last:
            self.head_packed = pack_weight(self._head_weight())
            self.lm_head = None  # untied: its plain weight is no longer read

    def use_cpu_kernels(self, kernels, dtype: torch.dtype) -> None:
        """CPU model: the fused ops of engine/cpu/fused.cpp: RoPE in place (not after Qwen3/Gemma 3's
        q/k norms) and SiLU * up, both exactly the eager arithmetic, and for pre-norm models residual add +
        RMSNorm: in bf16 its output can differ from eager by a bf16 ulp at a rounding boundary (see the .cpp);
        in fp32 it is PyTorch's arithmetic bit for bit (fp32_norm_lanes checks that on this machine, else the
        eager norm stays), so fp32 stays exactly HF's arithmetic. `kernels` None (the extension does not build
        here) keeps every op eager."""
        if kernels is None:
            return
        bf16 = dtype == torch.bfloat16
        for layer in self.layers:
            if layer.self_attn.q_norm is None:
                layer.self_attn.rope_kernel = kernels
            if isinstance(layer.mlp, MLP) and self._cpu_silu_mul():
                layer.mlp.kernel = kernels
        if self.spec.sandwich_norms or self.spec.norm_unit_offset:
            return
        if bf16:
            self.norm_kernel = kernels
        elif dtype == torch.float32 and (lanes := fp32_norm_lanes(kernels, self.spec.hidden_size,
                                                                    self.spec.rms_norm_eps)):
            self.norm_kernel = Fp32Norm(kernels, lanes)

    def use_gpu_kernels(self, backend) -> None:
        """CUDA model: the layers run the fused forward (engine/models/fused_forward.py: eight launches a layer,
        Triton kernels of engine/models/fused_kernels.py), on the Triton attention `backend`; ValueError
        naming the family it refuses (mixture-of-experts). On CPU tensors only under Triton's interpreter."""
        from engine.models.fused_forward import FusedDecoder  # it imports this module

        self.fused = FusedDecoder(self, backend)

    def _cpu_silu_mul(self) -> bool:
        """Whether the dense MLPs' SiLU(gate) * up runs cpu_fused's silu_mul (or the GEMM epilogue that computes
        the same): that is PyTorch's own vector arithmetic, which eager SiLU runs on whole chunks of two vectors
        (32 values with AVX-512) and finishes a row's tail with a scalar exp: a width of 48 differs in fp32
        (tests/test_cpu_gemm.py)."""
        return self.spec.hidden_act == "silu" and self.spec.intermediate_size % 32 == 0

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The first stage embeds `input_ids`; later stages continue from the previous one's `hidden`.

        keep (last stage only): the rows whose hidden states the caller reads (the step's sampled positions,
        repeats allowed). The last layer still caches every row's K/V, but runs o_proj, the MLP and the final
        norm on these rows only, and the result is [len(keep), hidden] in keep's order: a prefill chunk
        samples from its last position alone, so the rest of the last layer's work on a 300-token prompt was
        thrown away (SmolLM2-135M: ~3% of a prefill's FLOPs, one layer of 30)."""
        if keep is not None and not self.is_last:
            raise ValueError("keep selects rows of the final hidden states: only the last stage takes it")
        x = self.embed(input_ids) if self.is_first else hidden  # [T, hidden]
        if self.fused is not None:  # CUDA: reads the RoPE tables at `positions` inside its kernels
            return self.fused.forward(x, positions, kv_caches, meta, keep)
        rope = self.rotary.tables(positions, x.dtype)
        rope_local = self.rotary_local.tables(positions, x.dtype) if self.rotary_local is not None else rope
        last = len(self.layers) - 1
        if self.norm_kernel is not None:
            return self._forward_fused(x, rope, kv_caches, meta, keep)
        group = self.kv_group
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope_local if layer.local_rope else rope, kv, meta.for_group(group[i]),
                      keep if i == last else None)
        return self.norm(x) if self.is_last else x

    def sampled_hidden(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                       sampled: torch.Tensor, hidden: torch.Tensor | None = None,
                       prune: bool = True) -> torch.Tensor:
        """The final hidden states of the `sampled` rows, [len(sampled), hidden] in their order (last stage). A
        step with rows it does not sample (prefill chunks) runs its last layer past the attention on these alone
        (`keep`), unless `prune` is off; otherwise every row is computed and these selected."""
        keep = sampled if prune and sampled.shape[0] < positions.shape[0] else None
        x = self(input_ids, positions, kv_caches, meta, hidden=hidden, keep=keep)
        return x if keep is not None else x.index_select(0, sampled)

    def _forward_fused(self, x, rope, kv_caches, meta, keep) -> torch.Tensor:
        h, residual, last, group = x, None, len(self.layers) - 1, self.kv_group
        whole = None if keep is not None else self.cpu_stack(self, x, rope, kv_caches, meta)
        if whole is not None:  # a decode step: every layer in one call, the same kernels (engine/cpu/decode_stack.py)
            h, residual = whole
        else:
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                h, residual = layer.forward_fused(h, residual, rope, kv, meta.for_group(group[i]), self.norm_kernel,
                                                  keep if i == last else None)
        if self.is_last:
            return add_rms_norm(self.norm_kernel, self.norm, h, residual)[0]
        return h + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.spec.embed_scale is None:
            return x
        return x * rounded(self.spec.embed_scale, x.dtype)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, vocab] float32 (soft-capped in the model dtype first for Gemma 2, as HF does); written into
        `out` (a fixed buffer) when given. Last stage only."""
        if self.head_packed is not None:
            logits = packed_linear(hidden, self.head_packed)
        else:
            logits = F.linear(hidden, self._head_weight())
        logits = softcap(logits, self.spec.final_softcap)
        if self.vocab_gather is not None:
            return self.vocab_gather(logits, out)
        return logits.float() if out is None else out.copy_(logits)
