"""Settings of the TEE (Transom's "Eagle Eye" detectors), one frozen dataclass.

Every field is documented where it is declared; a bad value raises
:class:`transom.config.ConfigError` naming the field and what was expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from transom.config import ConfigError

__all__ = ["TEEConfig"]


@dataclass(frozen=True)
class TEEConfig:
    #: A live rank whose step has not advanced for longer than
    #: ``max(hang_timeout, hang_step_factor * median recent step_time)`` seconds of sample time
    #: is hung.
    hang_timeout: float = 10.0
    #: How many median step times without progress count as a hang (slow steps need more slack).
    hang_step_factor: float = 5.0
    #: A node whose newest batch is older than this (wall clock), and from which nothing has
    #: arrived for as long, is lost.
    heartbeat_timeout: float = 6.0
    #: A node whose newest batch was already this old when the heartbeat check saw it is history
    #: being replayed (a TEE that starts from the beginning of the topic), not a node to evict.
    heartbeat_horizon: float = 120.0
    #: ECOD: clean samples a node's window needs before the detector scores anything.
    ecod_min_samples: int = 30
    #: ECOD: most samples kept in a node's window (the oldest are dropped).
    ecod_window: int = 120
    #: ECOD: refit the model on the window once every this many scored samples.
    ecod_refit_every: int = 10
    #: ECOD: consecutive samples above the fitted threshold before an ANOMALY fault.
    ecod_consecutive: int = 5
    #: ECOD: share of the window taken as outliers when the threshold is fitted (pyod's
    #: ``contamination``); lower means fewer false alarms and later detection.
    ecod_contamination: float = 0.005
    #: How many emitted fault ids the engine remembers to drop repeats (oldest forgotten first).
    dedup_capacity: int = 100_000

    def __post_init__(self) -> None:
        for f in ("hang_timeout", "hang_step_factor", "heartbeat_timeout", "heartbeat_horizon"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a positive number of seconds")
        for f in ("ecod_min_samples", "ecod_window", "ecod_refit_every", "ecod_consecutive", "dedup_capacity"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a positive integer")
        if self.ecod_min_samples < 5:
            raise ConfigError(f"TEE setting ecod_min_samples={self.ecod_min_samples}: expected at least 5")
        if self.ecod_window < self.ecod_min_samples:
            raise ConfigError(f"TEE setting ecod_window={self.ecod_window}: must be at least "
                              f"ecod_min_samples ({self.ecod_min_samples})")
        if not 0 < self.ecod_contamination < 0.5:
            raise ConfigError(f"TEE setting ecod_contamination={self.ecod_contamination!r}: "
                              "expected a share between 0 and 0.5")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TEEConfig":
        """Build from a mapping (YAML, CLI); unknown keys raise :class:`ConfigError`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown TEE setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in values.items() if v is not None})
