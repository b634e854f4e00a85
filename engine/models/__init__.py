"""Models the engine can build from `model.*` when the user passes none."""

from engine.models.gpt import GPT, TransformerLayer, gpt_loss

__all__ = ["GPT", "TransformerLayer", "gpt_loss"]
