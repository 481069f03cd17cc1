"""Multi-LoRA serving: PEFT adapters by name, device slots with LRU eviction, batched LoRA in the forward."""

from engine.lora.request import LoRARequest, find_adapter, list_adapters, split_model_name

__all__ = ["LoRARequest", "find_adapter", "list_adapters", "split_model_name"]
