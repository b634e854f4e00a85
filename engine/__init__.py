"""offload-engine: a declarative training engine for PyTorch built around CPU offloading.

import engine
eng, optimizer, scheduler = engine.initialize(model=model, config="configs/default.json")
loss = eng.train_batch(data_iter)
"""

from engine.config import Config, ConfigError, load_config
from engine.engine import Engine, initialize

__all__ = ["Config", "ConfigError", "Engine", "initialize", "load_config"]
