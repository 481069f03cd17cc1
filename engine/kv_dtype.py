"""EngineConfig.kv_cache_dtype: the dtype the paged KV cache is stored in, resolved in one place, and how the
PyTorch paths write and read a cache of another dtype than the model's.

- "auto": the model's dtype.
- "bfloat16": bf16 K/V. With a float32 model on CPU it halves the cache: K/V are rounded to bf16 when stored
  and widened back to fp32 when read (the CPU kernels take fp32 queries over bf16 K/V, fp32 arithmetic). With
  a bf16 model it is the same as "auto"; on CUDA with an fp32 or fp16 model the Triton kernels convert too.
- "fp8" / "fp8_e4m3" (vLLM's names; "fp8" means e4m3): torch.float8_e4m3fn K/V on CUDA (GPUs with fp8
  conversions: compute capability 8.9 or later, which Triton's fp8e4nv needs) and on the simulated device; on CPU
  only through the PyTorch attention backend (attention_backend="torch": slow, a reference for what fp8 storage
  does to a model's outputs, since its stores round exactly as the Triton kernels do).
  A value is stored as x / scale rounded to nearest even and saturated at +-448 (e4m3's largest finite value,
  as vLLM saturates) and read back as stored * scale. The scales are per tensor and per layer (`k_scale`,
  `v_scale` on each decoder layer's Attention) and 1.0 unless calibrated: what vLLM uses when a checkpoint
  carries no calibrated scales. Written K/V is never rescaled, so a scale must not change once the cache
  holds data.

docs/engine.md#kv-cache-dtype says where each runs and what was measured.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
FP8_NAMES = ("fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
FP8_MIN_CAPABILITY = (8, 9)  # Triton converts to and from fp8e4nv from sm_89 (Ada, Hopper) on

# What the Triton kernels do with a cache value (kv_mode): store and read as is, convert between the model's
# dtype and the cache's, or quantize / dequantize fp8 with the layer's scale.
KV_SAME, KV_CAST, KV_FP8 = 0, 1, 2


def check_name(name: str, device: str, backend: str | None = None) -> None:
    """Config-time check: a known name, and fp8 not on an explicit CPU device (but for the torch attention backend;
    device "auto" is checked when the engine resolves it, resolve_kv_dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    if name in FP8_NAMES and device == "cpu" and backend != "torch":
        raise ValueError(_fp8_not_here(name, "cpu"))


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device | str,
                     backend: str | None = None) -> torch.dtype:
    """The dtype the KV cache is stored in for `name` with a model in `model_dtype` on `device` (a torch device,
    or "sim" for the simulated accelerator, whose runner checks its GPU profile). ValueError naming the value
    and where it runs when it cannot run here."""
    check_name(name, "", backend)
    kind = device if isinstance(device, str) else device.type
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        if kind == "cpu" and model_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype='bfloat16' on cpu needs a float32 or bfloat16 model (the CPU "
                             f"kernels' dtypes), not {model_dtype}")
        return torch.bfloat16
    if kind not in ("cuda", "sim") and not (kind == "cpu" and backend == "torch"):
        raise ValueError(_fp8_not_here(name, kind))
    if kind == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype={name!r} needs a GPU of compute capability 8.9 or later (fp8 "
                         f"conversions in Triton); this one is {major}.{minor}: use 'auto' or 'bfloat16'")
    return FP8_DTYPE


def _fp8_not_here(name: str, device: str) -> str:
    return (f"kv_cache_dtype={name!r} (an fp8 KV cache) runs on cuda (compute capability 8.9+) and on "
            f"device='sim', not on {device}; on cpu use 'auto' or 'bfloat16' (half the bytes of an fp32 cache), or "
            f"attention_backend='torch' (slow: a reference for fp8's accuracy)")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def kv_mode(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """KV_SAME, KV_CAST or KV_FP8: what the kernels do with the values they store and read."""
    if cache_dtype == model_dtype:
        return KV_SAME
    return KV_FP8 if is_fp8(cache_dtype) else KV_CAST


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows `x` as the cache stores them: cast, or for fp8 x / scale rounded and saturated (module doc)."""
    if x.dtype == cache_dtype:
        return x
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    y = x.float() if scale is None else x.float() / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached rows `x` back in `dtype` (the model's): widened, or for fp8 stored * scale computed in fp32."""
    if x.dtype == dtype:
        return x
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.float() if scale is None else x.float() * scale
    return y.to(dtype)


def bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """`cache` as uint8 when its elements are one byte: some torch ops (index_copy_ on CPU) have no fp8 kernels,
    and copying the bytes is the same copy."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
