"""Structured output (grammar-constrained decoding): see manager.py for how it rides the pipeline."""

from engine.structured.backend import allocate_bitmask, apply_bitmask
from engine.structured.manager import StructuredOutputManager, TokenConstraint, fill_bitmask

__all__ = ["StructuredOutputManager", "TokenConstraint", "allocate_bitmask", "apply_bitmask",
           "fill_bitmask"]
