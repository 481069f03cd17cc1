"""flash-attn's paged kernels as an optional backend (imported lazily; never required).

flash-attn has no wheels on the package registry and its paged API needs block_size % 256 == 0, so this
backend is used only where someone installed it and chose such a block size. Decode steps (one token per
sequence) go through flash_attn_with_kvcache, which reads only tensors and can be captured in a CUDA graph;
other steps through flash_attn_varlen_func over the paged pool, which needs the step's maximum lengths from
the host. New K/V are written by the Triton store kernel (flash-attn's own append would need the length
before the append, which the rest of the engine does not keep).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F

from engine.attention import triton_paged
from engine.attention.metadata import AttentionMetadata, LayerAttention
from engine.attention.torch_paged import store_kv

AVAILABLE = importlib.util.find_spec("flash_attn") is not None
BLOCK_MULTIPLE = 256


def check_usable(device: torch.device, block_size: int) -> None:
    if not AVAILABLE:
        raise ValueError("attention_backend 'flash_attn' needs the flash_attn package, which is not installed")
    if device.type != "cuda":
        raise ValueError(f"attention_backend 'flash_attn' runs on cuda, not on {device.type}")
    if block_size % BLOCK_MULTIPLE:
        raise ValueError(f"block_size must be a multiple of {BLOCK_MULTIPLE} for attention_backend "
                         f"'flash_attn'; got {block_size}")


@functools.cache
def supports_softcap() -> bool:
    """Whether the installed flash-attn takes `softcap` (2.6 and later); older ones reject the keyword, so a
    soft-capped model (Gemma 2) must not be routed here (resolve_backend)."""
    if not AVAILABLE:
        return False
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError:
        return False
    return all("softcap" in inspect.signature(fn).parameters
               for fn in (flash_attn_varlen_func, flash_attn_with_kvcache))


class FlashAttnPagedAttention:
    """Paged attention through flash-attn 2.x (rotate-half RoPE is applied by the model beforehand)."""

    name = "flash_attn"
    supports_graphs = True
    supports_mixed_graphs = False  # flash_attn_varlen_func takes the step's max lengths as host ints

    def __init__(self, sliding_window: int | None = None):
        if not AVAILABLE:
            raise ValueError("attention backend 'flash_attn' needs the flash_attn package, which is not installed")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.sliding_window = sliding_window

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to precompute."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                layer: LayerAttention | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
        `layer` None: the backend's own sliding window, no soft-cap. (flash-attn takes `softcap` from 2.6.)
        The cache is in q's dtype (resolve_backend refuses another kv_cache_dtype), so the fp8 scales are unused."""
        layer = layer or LayerAttention(self.sliding_window)
        # flash-attn's window is (left, right) inclusive: HF's sliding window W sees keys i - W + 1 .. i.
        window = (layer.sliding_window - 1, 0) if layer.sliding_window is not None else (-1, -1)
        extra = {} if layer.softcap is None else {"softcap": layer.softcap}
        if triton_paged.usable_on(q.device):
            triton_paged.store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_seqs = meta.seq_lens.shape[0]
        if q.shape[0] == num_seqs:  # decode: one query per sequence, capturable
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                     block_table=meta.block_tables, softmax_scale=scale, causal=True,
                                     window_size=window, **extra)
            return out.squeeze(1)
        cu_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(q, k_cache, v_cache, meta.query_start_loc, cu_k, max(meta.query_lens_host),
                            max(meta.seq_lens_host), softmax_scale=scale, causal=True, window_size=window,
                            block_table=meta.block_tables, **extra)
