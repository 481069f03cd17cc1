"""The one decoder (every family in loader.SUPPORTED_FAMILIES, MoE ones included) and the HF checkpoint loader."""

from engine.models.decoder import DecoderLM, ModelSpec
from engine.models.loader import SUPPORTED_FAMILIES, build_model, load_hf_config, model_spec

__all__ = ["DecoderLM", "ModelSpec", "SUPPORTED_FAMILIES", "build_model", "load_hf_config", "model_spec"]
