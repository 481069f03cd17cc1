"""A simulated accelerator (`device="sim"`): the host side of the engine is the real code, the device's time
is modelled on a virtual clock (device.py) by a cost model (cost_model.py), and its tokens are a
deterministic function of the request (tokens.py). `SIM_MODELS` holds config-only model directories with
real shapes (no weights: nothing is computed)."""

from pathlib import Path

from engine.sim.cost_model import PROFILES, SIM_GPUS, CostModel, GpuProfile, StepShape

SIM_MODELS = Path(__file__).parent / "models"

__all__ = ["CostModel", "GpuProfile", "PROFILES", "SIM_GPUS", "SIM_MODELS", "StepShape"]
