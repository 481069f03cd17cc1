"""Attention backends behind a small registry.

- "torch": pure PyTorch (gather pages + SDPA). The reference every kernel is tested against; on CUDA it
  works but builds its per-step plan on the host (not capturable, synchronizes).
- "cpu": the CPU default: "torch" with decode rows and multi-token chunks through native paged kernels
  (decode_attention.cpp, prefill_attention.cpp, built at first use; prefill for head sizes 64/128 and the dtypes the CPU
  has instructions for, else SDPA); "auto" falls back to "torch" where they do not build.
- "triton": Triton kernels (engine/attention/triton_paged.py). The CUDA default; needs the triton package.
- "flash_attn": flash-attn's paged kernels, only when flash_attn is importable and block_size % 256 == 0.
"auto" picks flash_attn, then triton, then torch on CUDA, and cpu (else torch) on CPU.
Every backend takes per-call LayerAttention (sliding window, score soft-cap), so models whose layers differ
(Gemma 2/3) run on any of them; flash_attn needs flash-attn >= 2.6 for the soft-cap (resolve_backend passes
over an older one for a soft-capped model).
"""

from __future__ import annotations

import logging

import torch

from engine.attention import flash, triton_paged
from engine.cpu import kernels as cpu_native
from engine.attention.metadata import AttentionMetadata, LayerAttention
from engine.attention.torch_paged import CpuPagedAttention, TorchPagedAttention, store_kv

_BACKENDS = {"torch": TorchPagedAttention, "cpu": CpuPagedAttention, "triton": triton_paged.TritonPagedAttention,
             "flash_attn": flash.FlashAttnPagedAttention}
BACKEND_NAMES = ("auto", *_BACKENDS)
logger = logging.getLogger(__name__)


def get_backend(name: str, **kwargs):
    """Instantiate the backend called `name`; the error lists the valid names."""
    try:
        cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(sorted(_BACKENDS))}") from None
    return cls(**kwargs)


def resolve_backend(name: str, device: torch.device, block_size: int, softcap: bool = False,
                    kv_cast: bool = False) -> str:
    """The backend `name` ("auto" or a registry name) means on `device`; ValueError if it cannot run there.
    `softcap`: the model soft-caps attention scores (Gemma 2), which flash-attn before 2.6 cannot do; "auto"
    then passes over it, and naming it is an error rather than a failure inside flash-attn at the first step.
    `kv_cast`: the KV cache is stored in another dtype than the model's (EngineConfig.kv_cache_dtype), which
    flash-attn's kernels cannot read; the others convert (and dequantize fp8) as they read."""
    if name == "auto":
        if device.type != "cuda":
            return "cpu" if device.type == "cpu" and cpu_native.load() is not None else "torch"
        if flash.AVAILABLE and block_size % flash.BLOCK_MULTIPLE == 0 and not kv_cast:
            if not softcap or flash.supports_softcap():
                return "flash_attn"
            logger.info("attention backend: not flash_attn, whose installed version (< 2.6) cannot soft-cap "
                        "this model's attention scores")
        return "triton" if triton_paged.AVAILABLE else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "triton" and not triton_paged.usable_on(device):
        why = "the triton package is not installed" if not triton_paged.AVAILABLE else \
            f"it runs on cuda (or on cpu under TRITON_INTERPRET=1), not on {device.type}"
        raise ValueError(f"attention_backend 'triton' cannot run here: {why}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on cpu, not on {device.type}")
    if name == "flash_attn":
        flash.check_usable(device, block_size)
        if kv_cast:
            raise ValueError("attention_backend 'flash_attn' reads a KV cache in the model's dtype only; with "
                             "kv_cache_dtype other than 'auto' use 'triton' or 'torch'")
        if softcap and not flash.supports_softcap():
            raise ValueError("attention_backend 'flash_attn' cannot soft-cap this model's attention scores "
                             "(attn_logit_softcapping): the installed flash-attn is older than 2.6; upgrade it, "
                             "or use 'triton' or 'torch'")
    return name


__all__ = ["AttentionMetadata", "BACKEND_NAMES", "CpuPagedAttention", "LayerAttention", "TorchPagedAttention",
           "get_backend", "resolve_backend", "store_kv"]
