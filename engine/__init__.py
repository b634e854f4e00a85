"""offload-engine: a declarative training engine for PyTorch built around CPU offloading.

import engine
eng, optimizer, scheduler = engine.initialize(model=model, config="configs/default.json")
loss = eng.train_batch(data_iter)
engine.plan("configs/13b-h200.json", gpu_budget_bytes=139 << 30).gpu.parts   # the memory plan, by part
"""

from engine.config import Config, ConfigError, load_config
from engine.engine import Engine, initialize
from engine.planning import plan
from engine.planning.oom import PlannedOutOfMemoryError

__all__ = ["Config", "ConfigError", "Engine", "PlannedOutOfMemoryError", "initialize", "load_config", "plan"]
