"""Hybrid CPU/GPU optimizer: `HybridDeviceOptimizer`, see hybrid.py for its timeline; `EngineOptimizer`, the
interface the Engine steps through (protocol.py)."""

from engine.optim.hybrid import HybridDeviceOptimizer
from engine.optim.protocol import EngineOptimizer, as_engine_optimizer

__all__ = ["EngineOptimizer", "HybridDeviceOptimizer", "as_engine_optimizer"]
