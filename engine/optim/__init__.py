"""Hybrid CPU/GPU optimizer: `HybridDeviceOptimizer`, see hybrid.py for its timeline; `EngineOptimizer`, the
interface the Engine steps through (protocol.py)."""

from engine.optim.hybrid import HybridDeviceOptimizer
from engine.optim.options import HybridOptions
from engine.optim.protocol import EngineOptimizer, as_engine_optimizer

__all__ = ["EngineOptimizer", "HybridDeviceOptimizer", "HybridOptions", "as_engine_optimizer"]
