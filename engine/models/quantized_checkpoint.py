"""A checkpoint directory's quantization: config.json's `quantization_config` read as transformers reads it,
dispatched by quant_method to the loader that serves it, and the directory's tensors by name.

- "gptq", "awq": int4, engine/models/int4_loader.py (CPU, Q4_1 blocks);
- "compressed-tensors", "fbgemm_fp8": FP8, engine/models/fp8_loader.py (CPU and CUDA).

Anything else is refused by name, here, before a weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from engine.models.fp8_loader import Fp8Scheme
    from engine.models.int4_loader import Int4Scheme


def quantization_config(model_dir: str | Path) -> dict | None:
    """config.json's quantization_config, or None (read as JSON: cheap enough for EngineConfig's checks)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # no readable config: the checkpoint's own load reports it
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def checkpoint_scheme(model_dir: str | Path) -> Int4Scheme | Fp8Scheme | None:
    """The quantization scheme of a checkpoint directory, None when it is not quantized; ValueError for a
    quantization Tandem does not run."""
    from engine.models.fp8_loader import FP8_METHODS, fp8_scheme  # they read tensors through Checkpoint below
    from engine.models.int4_loader import INT4_METHODS, int4_scheme

    qc = quantization_config(model_dir)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method in INT4_METHODS:
        return int4_scheme(qc)
    if method in FP8_METHODS:
        return fp8_scheme(qc)
    raise ValueError(f"quantization_config quant_method={qc.get('quant_method')!r} is not supported; valid: "
                     f"{', '.join(INT4_METHODS)} (int4, CPU), {', '.join(FP8_METHODS)} (FP8)")


def in_stage(name: str, first: int, end: int) -> bool:
    """Whether checkpoint tensor `name` is one of layers first..end-1 (a pipeline stage's) or outside the layers
    (embedding, head: the quantized loaders refuse those quantized on every stage)."""
    return not name.startswith("model.layers.") or first <= int(name.split(".")[2]) < end


class Checkpoint:
    """The directory's tensors by name across its safetensors files, read on demand."""

    def __init__(self, model_dir: str):
        from engine.models.loader import _safetensors_files

        self.where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' dtype names: "F8_E4M3", "BF16", ...
        for path in _safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    self.where[name] = path
                    self.dtypes[name] = f.get_slice(name).get_dtype()
        self.model_dir = model_dir

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"checkpoint {self.model_dir!r} lacks tensor {name!r}")
        with safe_open(str(self.where[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)
