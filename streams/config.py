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
    #: Step limit: a rank whose step has not advanced for longer than
    #: ``max(hang_timeout, hang_step_factor * median recent step_time)`` seconds of sample time is
    #: hung when something shows it is the one stuck (its heartbeat stopped, the kernel says it is
    #: stopped, its peers stepped on without it, or its GPUs idle while its peers' spin); see
    #: :mod:`.hangs`. A job that stands still as a whole is paused, up to the pause limit below.
    hang_timeout: float = 10.0
    #: How many median step times without progress count as a hang (slow steps need more slack). It was
    #: 5 until a corpus of 4-8 s steps found hangs 43 s after onset (p99; 27 s at 3): every rule that
    #: names a rank needs evidence besides the stall, and an eval's steps are 1.6x slower, not 3x.
    hang_step_factor: float = 3.0
    #: A rank heard from by nothing (no report, no heartbeat) for this long is stuck (x4 in a
    #: declared phase, where a long C call may hold the GIL).
    hang_stale_s: float = 5.0
    #: A rank the kernel reports stopped (``stopped = 1``: SIGSTOP, job control; the agent shares its
    #: PID namespace) while its peers are not is hung after this long, or its median step time if
    #: longer, instead of the step limit: a stopped process cannot be in a pause of its own.
    hang_stopped_s: float = 3.0
    #: Pause limit: a job standing still as a whole with no rank standing out is paused for up to
    #: ``max(hang_pause_floor_s, hang_pause_margin * the longest pause it survived)`` seconds (the
    #: floor: a synchronous save to slow storage, or a pause followed by a restore's first slow steps,
    #: stands still for minutes; NVRx's own defaults wait 45-60 min) ...
    hang_pause_floor_s: float = 300.0
    hang_pause_margin: float = 1.5
    #: ... or, while a rank declares a phase (``report(phase=...)``), that phase's ceiling
    #: (``default`` for phases not named). A mapping in YAML, pairs here.
    hang_phase_ceilings: tuple = (("checkpoint", 900.0), ("eval", 3600.0), ("data", 900.0), ("compile", 1800.0),
                                  ("startup", 1200.0), ("restore", 1200.0), ("default", 900.0))
    #: GPU utilisation (mean of a node's GPUs, %) at or above which a node's GPUs spin (ranks
    #: waiting in a collective), and at or below which they idle.
    hang_busy_util: float = 85.0
    hang_idle_util: float = 30.0
    #: A rank whose process writes this many MB a second or more (the agent's ``write_bytes_per_s``, for
    #: ranks in its PID namespace) is saving a checkpoint, as if it declared the phase: rank 0 saving alone,
    #: its GPU idle while the other ranks spin at a barrier, is no hang up to the checkpoint ceiling. 0: off.
    hang_save_write_mb_s: float = 5.0
    #: A node's GPUs that spin while drawing this share or less of the power they drew at its rank's last
    #: step moves wait in a collective (a spin-wait kernel draws a fraction of a compute kernel's power):
    #: a job of long steps shows its stop in power before its stall outlasts a step (a lost node found in
    #: 2 s, a hang limit of ``hang_timeout``). 0 turns the power evidence off (the stall alone decides; in a
    #: job of steps longer than 5 s a lost node is then left to ``heartbeat_timeout``).
    hang_wait_power: float = 0.6
    #: A node from which nothing has arrived for this long (the TEE's own clock, so skewed node
    #: clocks do not matter) is lost. Set for agents that report every second: a node that reports every N > 1
    #: seconds (its agent's ``interval_s``, else the gaps between its batches) is lost after N times as long
    #: (as many missed reports; ``docs/tee.md``, "Agents that report every few seconds").
    heartbeat_timeout: float = 6.0
    #: ... or for this long (for a node that reports every N > 1 seconds: this past its next report, plus N - 1),
    #: when its job stopped stepping as it fell silent and the job's other ranks spin their GPUs (waiting in
    #: a collective for the ranks that never come): a node lost, found within 2 s.
    #: Late metrics leave the job stepping, and a job-wide pause idles its GPUs; on the wall clock the
    #: node's partition must also have been read this far past its newest batch (a worker reading late
    #: proves nothing). Otherwise the heartbeat timeout decides.
    node_lost_fast_s: float = 2.0
    #: A node whose newest batch was already this old when the heartbeat check saw it is history
    #: being replayed (a TEE that starts from the beginning of the topic), not a node to evict.
    heartbeat_horizon: float = 120.0
    #: A node whose agent said it stops (its goodbye batch, sent on SIGTERM: a restart, an upgrade) is lost only
    #: after this long silent, or once its job's other ranks stand waiting for it, not at the heartbeat
    #: timeout (at most ``heartbeat_horizon``).
    heartbeat_bye_grace_s: float = 60.0
    #: "wall": the worker's clock is the host's (live metrics). "event": its clock follows the sample
    #: times it reads (the smallest newest sample time over its partitions), for replaying recorded
    #: metrics faster than real time; heartbeats are then checked at each new second of that clock.
    clock: str = "wall"
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
    #: Soft-fault detectors the engine runs: "peers" (per-window, each GPU against its own history and
    #: each node against its job's peers, :mod:`.peers`) and/or "ecod" (per-sample ECOD over a node's
    #: own mean GPU vector, :mod:`.detectors`) and/or "temporal" (the scorer bench/tee_external grades, per
    #: node against its own history, :mod:`.temporal`).
    soft_detectors: tuple = ("peers",)
    #: Temporal detector (``soft_detectors`` "temporal", :mod:`.temporal`): rows of a node's history
    #: before its scorer is fitted, rows scored together, and scores in a row over the threshold per fault.
    temporal_history: int = 600
    temporal_every: int = 10
    temporal_consecutive: int = 5
    #: pyod model of the peers detector, per fault family: ecod, copod, iforest, hbos, lof or combo.
    soft_detector: str = "ecod"
    #: Seconds (sample time) of one soft-detection window.
    soft_window_s: float = 10.0
    #: Clean feature vectors kept per family for (re)fitting (a sliding window of clean history).
    soft_history: int = 2000
    #: Clean vectors needed before the peers detector scores anything.
    soft_min_history: int = 100
    #: Refit the family models once every this many decided windows.
    soft_refit_every: int = 50
    #: Threshold: this quantile of the clean history's scores (a calibrated score quantile) ...
    soft_quantile: float = 0.995
    #: ... times this margin.
    soft_margin: float = 1.2
    #: ... and the family's strongest feature at least this many robust spreads off the clean median.
    soft_min_z: float = 4.0
    #: Cold start: until the family models are fitted (``soft_min_history`` clean vectors), a node of a
    #: job with at least 3 reporting nodes whose family feature lies this many noise floors off the
    #: job's median is anomalous (a blatant straggler in a job's first minutes is still caught); 0: off.
    soft_cold_z: float = 10.0
    #: A straggler whose SM clock is at least this share below the job's median is CRITICAL with the
    #: suggested action evict (the controller replaces it when it has a spare); a smaller drop is a
    #: WARNING to observe.
    straggler_evict_drop: float = 0.2
    #: Windows in a row before a soft fault of a window whose SM clock is ``straggler_evict_drop`` or more
    #: below the job's median (a physical fact about one GPU against its peers, the median of a whole
    #: window, whichever detector hit); every other soft fault needs ``soft_consecutive``.
    straggler_evict_windows: int = 1
    #: TEE workers: a job's window is judged once every node of the job sent it, or once another node of
    #: the job is this many windows further (a node gone silent is not waited for longer); see
    #: :mod:`.jobwindows`. 0: 3 windows on the wall clock; 360 (an hour) on the event clock, where a replay
    #: read at full speed puts partitions tens of minutes of sample time apart, and where the node side says
    #: how far it read each node, so a silent node holds its job only until it is read past the window.
    soft_peer_wait: int = 0
    #: Anomalous windows in a row before a soft fault.
    soft_consecutive: int = 2
    #: Clean windows in a row after a soft fault before its resolution event.
    soft_clear: int = 3
    #: A fault of the same class on the same node and device within this many seconds (sample time)
    #: of the last one is merged into it (counted, not re-sent).
    cooldown_s: float = 300.0
    #: A NIC/IB port down for longer than this (sample time) is LINK_DOWN.
    link_down_hold_s: float = 2.0
    #: This many downs of one port shorter than ``link_down_hold_s`` (back up before the hold) within
    #: ``link_flap_window_s`` is LINK_FLAP, reported as the port comes back up. 1: the first one (an IB
    #: port that drops for a second breaks the job's connections; found within 2 s, as the other hard
    #: faults); 3 was the default before 6 December 2026 (a flap found 40 s in, at its third down).
    link_flap_count: int = 1
    link_flap_window_s: float = 60.0
    #: How many emitted fault ids the engine remembers to drop repeats (oldest forgotten first).
    dedup_capacity: int = 100_000

    def __post_init__(self) -> None:
        ceilings = self.hang_phase_ceilings
        pairs = tuple(ceilings.items()) if isinstance(ceilings, Mapping) else tuple(tuple(p) for p in ceilings)
        for pair in pairs:
            if (len(pair) != 2 or not isinstance(pair[0], str) or isinstance(pair[1], bool)
                    or not isinstance(pair[1], (int, float)) or not pair[1] > 0):
                raise ConfigError(f"TEE setting hang_phase_ceilings={ceilings!r}: expected phase names with a "
                                  "positive number of seconds each")
        object.__setattr__(self, "hang_phase_ceilings", pairs)
        for f in ("hang_timeout", "hang_step_factor", "heartbeat_timeout", "node_lost_fast_s", "heartbeat_horizon",
                  "heartbeat_bye_grace_s",
                  "hang_stale_s", "hang_stopped_s", "hang_pause_floor_s", "hang_pause_margin", "hang_busy_util",
                  "hang_idle_util"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a positive number of seconds")
        for f in ("ecod_min_samples", "ecod_window", "ecod_refit_every", "ecod_consecutive", "dedup_capacity",
                  "temporal_history", "temporal_every", "temporal_consecutive"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a positive integer")
        for f in ("soft_window_s", "cooldown_s", "link_down_hold_s", "link_flap_window_s", "soft_margin",
                  "soft_min_z"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a positive number")
        for f in ("soft_history", "soft_min_history", "soft_refit_every", "soft_consecutive", "soft_clear",
                  "link_flap_count", "straggler_evict_windows"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a positive integer")
        if isinstance(self.soft_peer_wait, bool) or not isinstance(self.soft_peer_wait, int) or self.soft_peer_wait < 0:
            raise ConfigError(f"TEE setting soft_peer_wait={self.soft_peer_wait!r}: expected an integer >= 0 "
                              "(0: automatic)")
        for f in ("soft_cold_z", "straggler_evict_drop"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"TEE setting {f}={value!r}: expected a number >= 0")
        if self.heartbeat_bye_grace_s > self.heartbeat_horizon:
            raise ConfigError(f"TEE setting heartbeat_bye_grace_s={self.heartbeat_bye_grace_s!r}: expected at most "
                              f"heartbeat_horizon ({self.heartbeat_horizon:g} s): a node silent longer is history")
        if isinstance(self.hang_save_write_mb_s, bool) or not isinstance(self.hang_save_write_mb_s, (int, float)) \
                or not 0 <= self.hang_save_write_mb_s < float("inf"):
            raise ConfigError(f"TEE setting hang_save_write_mb_s={self.hang_save_write_mb_s!r}: expected MB per "
                              "second >= 0 (0: off)")
        if isinstance(self.hang_wait_power, bool) or not isinstance(self.hang_wait_power, (int, float)) \
                or not 0 <= self.hang_wait_power < 1:
            raise ConfigError(f"TEE setting hang_wait_power={self.hang_wait_power!r}: expected a share of the "
                              "stepping power from 0 (off) to below 1")
        if self.clock not in ("wall", "event"):
            raise ConfigError(f"TEE setting clock={self.clock!r}: expected 'wall' or 'event'")
        if self.soft_detector not in ("ecod", "copod", "iforest", "hbos", "lof", "combo"):
            raise ConfigError(f"TEE setting soft_detector={self.soft_detector!r}: expected one of ecod, copod, "
                              "iforest, hbos, lof, combo")
        if isinstance(self.soft_detectors, str) or not set(self.soft_detectors) <= {"peers", "ecod", "temporal"}:
            raise ConfigError(f"TEE setting soft_detectors={self.soft_detectors!r}: expected a list of "
                              "'peers', 'ecod' and/or 'temporal'")
        object.__setattr__(self, "soft_detectors", tuple(self.soft_detectors))
        if not 0.5 < self.soft_quantile < 1:
            raise ConfigError(f"TEE setting soft_quantile={self.soft_quantile!r}: expected a share between 0.5 and 1")
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
