from torchtitan_autoparallel.config.job_config import JobConfig
from torchtitan_autoparallel.config.parser import load_config
from torchtitan_autoparallel.config.validate import resolve_degrees

__all__ = ["JobConfig", "load_config", "resolve_degrees"]
