"""Batched multi-LoRA in the forward: every targeted linear adds scale * (x A^T) B^T with each token's own
adapter, for a batch whose rows use different adapters (or none).

Layout, per wrapped linear (the decoder's fused qkv_proj / gate_up_proj, o_proj, down_proj): the adapters
of all `max_loras` slots stacked along the rank axis, A as [S * n * R, in] and B as [out, S * n * R]
(S slots, n = the fused shards: 3 for qkv, 2 for gate_up, R = max_lora_rank). A fused linear's shards
each get their own R-wide block of the rank axis and B is block-diagonal over the shards, so one pair of
GEMMs serves q, k and v; an adapter of smaller rank, or one not targeting a shard, is zero there.

Per forward, the step's per-token slot index (a fixed-address step field, engine/step_buffers.py) picks a
row of `scales` [S + 1, S]: row s holds the adapter's scale at column s - 1, row 0 (no adapter) is zeros.
That [T, S] mask multiplies x A^T per slot block, so each token keeps only its adapter's part:
    y = base(x) + ((x A^T) * mask[:, slot]) B^T
Everything has fixed shapes and addresses and nothing branches on values, so decode steps stay CUDA-graph
safe; adapters are swapped by copying into the stacked tensors in stream order (load_slot).

Cost: this computes every slot's x A^T for every token (S times the useful FLOPs of the down-projection
to rank R, and B over the full stacked rank), which is cheap at small S * R but wasteful at many slots.
A GPU kernel would change exactly that: punica's BGMV (decode: one token per row, gather each row's A/B by
its slot index) and SGMV / vLLM's Triton LoRA kernels (prefill: tokens grouped into segments of one
adapter) compute only each token's own adapter, with rank-padded weights read once per segment.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.lora.adapter import TARGETS, check_lora_supported, module_shape
from engine.models.decoder import DecoderLM, ModelSpec

# the decoder's linear -> the PEFT modules fused into it, in shard order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRAContext:
    """What every wrapped linear of one model reads per forward: the [T, S] mask of the step's tokens."""

    def __init__(self, max_loras: int, device: torch.device, dtype: torch.dtype):
        self.scales = torch.zeros(max_loras + 1, max_loras, dtype=dtype, device=device)
        self.mask: torch.Tensor | None = None

    def prepare(self, token_slots: torch.Tensor, active: bool = True) -> None:
        """token_slots [T] int: each token's slot (0 = none); called at the top of every forward. `active`
        False (a host-side fact: no token of the step uses an adapter) skips LoRA in an eager forward; a
        graph always runs it (its kernels are fixed at capture)."""
        self.mask = self.scales.index_select(0, token_slots) if active else None  # [T, S]


class LoRALinear(nn.Module):
    """A base linear plus the stacked adapters of every slot. The base is any module mapping [T, in] to [T, out]
    in the adapters' dtype (nn.Linear, a packed CPU one, a quantized one: QuantLinear, Fp8Linear): only its
    output is read, and the shapes come from the spec."""

    def __init__(self, base: nn.Module, ctx: LoRAContext, spec: ModelSpec, modules: tuple[str, ...],
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.ctx, self.modules = base, ctx, modules
        self.num_slots, self.block = max_loras, len(modules) * max_rank  # per-slot width of the rank axis
        self.max_rank = max_rank
        fan_in = module_shape(spec, modules[0])[0]
        outs = [module_shape(spec, m)[1] for m in modules]
        self.out_offsets = [sum(outs[:i]) for i in range(len(outs))]
        self.register_buffer("lora_a", torch.zeros(max_loras * self.block, fan_in, dtype=dtype, device=device),
                             persistent=False)  # [S * n * R, in]
        self.register_buffer("lora_b", torch.zeros(sum(outs), max_loras * self.block, dtype=dtype,
                                                   device=device), persistent=False)  # [out, S * n * R]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        if self.ctx.mask is None:  # an eager step without adapter rows
            return y
        t = x.shape[0]
        h = torch.mm(x, self.lora_a.t()).view(t, self.num_slots, self.block)  # [T, S, n * R]
        h = (h * self.ctx.mask.unsqueeze(-1)).view(t, -1)
        return y.addmm_(h, self.lora_b.t())

    def load_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one adapter's (A, B) per PEFT module into `slot` (1-based), zeroing what it does not target."""
        cols = slice((slot - 1) * self.block, slot * self.block)
        a, b = self.lora_a[cols], self.lora_b[:, cols]
        a.zero_()
        b.zero_()
        for shard, module in enumerate(self.modules):
            pair = weights.get(module)
            if pair is None:
                continue
            lo_a, lo_b = pair
            r, start = lo_a.shape[0], shard * self.max_rank
            a[start:start + r].copy_(lo_a)
            out0 = self.out_offsets[shard]
            b[out0:out0 + lo_b.shape[0], start:start + r].copy_(lo_b)


class LoRAModel:
    """The wrapped linears of one DecoderLM and their shared context."""

    def __init__(self, model: DecoderLM, max_loras: int, max_rank: int):
        check_lora_supported(model.spec)
        spec, weight = model.spec, next(model.parameters())
        dtype, device = weight.dtype, weight.device
        self.ctx = LoRAContext(max_loras, device, dtype)
        self.first_layer = model.layer_range[0]
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.layers:
            wrapped = {}
            for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                lin = LoRALinear(getattr(parent, name), self.ctx, spec, FUSED[name], max_loras, max_rank, dtype,
                                 device)
                setattr(parent, name, lin)
                wrapped[name] = lin
            self.layers.append(wrapped)

    def prepare(self, token_slots: torch.Tensor, active: bool = True) -> None:
        self.ctx.prepare(token_slots, active)

    @torch.inference_mode()
    def load_slot(self, slot: int, adapter) -> None:
        """Copy `adapter` (engine.lora.adapter.LoRAAdapter) into device slot `slot`, in stream order."""
        per_layer: dict[int, dict[str, dict]] = {}
        for (layer, module), pair in adapter.weights.items():
            per_layer.setdefault(layer, {}).setdefault(TARGETS[module][0], {})[module] = pair
        for i, wrapped in enumerate(self.layers):
            mine = per_layer.get(i + self.first_layer, {})
            for name, lin in wrapped.items():
                lin.load_slot(slot, mine.get(name, {}))
        self.ctx.scales[slot].zero_()
        self.ctx.scales[slot, slot - 1] = adapter.scale
