"""Attention backends behind a small registry (GPU kernels register here in the GPU runtime)."""

from __future__ import annotations

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_paged import TorchPagedAttention, store_kv

_BACKENDS = {"torch": TorchPagedAttention}


def get_backend(name: str, **kwargs):
    """Instantiate the backend called `name`; the error lists the valid names."""
    try:
        cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(sorted(_BACKENDS))}") from None
    return cls(**kwargs)


__all__ = ["AttentionMetadata", "TorchPagedAttention", "get_backend", "store_kv"]
