"""Keys of torchtitan's own 2025 TOML files that this trainer reads differently.

A job file copied from torchtitan should load as it is: a key renamed since
then is read under its current name, and a key for a feature this trainer
does not have is accepted at the value that leaves the feature off (torchtitan
writes most of them out at that value). Any other value is refused in one
line, so a job never runs without something its file asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_autoparallel.config.job_config import SECTIONS
from torchtitan_autoparallel.errors import ConfigError

# (section, old key) -> the key torchtitan reads it as now
RENAMED: dict[tuple[str, str], str] = {
    ("checkpoint", "enable_checkpoint"): "enable",
    ("model", "hf_assets_path"): "tokenizer_path",  # a folder holding tokenizer.json
    ("validation", "enabled"): "enable",
}


@dataclass(frozen=True)
class Inert:
    """A key for a feature this trainer lacks: ``off`` leaves it off (None: any value
    does, the key only informs tools or the console)."""

    off: Any
    why: str

    @property
    def hint(self) -> Any:
        """The type ``off`` is read as."""
        return list[str] if isinstance(self.off, list) else type(self.off)

    def check(self, name: str, raw: Any, read: Callable[[Any, Any], Any], source: str) -> None:
        """Refuse ``raw`` unless ``read`` (the parser's, for TOML or command-line
        values) gives the value that leaves the feature off."""
        if self.off is not None and read(raw, self.hint) != self.off:
            raise ConfigError(
                f"{name} = {raw!r} in {source} is not supported ({self.why}); "
                f"accepted: {self.off!r}, or leave the key out"
            )


INERT: dict[tuple[str, str], Inert] = {
    ("job", "use_for_integration_test"): Inert(None, "torchtitan's test-suite marker"),
    ("metrics", "disable_color_printing"): Inert(None, "the console log has no colours"),
    ("model", "converters"): Inert([], "float8 and MX training are not supported"),
    ("parallelism", "enable_async_tensor_parallel"): Inert(False, "async TP is not supported"),
    ("activation_checkpoint", "selective_ac_option"): Inert(
        "op", "selective checkpointing is per op, torchtitan's policy; not every N-th layer"
    ),
    ("float8", "enable_fsdp_float8_all_gather"): Inert(False, "float8 training is not supported"),
    ("float8", "precompute_float8_dynamic_scale_for_fsdp"): Inert(False, "float8 training is not supported"),
    ("float8", "filter_fqns"): Inert(None, "float8 training is not supported"),
}
# sections of inert keys alone, such as [float8]
INERT_SECTIONS: dict[str, list[str]] = {
    section: [k for s, k in INERT if s == section] for section, _ in INERT if section not in SECTIONS
}


def translate(section: str, key: str) -> str | Inert:
    """The key to set for ``section.key`` of an old torchtitan file, or the ``Inert``
    that checks its value; keys neither renamed nor inert come back unchanged."""
    if (section, key) in RENAMED:
        return RENAMED[section, key]
    return INERT.get((section, key), key)
