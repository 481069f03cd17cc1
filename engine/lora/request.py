"""Which adapter a request asks for, and how adapter names map to directories (no torch: the ingress and the
router import this).

Names come from two places, as in vLLM / Ray Serve LLM: `lora_modules` ({name: path}, fixed at start) and
`lora_dir` (every subdirectory holding an adapter_config.json is an adapter named after it, found at first
use). A request names one as `BASE:ADAPTER` (Ray Serve LLM's convention) or by the adapter's own name.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ADAPTER_CONFIG = "adapter_config.json"
MAX_LORA_RANK = 64  # the largest max_lora_rank an engine accepts


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name and local PEFT directory. `hash_root` seeds the prefix-cache
    hash chain of the request's blocks (engine/block_manager.py), so KV computed under one adapter is never
    served to another, and the router can compute the same chain for prefix affinity."""

    lora_name: str
    lora_path: str
    lora_int_id: int = 0  # accepted for vLLM compatibility; adapters are keyed by name and path
    hash_root: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must be a non-empty string")
        path = os.path.abspath(self.lora_path)
        object.__setattr__(self, "lora_path", path)
        digest = hashlib.blake2b(f"lora\0{self.lora_name}\0{path}".encode(), digest_size=16).digest()
        object.__setattr__(self, "hash_root", int.from_bytes(digest, "little"))


def valid_adapter_name(name: str) -> bool:
    """A name that can be a subdirectory of lora_dir and nothing else (no separators, no '..')."""
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None and ".." not in name


def find_adapter(name: str, modules: dict[str, str] | None, lora_dir: str | None) -> LoRARequest | None:
    """The adapter called `name`: a configured module, else a subdirectory of lora_dir holding an
    adapter_config.json; None when there is none (the caller answers model_not_found)."""
    if modules and name in modules:
        return LoRARequest(name, modules[name])
    if lora_dir and valid_adapter_name(name):
        path = os.path.join(lora_dir, name)
        if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
            return LoRARequest(name, path)
    return None


def list_adapters(modules: dict[str, str] | None, lora_dir: str | None) -> list[LoRARequest]:
    """Every adapter a request may name right now: the configured ones, then lora_dir's, sorted by name."""
    found = {name: LoRARequest(name, path) for name, path in (modules or {}).items()}
    if lora_dir and os.path.isdir(lora_dir):
        for name in sorted(os.listdir(lora_dir)):
            if name not in found and find_adapter(name, None, lora_dir) is not None:
                found[name] = LoRARequest(name, os.path.join(lora_dir, name))
    return list(found.values())


def split_model_name(model: str, base: str) -> str | None:
    """The adapter part of a request's `model`: "BASE:ADAPTER" -> ADAPTER, BASE -> None (the base model),
    anything else -> itself (an adapter's own name)."""
    if model == base:
        return None
    prefix = base + ":"
    return model[len(prefix):] if model.startswith(prefix) else model
