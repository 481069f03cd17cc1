"""Mixture-of-experts feed-forward blocks for the one decoder: Qwen2-MoE, Qwen3-MoE and Mixtral.

The three families share one block: a router (`gate`, [E, hidden], no bias) scores every expert, the softmax
over those scores (fp32) picks the top-k experts per token, their probabilities are renormalised to sum to 1
when the config says so (Mixtral always; Qwen's `norm_topk_prob`, false in the Qwen1.5/2 checkpoints, true
in Qwen3's), and the token's output is the probability-weighted sum of its experts' SiLU-gated MLPs.
Qwen2-MoE adds a shared expert every token runs, scaled by sigmoid(shared_expert_gate(x)). Which layers route
(the rest keep a dense MLP of `intermediate_size`) follows HF: layer i routes unless it is in
`mlp_only_layers` or (i + 1) % decoder_sparse_step != 0; Mixtral routes in every layer.

Expert weights are stacked for batched execution, as transformers 5.x holds them in memory: `gate_up_proj`
[E, 2 * I, hidden] (gate rows first, then up) and `down_proj` [E, hidden, I]. Checkpoints come either that
way (a saved state_dict) or per expert (every hub checkpoint, and what save_pretrained writes):
`mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2.weight`;
`checkpoint_target` maps both onto the stacked parameters.

Execution: on CUDA the Triton fused-MoE kernels (engine/models/moe_triton.py: grouped GEMMs over the
token-expert pairs sorted by expert, no host synchronisation, so decode stays graph-capturable); elsewhere
`grouped_experts` sorts the pairs by expert and runs each active expert once on its contiguous group of
tokens (index_select, one gate_up and one down matmul, index_add_ of the weighted rows), experts in id order
as HF's eager loop does, so fp32 results match HF's to rounding.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
# Per-expert checkpoint names -> (stacked parameter, which of its slots): gate is slot 0 of gate_up_proj, up 1.
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_SLOT = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True, slots=True)
class MoESpec:
    """How an MoE family routes, normalised from its HF config (`moe_spec`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert (Qwen's moe_intermediate_size, Mixtral's intermediate_size)
    renormalize: bool  # top-k probabilities divided by their sum (Mixtral; Qwen's norm_topk_prob)
    sparse_layers: tuple[bool, ...]  # per global layer: routed experts, else a dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0 = none
    # HF scales the expert outputs by fp32 routing weights in Mixtral, by weights cast to the model dtype in
    # Qwen (the same in fp32; in bf16 the product rounds differently).
    fp32_weights: bool = False

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.intermediate_size <= 0:
            raise ValueError(f"expert intermediate size must be positive, got {self.intermediate_size}")


def moe_spec(config, family: str, hidden_act: str) -> MoESpec | None:
    """The routing facts of an MoE family's config; None for dense families."""
    if family not in MOE_FAMILIES:
        return None
    if hidden_act != "silu":
        raise ValueError(f"{family} with hidden_act {hidden_act!r}: MoE experts support silu only")
    layers = config.num_hidden_layers
    if family == "mixtral":
        return MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.intermediate_size, renormalize=True,
                       sparse_layers=(True,) * layers, fp32_weights=True)
    step = config.decoder_sparse_step
    if step is None or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    dense = set(config.mlp_only_layers or ())
    sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
    return MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                   sparse_layers=sparse,
                   shared_intermediate_size=config.shared_expert_intermediate_size if family == "qwen2_moe" else 0)


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), HF's arithmetic: softmax in
    fp32, top-k of the probabilities, renormalised when the spec says so."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, act: Callable = F.silu) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H], gate_up [E, 2I, H], down [E, H, I].

    The (token, expert) pairs are sorted by expert; each expert that got any runs once on its contiguous
    group. The group sizes are read on the host (one sync), so this is the CPU / fallback path; CUDA uses the
    Triton kernels. `weights` are applied in their own dtype before the rows are added in x's dtype."""
    num_experts, k = gate_up.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T * k] pair indices, grouped by expert
    tokens = order // k  # the token each sorted pair reads
    pair_weights = weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # sync-ok: CPU path; CUDA runs moe_triton
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        g, u = F.linear(x.index_select(0, rows), gate_up[expert]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(act(g) * u, down[expert]) * pair_weights[start:start + n, None]  # [n, H]
        out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out


class Router(nn.Module):
    """The expert scores: F.linear with HF's `gate.weight` [E, hidden]; a plain module so CPU packing (which
    replaces nn.Linear) leaves it alone and routing sees the same logits HF computes."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """The routed experts' stacked weights (HF 5.x's in-memory names, so fused checkpoints map one to one)."""

    def __init__(self, hidden_size: int, spec: MoESpec):
        super().__init__()
        e, i = spec.num_experts, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))  # [E, 2I, H]: gate rows, then up
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))  # [E, H, I]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from engine.models import moe_triton
            return moe_triton.fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        return grouped_experts(x, self.gate_up_proj, self.down_proj, weights, ids)


class SparseMoeBlock(nn.Module):
    """Routed experts, plus Qwen2-MoE's gated shared expert (`shared`, the decoder's dense MLP)."""

    def __init__(self, hidden_size: int, spec: MoESpec, shared: nn.Module | None = None):
        super().__init__()
        self.spec = spec
        self.gate = Router(hidden_size, spec.num_experts)
        self.experts = Experts(hidden_size, spec)
        self.shared_expert = shared
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.spec)  # [T, k] each
        if not self.spec.fp32_weights:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def check_device(spec: MoESpec | None, device: torch.device) -> None:
    """MoE on CUDA runs the Triton kernels only (the grouped path syncs on the host, breaking CUDA graphs)."""
    if spec is None or device.type != "cuda":
        return
    from engine.models import moe_triton
    if not moe_triton.AVAILABLE:
        raise ValueError("mixture-of-experts models on CUDA need the triton package (the fused-MoE kernels); "
                         "it is not importable here")


# ---- checkpoint names ----------------------------------------------------------------------------------

def checkpoint_target(rest: str, spec: MoESpec) -> tuple[str, int] | None:
    """A layer-relative checkpoint name (after `model.layers.{i}.`) -> (parameter name relative to the layer,
    slot index), for the router and routed experts; None for everything else (the shared expert, its gate
    and attention map as in dense models). Slots: gate_up_proj holds 2 * E (expert e's gate is 2e, its up
    2e + 1), down_proj E; -1 (the loader's WHOLE) = a stacked tensor filling the whole parameter."""
    rest = rest.replace("block_sparse_moe.", "mlp.", 1)  # Mixtral's pre-5.x module name
    if rest in STACKED:
        return rest, -1
    if rest == "mlp.gate.weight":  # the router (named here for Mixtral's renamed module)
        return rest, 0
    m = _EXPERT_RE.match(rest)
    if m is None:
        return None
    expert, slot = int(m.group(1)), _EXPERT_SLOT[m.group(2)]
    if expert >= spec.num_experts:
        raise ValueError(f"checkpoint tensor {rest!r} names expert {expert}, but num_experts is "
                         f"{spec.num_experts}")
    if slot == 2:
        return STACKED[1], expert
    return STACKED[0], 2 * expert + slot


def is_stacked(pname: str) -> bool:
    return pname.endswith(STACKED)


def stacked_slots(pname: str, spec: MoESpec) -> range:
    return range(2 * spec.num_experts if pname.endswith(STACKED[0]) else spec.num_experts)


def stacked_slot(param: torch.Tensor, pname: str, slot: int) -> torch.Tensor:
    """The view of a stacked parameter one per-expert checkpoint tensor fills."""
    if pname.endswith(STACKED[1]):
        return param[slot]  # [H, I]
    size = param.shape[1] // 2
    return param[slot // 2].narrow(0, (slot % 2) * size, size)  # [I, H]: gate or up rows of one expert
