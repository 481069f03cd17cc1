"""Tandem's per-device inference engine: no Ray, no HTTP."""

from engine.async_engine import AsyncLLM
from engine.config import DEFAULT_MODEL_DIR, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

__all__ = ["AsyncLLM", "DEFAULT_MODEL_DIR", "EngineConfig", "EngineStats", "LLM", "LLMEngine", "LoRARequest",
           "RequestOutput", "SamplingParams", "TokenLogprob"]
