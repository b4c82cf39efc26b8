"""The proposers: IBM MLP speculators and Medusa heads (draft models are plain HF causal LMs)."""

from .base import CheckpointError, SpeculatorModel
from .medusa import Medusa, MedusaConfig
from .mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

MODEL_TYPES = {"mlp_speculator": MLPSpeculator, "medusa": Medusa}

__all__ = ["CheckpointError", "SpeculatorModel", "Medusa", "MedusaConfig", "MLPSpeculator", "MLPSpeculatorConfig",
           "MODEL_TYPES"]
