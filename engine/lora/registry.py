"""Adapter names -> loaded host adapters, for one engine (any thread: requests are validated off the loop)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine.lora.adapter import LoRAAdapter, check_lora_supported, load_adapter
from engine.lora.request import LoRARequest, find_adapter, list_adapters
from engine.models.decoder import ModelSpec

HOST_CACHE_SIZE = 64  # adapters kept on the host once read; a sequence keeps its own adapter alive anyway


class AdapterRegistry:
    """Resolves a request's adapter (a LoRARequest, or a name from `lora_modules` / `lora_dir`) and reads it
    from disk once; later requests for the same adapter share the host copy."""

    def __init__(self, spec: ModelSpec, max_rank: int, modules: dict[str, str] | None = None,
                 lora_dir: str | None = None):
        check_lora_supported(spec)
        self.spec, self.max_rank = spec, max_rank
        self.modules, self.lora_dir = dict(modules or {}), lora_dir
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def request_for(self, lora: LoRARequest | str) -> LoRARequest:
        if isinstance(lora, LoRARequest):
            return lora
        if not isinstance(lora, str):
            raise ValueError(f"lora_request must be a LoRARequest or an adapter name, got {type(lora).__name__}")
        found = find_adapter(lora, self.modules, self.lora_dir)
        if found is None:
            raise ValueError(f"LoRA adapter {lora!r} is not known (lora_modules: {sorted(self.modules)}; "
                             f"lora_dir: {self.lora_dir!r})")
        return found

    def resolve(self, lora: LoRARequest | str) -> LoRAAdapter:
        """The loaded adapter; ValueError naming it when it is unknown or not a supported PEFT LoRA."""
        request = self.request_for(lora)
        with self._lock:
            adapter = self._cache.get(request.hash_root)
            if adapter is not None:
                self._cache.move_to_end(request.hash_root)
                return adapter
        adapter = load_adapter(request, self.spec, self.max_rank)  # outside the lock: disk reads
        with self._lock:
            self._cache[request.hash_root] = adapter
            while len(self._cache) > HOST_CACHE_SIZE:
                self._cache.popitem(last=False)
        return adapter

    def available(self) -> list[LoRARequest]:
        return list_adapters(self.modules, self.lora_dir)
