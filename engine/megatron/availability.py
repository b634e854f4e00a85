"""Whether the optional extras are importable, and the one-line errors that say which extra to install.

megatron-core and Transformer Engine stay optional: nothing here imports them at module import time, so the
engine imports cleanly without either, and a config that asks for them fails with an install hint.
"""

from __future__ import annotations

import importlib.util
from functools import cache

MEGATRON_HINT = "pip install -e '.[megatron]'"
TE_HINT = "pip install -e '.[te]'"


class MissingExtraError(ImportError):
    """An option needs an optional dependency that is not installed; the message names the extra."""


@cache
def available() -> bool:
    """True when `megatron.core` imports (megatron-core 0.16.x on Python 3.11, 0.19.x on 3.12 are supported)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return False
    try:
        import megatron.core  # noqa: F401
    except Exception:  # a broken install counts as absent; require() re-raises with the cause
        return False
    return True


def version() -> str | None:
    """megatron-core's version string, or None when it is not installed."""
    if not available():
        return None
    from megatron.core import package_info

    return package_info.__version__


def require(feature: str) -> None:
    """Raise `MissingExtraError` naming `feature` (a config key=value) when megatron-core is missing."""
    if not available():
        raise MissingExtraError(f"{feature} needs megatron-core: {MEGATRON_HINT}")


@cache
def te_available() -> bool:
    """True when `transformer_engine.pytorch` imports (it needs CUDA and a matching build)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises at import without CUDA libraries: treat as absent
        return False
    return True


def require_te(feature: str) -> None:
    """Raise `MissingExtraError` naming `feature` when Transformer Engine is missing."""
    if not te_available():
        raise MissingExtraError(f"{feature} needs Transformer Engine: {TE_HINT}")
