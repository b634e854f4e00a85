"""The optional extras in one place: whether they import, the one-line errors that say which extra to install,
and whether a model in hand comes from one of them.

megatron-core and Transformer Engine stay optional: nothing here imports them at module import time, so the
engine imports cleanly without either, and a config that asks for them fails with an install hint.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import cache

from torch import nn

MEGATRON_HINT = "pip install -e '.[megatron]'"
TE_HINT = "pip install -e '.[te]'"


class MissingExtraError(ImportError):
    """An option needs an optional dependency that is not installed; the message names the extra."""


@cache
def _import_error(module: str) -> str | None:
    """None when `module` imports; else why not ("absent" when it is not installed at all)."""
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return "absent"
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure means the extra is unusable; say which
        return f"{type(e).__name__}: {e}"
    return None


def _hint(module: str, hint: str) -> str:
    why = _import_error(module)
    # installed but failing (megatron-core 0.19 imports triton unconditionally, say): name the real cause
    return hint if why == "absent" else f"{hint} ({module} is installed but does not import: {why})"


def available() -> bool:
    """True when `megatron.core` imports (megatron-core 0.16.x on Python 3.11, 0.19.x on 3.12 are supported)."""
    return _import_error("megatron.core") is None


def version() -> str | None:
    """megatron-core's version string, or None when it is not installed."""
    if not available():
        return None
    from megatron.core import package_info

    return package_info.__version__


def require(feature: str) -> None:
    """Raise `MissingExtraError` naming `feature` (a config key=value) when megatron-core is missing."""
    if not available():
        raise MissingExtraError(f"{feature} needs megatron-core: {_hint('megatron.core', MEGATRON_HINT)}")


def te_available() -> bool:
    """True when `transformer_engine.pytorch` imports (it needs CUDA libraries and a matching build)."""
    return _import_error("transformer_engine.pytorch") is None


def te_missing() -> str | None:
    """Why Transformer Engine cannot be used here ("needs Transformer Engine: <how to install>"), or None."""
    return None if te_available() else f"needs Transformer Engine: {_hint('transformer_engine.pytorch', TE_HINT)}"


def require_te(feature: str) -> None:
    """Raise `MissingExtraError` naming `feature` when Transformer Engine is missing."""
    if (why := te_missing()) is not None:
        raise MissingExtraError(f"{feature} {why}")


def is_megatron_gpt(model: nn.Module) -> bool:
    """True for a megatron-core GPTModel. A model of megatron-core's means megatron.core is imported already,
    so this never imports it (which takes seconds) for any other model."""
    if "megatron.core" not in sys.modules or not available():
        return False
    from megatron.core.models.gpt import GPTModel

    return isinstance(model, GPTModel)
