from torchtitan_autoparallel.config.job_config import JobConfig
from torchtitan_autoparallel.config.parser import load_config
from torchtitan_autoparallel.config.validate import accumulation_steps, resolve_degrees

__all__ = ["JobConfig", "accumulation_steps", "load_config", "resolve_degrees"]
