"""Hybrid CPU/GPU optimizer (issue 3): `HybridDeviceOptimizer`, see hybrid.py for its timeline."""

from engine.optim.hybrid import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
