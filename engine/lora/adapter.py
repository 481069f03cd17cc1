"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into host tensors, checking
everything the engine's batched LoRA does not support so that a bad adapter fails its request with a
ValueError naming the adapter and the problem, never a step."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from engine.lora.request import ADAPTER_CONFIG, LoRARequest
from engine.models.decoder import ModelSpec

WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (the engine's fused linear, its shard within it); engine/models/loader.py fuses the same.
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
_KEY_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter's weights on the host: (layer, PEFT module) -> (A [r, in], B [out, r]), fp32."""

    request: LoRARequest
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def key(self) -> int:
        """Identity of the adapter (name and path): what a device slot holds."""
        return self.request.hash_root


def check_lora_supported(spec: ModelSpec) -> None:
    """Adapters wrap the dense MLP's gate_up / down projections; MoE layers have stacked experts instead."""
    if spec.moe is not None:
        raise ValueError(f"LoRA is not supported for mixture-of-experts models ({spec.family}): adapters target "
                         "dense MLP projections, and routed experts have none; start the engine without LoRA")


def module_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one PEFT target module of the base model."""
    q, kv, h, i = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def load_adapter(request: LoRARequest, spec: ModelSpec, max_rank: int) -> LoRAAdapter:
    name = request.lora_name
    config = _read_config(request)
    rank, scale = _check_config(name, config, max_rank)
    weights = _read_weights(request, spec, rank)
    return LoRAAdapter(request, rank, scale, weights)


def _fail(name: str, problem: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {problem}")


def _read_config(request: LoRARequest) -> dict:
    name, path = request.lora_name, request.lora_path
    if not os.path.isdir(path):
        raise _fail(name, f"{path!r} is not a directory")
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _fail(name, f"no {ADAPTER_CONFIG} in {path!r} (a PEFT adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise _fail(name, f"cannot read {ADAPTER_CONFIG}: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a supported LoRA config; ValueError naming the first unsupported setting."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(name, f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    if config.get("bias", "none") != "none":
        raise _fail(name, f"bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise _fail(name, f"modules_to_save={config['modules_to_save']!r} is not supported")
    if config.get("use_dora"):
        raise _fail(name, "DoRA (use_dora=true) is not supported")
    if config.get("fan_in_fan_out"):
        raise _fail(name, "fan_in_fan_out=true is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _fail(name, f"{key} (per-module ranks or alphas) is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(name, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(name, f"rank {rank} exceeds max_lora_rank={max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(name, f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_weights(request: LoRARequest, spec: ModelSpec, rank: int) -> dict:
    name, path = request.lora_name, os.path.join(request.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise _fail(name, f"no {WEIGHTS_FILE} in {request.lora_path!r} (only safetensors adapters are supported)")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                layer, module, half = _parse_key(name, key, spec)
                halves.setdefault((layer, module), {})[half] = f.get_tensor(key).float()
    except (OSError, RuntimeError) as exc:  # safetensors' own errors (a truncated file) are RuntimeErrors
        raise _fail(name, f"cannot read {WEIGHTS_FILE}: {exc}") from None
    if not halves:
        raise _fail(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    return {where: _pair(name, where, pair, spec, rank) for where, pair in halves.items()}


def _parse_key(name: str, key: str, spec: ModelSpec) -> tuple[int, str, str]:
    m = _KEY_RE.match(key)
    if m is None:
        raise _fail(name, f"unsupported tensor {key!r} (only lora_A/lora_B of decoder-layer projections "
                          f"{', '.join(TARGETS)})")
    layer, module, half = int(m.group(1)), m.group(2), m.group(3)
    if module not in TARGETS:
        raise _fail(name, f"unknown target module {module!r}; supported: {', '.join(TARGETS)}")
    if layer >= spec.num_layers:
        raise _fail(name, f"tensor {key!r} is for layer {layer}, but the base model has {spec.num_layers}")
    return layer, module, half


def _pair(name: str, where: tuple[int, str], pair: dict, spec: ModelSpec, rank: int):
    layer, module = where
    if set(pair) != {"A", "B"}:
        raise _fail(name, f"layer {layer} {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
    a, b = pair["A"], pair["B"]
    fan_in, fan_out = module_shape(spec, module)
    if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
        raise _fail(name, f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                          f"rank {rank} on the base model's {fan_in} -> {fan_out} projection")
    return a.contiguous(), b.contiguous()
