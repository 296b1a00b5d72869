"""Soft faults from windows: each GPU against its own clean history, each node against its job's peers.

No Faust here. :class:`PeerDetector` is fed every batch (``observe``) and, each time a node's
window of ``soft_window_s`` seconds (sample time) closes, turns it into a feature vector:

=====================  ==========================================================  ===========
feature                what                                                         family
=====================  ==========================================================  ===========
temp_rise_c            hottest rise of a GPU's window median over its own baseline  thermal
clock_drop             largest relative drop of a GPU's SM clock below its baseline  gpu
power_drop             largest relative drop of a GPU's power below its baseline     gpu
nic_errors_per_s       symbol + receive errors per second over the node's IB ports   nic
nic_bw_drop            relative drop of the slowest port's receive rate              nic
=====================  ==========================================================  ===========

A window's value of a GPU field is its median over the window's latest regime (``_gpu_medians``): where
the window holds the edge of a job-wide pause or wait (a step in power of half its highest or more; idle
samples among working ones), the samples after it. Nodes sample at their own phases and their clocks
differ, so such a window holds more or fewer samples of either side from node to node.

Baselines are per GPU (per port): the median of that device's last ``soft_baseline`` clean windows,
so each GPU is compared with itself (temporal). When at least 3 nodes of the same job close the
same window, every node's features are taken relative to the job's median (peers): a change the
whole job shares (a checkpoint pause, an eval) cancels out, the odd node stands out.

Scoring: per family, the pyod model of ``soft_detector`` (ECOD by default; iforest, copod, hbos,
lof, or "combo" for the mean of ECOD and COPOD ranks) is refitted every ``soft_refit_every`` windows
on the last ``soft_history`` clean feature vectors of the nodes this detector sees, and the
threshold is the ``soft_quantile`` of those clean scores times ``soft_margin`` (a calibrated
quantile). A node's window is anomalous when its family score is above the threshold AND the
family's strongest feature lies more than ``soft_min_z`` robust spreads (with a floor) from the
clean median, so that a detector fitted on very quiet history does not fire on noise.
Cold start: until the models are fitted (``soft_min_history`` clean vectors per family, minutes of
a fresh TEE), a node of a job with at least 3 nodes reporting the same window is anomalous when a
family feature lies ``soft_cold_z`` noise floors off the job's median (detector ``peers.cold``), so
a blatant straggler in a job's first minutes is not left running; once fitted, a family feature that
far off is anomalous even when the joint model scores the vector under its threshold (``peers.z``). And at any time, in such a job, a
GPU whose SM clock is ``straggler_evict_drop`` or more below the job's median is anomalous whatever
the model says (detector ``peers.rule``): a model refitted on history that already holds slow
windows can learn to accept them.
A window in which the node's training step did not move (a checkpoint, a pause, a hang, a job waiting
for a lost node) is not added to the baselines and is judged on its NIC error rate alone: soft faults
of the GPUs are slowdowns of a running job, and a long pause would otherwise teach the baselines idle
temperatures and power; a failing link shows its errors without traffic (``_judge_stood``). A window
within a step several windows long is no standstill: in a job whose step moves ``g`` >= 2 windows apart,
a window less than 1.5 g after the last move, its GPUs at half their baseline power or more, is judged
as one that moved (``_in_step``). In a job of fewer than 3 nodes such a window without NIC errors also
ends a run of anomalous windows (a hang's first and last windows, each half spent waiting, are no
slowdown). Nor is a window a node closed outside its job (``PeerWindow.outside``: its batches carried no
job after it trained in one, its ranks gone); it still counts as closed for the job's windows, so they
do not wait for it.

Waiting is not a cause: in a synchronous job one slow node makes every other node idle at the
all-reduce, so their utilisation (and power) fall while their clocks hold. A hit on a node whose
utilisation fell 10 % or more below its own baseline while its SM clock did not (and, for the NIC
family, without NIC errors of its own) is dropped (``waiting`` counts them): it suffers the slowdown.
The node that causes it is the one of a job of 3+ whose GPUs keep their utilisation while two
thirds or more of the others' fall 15 % or more (detector ``peers.wait``): a straggler at full
clocks, reported as a WARNING to observe (work that only rank 0 does looks the same). A waiting
node's windows do not enter its baselines (for up to 15 minutes; longer, it is the new normal), so
that when the job speeds up again its temperatures and power are not taken for a rise; nor do any
node's while another node of its job is anomalous or has a soft fault open (a mild fault slows the
job by less than the 10 %).
In a job of one or two nodes (no job median), the node's own GPUs tell: one working GPU that keeps its
utilisation while the node's others fall 5 % or more is what they wait for (``devices.util.keeps``);
when its clock is ``soft_min_z`` spreads below its own baseline too, it is ``peers.slows``. A slow GPU
that is also hotter than its own normal is thermal; a node busier than its baseline is not hot (its
baselines were learned at a lighter load: a job's slow first steps).
Where the detector runs: fed directly (one process, the offline bench), every window is decided
here. In the TEE workers (:mod:`.app`) a job's nodes are spread over the workers by node, so the
detector is split: the worker reading a node's metrics builds its windows and, with ``outbox`` set
(a list), puts each closed one there as a :class:`~transom.contracts.PeerWindow` summary (medians,
reasons, error rate: what the features are made of) instead of deciding it; the worker that owns the
job (``transom.peer-windows`` is keyed by job) feeds the summaries to :meth:`PeerDetector.take`,
which keeps the per-node baselines and runs and decides exactly as here.
``soft_consecutive`` anomalous windows make a fault (``straggler_evict_windows``, default one, when the
window's SM clock is ``straggler_evict_drop`` or more below the job's median, whichever detector hit);
``soft_clear`` clean windows after it make a resolution event (``resolved=True``, same fault id). The
class comes from the evidence of the run's last window: NIC features -> link_degraded; a hot GPU -> thermal
(a slow GPU too, once a window of the run found it hot); a slow GPU whose clock-event reasons show a power
cap -> power_cap; a thermal slowdown reason -> thermal; otherwise -> straggler. A straggler whose SM
clock is ``straggler_evict_drop`` or more below the job's median is CRITICAL with the suggested
action evict (kind ``straggler``: the controller replaces the node when it has a spare); other soft
faults are WARNINGs to observe.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transom.contracts import DCGM, Action, FaultEvent, MetricBatch, PeerWindow, Severity, Source, stable_id

from .classes import KIND_OF, FaultClass
from .config import TEEConfig
from .jobwindows import drop_gone, window_complete
from .rules import NodeState, fault

__all__ = ["FEATURES", "FAMILIES", "PeerDetector", "make_model"]

FEATURES = ("temp_rise_c", "clock_drop", "power_drop", "nic_errors_per_s", "nic_bw_drop")
FAMILIES = {"thermal": (0,), "gpu": (1, 2), "nic": (3, 4)}
#: Smallest spread per feature (units of the feature): noise floors so a quiet history is not a hair trigger.
_FLOOR = np.array([0.7, 0.01, 0.02, 0.2, 0.02])
_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
_TEMP = DCGM.GPU_TEMP
_GPU_FIELDS = (DCGM.GPU_TEMP, DCGM.SM_CLOCK, DCGM.POWER_USAGE, DCGM.GPU_UTIL)
_POWER_CAP_BITS = 0x4 | 0x8 | 0x100
_THERMAL_BITS = 0x20 | 0x40          # SW and HW thermal slowdown
_RISE = 0                            # FEATURES.index of the temperature rise
_CLOCK = 1                           # FEATURES.index("clock_drop")
_ERR = 3                             # FEATURES.index("nic_errors_per_s")
_WAIT_UTIL = 0.1                     # a utilisation drop of this share (of its own baseline) is waiting
_WAIT_PEERS = 0.15                   # peers whose utilisation fell this much wait for the one that did not
_WAIT_LEARN = 90                     # windows of waiting (15 min at 10 s) before they become the baseline
_WORKING_UTIL = 0.9                  # a GPU at this share of its job's median utilisation works (_below_job)
_EXPECT_WINDOWS = 2                  # a window waits for the job's nodes that closed one of the last 2
_STEP_GAPS = 5                       # moves of a node's step whose spacing (in windows) gives its usual step
_STEP_POWER = 0.5                    # a GPU at this share of its baseline power or more works (a long step)
#: Seconds of sample time a decided window's peers are kept: a node's window that comes up to this much
#: later than its job's (read far behind its peers) is judged against them; later, it is judged alone.
_LATE_KEEP_S = 3600.0


def _median(values) -> float:
    v = sorted(values)
    n = len(v)
    return float(v[n // 2]) if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2.0


#: a GPU at or below this utilisation idles (the hang rule's default: a window's medians are no setting)
_IDLE_UTIL = TEEConfig.hang_idle_util


def _gpu_medians(fields: dict) -> dict:
    """One GPU's window medians, field by field, over the samples of its latest regime: after the window's
    largest step in power where that step is half the window's highest power or more (a pause, or a wait in
    a collective, that began or ended in the window), and of those the samples the GPU worked in where it
    also idled (a data-loader hiccup). A window that holds the edge of a job-wide pause or wait holds more or
    fewer samples of either side from node to node (their clocks, and the phases at which their agents
    sample, differ by fractions of a second), and a median taken over both sides with them: that is no node
    standing out of its job. A slowdown (a straggler, a power cap) changes power by less than half."""
    n = len(next(iter(fields.values()), ()))
    if n < 2 or any(len(v) != n for v in fields.values()):
        return {k: _median(v) for k, v in fields.items()}
    keep = range(n)
    power = fields.get(DCGM.POWER_USAGE)
    if power and (top := max(power)) > 0:
        k = max(range(1, n), key=lambda i: abs(power[i] - power[i - 1]))
        if abs(power[k] - power[k - 1]) >= 0.5 * top:
            keep = range(k, n)
    util = fields.get(DCGM.GPU_UTIL)
    if util and any(util[i] <= _IDLE_UTIL for i in keep) and any(util[i] > _IDLE_UTIL for i in keep):
        keep = [i for i in keep if util[i] > _IDLE_UTIL]
    if len(keep) == n:
        return {k: _median(v) for k, v in fields.items()}
    return {k: _median([v[i] for i in keep]) for k, v in fields.items()}


def _stood(win: "_Window") -> bool:
    """Whether the node's training step stood still through ``win``, from the step it stood at as the window
    opened (no training reports: it did not), and not only for part of a step as long as several windows
    (``_Window.in_step``)."""
    return bool(win.steps) and min(win.steps) == max(win.steps) and not win.in_step


def make_model(name: str) -> Any:
    """A fresh pyod model by name (imports pyod lazily)."""
    if name == "ecod":
        from pyod.models.ecod import ECOD
        return ECOD()
    if name == "copod":
        from pyod.models.copod import COPOD
        return COPOD()
    if name == "iforest":
        from pyod.models.iforest import IForest
        return IForest(n_estimators=50, random_state=0)
    if name == "hbos":
        from pyod.models.hbos import HBOS
        return HBOS()
    if name == "lof":
        from pyod.models.lof import LOF
        return LOF(n_neighbors=10)
    if name == "combo":
        return _Combo()
    raise ValueError(name)


class _Combo:
    """Mean of ECOD and COPOD scores, each standardised on its training scores."""

    def fit(self, X):
        self.models = [make_model("ecod"), make_model("copod")]
        self.stats = []
        for m in self.models:
            m.fit(X)
            s = m.decision_scores_
            self.stats.append((float(np.median(s)), float(np.std(s)) or 1.0))
        self.decision_scores_ = self.decision_function(X)
        return self

    def decision_function(self, X):
        return np.mean([(m.decision_function(X) - mu) / sd for m, (mu, sd) in zip(self.models, self.stats)], 0)


@dataclass
class _Window:
    index: int = -1
    gpu: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))   # gpu -> field -> values
    reasons: dict = field(default_factory=lambda: defaultdict(int))
    nic_err: list = field(default_factory=list)
    nic_bw: dict = field(default_factory=lambda: defaultdict(list))
    steps: list = field(default_factory=list)      # training steps seen (none: no training reports)
    first_ts: float = 0.0
    last_ts: float = 0.0
    job: str = ""                                  # the job of the batch that opened it
    outside: bool = False                          # that batch had no job, the node's last one is ``job``
    in_step: bool = False                          # its step did not move, but it works through a long step
                                                   # (job side: PeerDetector._in_step)

    def summary(self, node: str, now: float) -> PeerWindow:
        """What the features of this window are made of (medians, reasons, mean error rate)."""
        return PeerWindow(node=node, job=self.job, index=self.index, first_ts=self.first_ts, last_ts=self.last_ts,
                          closed_ts=now, gpu={str(gi): _gpu_medians(f) for gi, f in self.gpu.items()},
                          reasons={str(gi): r for gi, r in self.reasons.items()},
                          nic_err=sum(self.nic_err) / len(self.nic_err) if self.nic_err else None,
                          nic_bw={dev: _median(v) for dev, v in self.nic_bw.items()},
                          steps=(min(self.steps), max(self.steps)) if self.steps else (), outside=self.outside)

    @classmethod
    def of(cls, w: PeerWindow) -> "_Window":
        """The window a summary stands for (each median as its one value: the features come out the same)."""
        win = cls(index=w.index, first_ts=w.first_ts, last_ts=w.last_ts, job=w.job, outside=w.outside)
        for gi, f in w.gpu.items():
            win.gpu[int(gi)].update({k: [v] for k, v in f.items()})
        win.reasons.update({int(gi): r for gi, r in w.reasons.items()})
        win.nic_err = [] if w.nic_err is None else [w.nic_err]
        win.nic_bw.update({dev: [v] for dev, v in w.nic_bw.items()})
        win.steps = list(w.steps)      # lowest and highest: whether the job moved is all _close asks
        return win


#: A new node's window until its first batch opens one (each site that makes a _NodeSoft replaces it
#: at once, never changes it): a _Window costs a dozen containers, and a replay makes nodes by thousands.
_NO_WINDOW = _Window()


@dataclass
class _NodeSoft:
    window: _Window = field(default_factory=lambda: _NO_WINDOW)
    base: dict = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=30)))   # device key -> medians
    run: int = 0
    run_start: float = 0.0
    run_hot: bool = False            # a window of the run named its slow GPU hot (thermal)
    clean: int = 0
    open_fault: FaultEvent | None = None
    last_features: np.ndarray | None = None
    waited: int = 0                  # windows in a row not learned because the node waited
    run_index: int = -1              # the newest window of the run of anomalous windows (``run``)
    stalled: int = -1                # the newest window in which the node's step stood still (and its NIC was clean)
    base_job: str | None = None      # the job ``base`` was learned in
    moved: int = -1                  # job side: the newest window in which the node's step moved
    gaps: deque = field(default_factory=lambda: deque(maxlen=_STEP_GAPS))   # windows between its last moves


@dataclass
class _View:
    """A job's window as its nodes are judged against: each node's features (a row of ``xs``), mean
    utilisation drop (``drops``, NaN: unknown) and whether it has a working GPU (``works``), and the
    job's working GPUs (``floor``: the utilisation a GPU needs to count as working; ``clock``: their
    median SM clock). Kept for a while after the window is decided, so that a node's window that comes
    later (its metrics read far behind its peers': a worker catching up, a replay's partition skew) is
    judged against the same peers instead of alone (:meth:`plus`)."""
    nodes: list[str]
    xs: np.ndarray
    drops: np.ndarray
    works: np.ndarray
    floor: float
    clock: float | None

    @classmethod
    def of(cls, peers: dict, floor: float | None = None, clock: float | None = None) -> "_View":
        """The view of ``peers`` (node -> (features, worst, medians, ...)); the job's working GPUs from
        them, or ``floor`` and ``clock`` where given."""
        if floor is None:
            utils = [u for p in peers.values() for (_, name), u in p[2].items() if name == DCGM.GPU_UTIL]
            floor = _WORKING_UTIL * _median(utils) if utils else 0.0
            clocks = [m for p in peers.values() for m, _ in cls.working(p, floor)]
            clock = _median(clocks) if clocks else None
        return cls(list(peers), np.vstack([p[0] for p in peers.values()]),
                   np.array([p[1].get("util", {}).get("drop", np.nan) for p in peers.values()], dtype=float),
                   np.array([bool(cls.working(p, floor)) for p in peers.values()]), floor, clock)

    @staticmethod
    def working(p: tuple, floor: float) -> list[tuple[float, int]]:
        """A node's working GPUs, as (SM clock median, GPU index): those whose utilisation is ``floor`` or
        more, or unknown (a GPU the job leaves unused idles at a fraction of its clock)."""
        medians = p[2]
        return [(m, gi) for (gi, name), m in medians.items()
                if name == DCGM.SM_CLOCK and medians.get((gi, DCGM.GPU_UTIL), floor) >= floor]

    def plus(self, late: dict) -> "_View":
        """This view with the nodes of ``late`` (their windows came after it was decided) in place of any
        earlier entry of theirs, judged against the job's working GPUs it was decided with."""
        new = _View.of(late, self.floor, self.clock)
        keep = [i for i, n in enumerate(self.nodes) if n not in late]
        return _View([self.nodes[i] for i in keep] + new.nodes, np.vstack([self.xs[keep], new.xs]),
                     np.concatenate([self.drops[keep], new.drops]), np.concatenate([self.works[keep], new.works]),
                     self.floor, self.clock)


class PeerDetector:
    """Per-window soft-fault detector, temporal per GPU and across a job's peers (see module doc)."""

    name = "peers"

    def __init__(self, config: TEEConfig) -> None:
        self.config = config
        make_model(config.soft_detector).fit(np.random.default_rng(0).normal(size=(16, 2)))  # import now
        self.history: dict[str, deque] = {f: deque(maxlen=config.soft_history) for f in FAMILIES}
        self.models: dict[str, Any] = {}
        self.thresholds: dict[str, float] = {}
        self.center = np.zeros(len(FEATURES))
        self.spread = _FLOOR.copy()
        self.since_fit = 10**9
        self.waiting = 0               # hits dropped: the node only waited on a slow peer
        self.pending: dict[tuple[str, int], dict[str, tuple]] = defaultdict(dict)   # (job, window) -> node -> ...
        #: (job, window) -> the peers it was decided with, for the last _LATE_KEEP_S of windows (oldest first)
        self.decided: dict[tuple[str, int], _View] = {}
        self._late_keep = int(_LATE_KEEP_S // config.soft_window_s)
        #: Node side of a split detector: closed windows go here as summaries instead of being decided.
        self.outbox: list[PeerWindow] | None = None
        self.remote: dict[str, NodeState] = {}      # job side: node -> its soft state (baselines, runs)
        #: job -> node -> the index of the last window the node closed (which nodes a window waits for)
        self.closed: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ feed
    def observe(self, state: NodeState, batch: MetricBatch, now: float) -> list[FaultEvent]:
        ns = state.detectors.get(self.name)
        if ns is None:
            ns = state.detectors[self.name] = _NodeSoft()
        w = self.config.soft_window_s
        index = int(batch.ts // w)
        out: list[FaultEvent] = []
        if ns.window.index != index:
            if ns.window.index >= 0 and ns.window.gpu:
                # judged in the job it opened in: a spare's last idle window is not its first in the job
                # it joins (that window's idle clocks and temperatures would become its baselines there)
                if self.outbox is not None:
                    self.outbox.append(ns.window.summary(state.node, now))
                else:
                    out += self._close(state, ns, now)
            # a batch without a job after the node trained in one: its ranks are gone (a relaunch's gap, a node
            # replaced and cordoned); the window still closes in that job, so the job's windows do not wait
            # for it as for a node gone silent, but it is neither judged nor learned from (``_close``)
            prev = ns.window
            ns.window = _Window(index=index, first_ts=batch.ts, job=batch.job or state.job or batch.node,
                                outside=not batch.job and bool(state.job))
            if prev.steps and prev.job == ns.window.job:
                # the step the node stood at as the window opened: a step that ends at the boundary (a job of
                # steps as long as the window moves once in each) is a move of this window, not a standstill
                ns.window.steps.append(prev.steps[-1])
        win = ns.window
        win.last_ts = batch.ts
        gpus, reasons = win.gpu, win.reasons
        for s in batch.of(Source.GPU):      # the node side's cost per batch: locals, no call per value
            f = s.fields
            if _TEMP not in f or s.index is None:
                continue
            g = gpus[s.index]
            for name in _GPU_FIELDS:
                if name in f:
                    g[name].append(float(f[name]))
            reasons[s.index] |= int(f.get(_REASONS, 0))
        for s in batch.of(Source.TRAIN):
            if "step" in s.fields and not s.tags.get("event"):     # events (a save, a restore) are not progress
                win.steps.append(s.fields["step"])
        for s in batch.of(Source.NIC):
            f = s.fields
            if f.get("link_up", 1) != 1:
                continue
            win.nic_err.append(float(f.get("symbol_error_per_s", 0.0)) + float(f.get("port_rcv_errors_per_s", 0.0)))
            if "port_rcv_bytes_per_s" in f:
                win.nic_bw[s.tags.get("device", "")].append(float(f["port_rcv_bytes_per_s"]))
        return out

    # ------------------------------------------------------------------ window close
    def _raw_features(self, ns: _NodeSoft) -> tuple[np.ndarray, dict, dict]:
        win = ns.window
        rise, cdrop, pdrop, worst = -np.inf, -np.inf, -np.inf, {}
        medians = {}
        for gi, fields in win.gpu.items():
            for name, m in _gpu_medians(fields).items():
                medians[(gi, name)] = m
        devs = {}
        for (gi, name), m in medians.items():
            hist = ns.base[(gi, name)]
            base = _median(hist) if len(hist) >= 3 else m
            devs[(gi, name)] = (m, base)
        for gi in win.gpu:
            if (gi, DCGM.GPU_TEMP) in devs:
                m, b = devs[(gi, DCGM.GPU_TEMP)]
                if m - b > rise:
                    rise, worst["thermal"] = m - b, {"gpu": gi, "value": m, "baseline": b}
            if (gi, DCGM.SM_CLOCK) in devs:
                m, b = devs[(gi, DCGM.SM_CLOCK)]
                d = (b - m) / max(b, 1.0)
                if d > cdrop:
                    cdrop, worst["clock"] = d, {"gpu": gi, "value": m, "baseline": b, "reasons": win.reasons.get(gi, 0)}
            if (gi, DCGM.POWER_USAGE) in devs:
                m, b = devs[(gi, DCGM.POWER_USAGE)]
                d = (b - m) / max(b, 1.0)
                if d > pdrop:
                    pdrop, worst["power"] = d, {"gpu": gi, "value": m, "baseline": b}
        # per GPU: (its utilisation drop below its own baseline, utilisation, baseline, GPU), least drop first
        utils = sorted(((b - m) / max(b, 1.0), m, b, gi) for gi in win.gpu if (gi, DCGM.GPU_UTIL) in devs
                       for m, b in [devs[(gi, DCGM.GPU_UTIL)]])
        if utils:          # the node's mean utilisation against its own baseline: do its GPUs wait?
            m, b = sum(u[1] for u in utils) / len(utils), sum(u[2] for u in utils) / len(utils)
            worst["util"] = {"value": round(m, 1), "baseline": round(b, 1), "drop": round((b - m) / max(b, 1.0), 3)}
            # one working GPU keeps its utilisation while the node's others fall: they wait for it (the slow GPU
            # of a one- or two-node job, or of a node its peers wait for; rank-0-only work looks the same, so
            # it only names a GPU whose clock fell too: "slows" below)
            if len(utils) >= 2:
                (kept, m_kept, _, gi_kept), rest = utils[0], utils[1:]
                others = _median([u[0] for u in rest])
                if kept < _WAIT_UTIL / 4 and others >= _WAIT_UTIL / 2 \
                        and m_kept >= _WORKING_UTIL * _median([u[2] for u in rest]):
                    worst["util"].update(keeps=gi_kept, others_drop=round(others, 3))
        err = sum(win.nic_err) / len(win.nic_err) if win.nic_err else 0.0
        bw_drop = 0.0
        for dev, vals in win.nic_bw.items():
            m = _median(vals)
            hist = ns.base[("nic", dev)]
            b = _median(hist) if len(hist) >= 3 else m
            medians[("nic", dev)] = m
            d = (b - m) / max(b, 1.0)
            if d > bw_drop:
                bw_drop, worst["nic_bw"] = d, {"device": dev, "value": m, "baseline": b}
        x = np.array([rise, cdrop, pdrop, err, bw_drop], dtype=float)
        x[~np.isfinite(x)] = 0.0
        return x, worst, medians

    def _close(self, state: NodeState, ns: _NodeSoft, now: float) -> list[FaultEvent]:
        job = ns.window.job
        # a window outside its job (the node's ranks are gone: a relaunch's gap, a node replaced and cordoned)
        # is neither judged nor learned from (it idles), and the baselines wait for the job to come back
        judged = not ns.window.outside
        if judged and ns.base_job != job:   # a node's normal is what it runs in its job: a spare that idled
            ns.base.clear()                 # outside any job (low clocks, no load) starts its baselines afresh
            ns.base_job, ns.waited = job, 0
            ns.moved = -1                   # and learns its new job's step anew
            ns.gaps.clear()
        if judged:      # (a window in which the job stood still is judged on its NIC errors alone: _stood)
            x, worst, medians = self._raw_features(ns)
            ns.window.in_step = self._in_step(ns, medians)
            self.pending[(job, ns.window.index)][state.node] = (x, worst, medians, ns, state, ns.window)
        # peers: decide a window once every node of the job that closed one of its last windows has closed
        # it too; a node that stopped reporting holds it until a later window of the job closes (then it
        # is decided with the nodes that came, or alone: one-node jobs, peers owned by another worker)
        index = ns.window.index
        closed = self.closed.setdefault(job, {})
        closed[state.node] = index
        out: list[FaultEvent] = []
        for k in [k for k in self.pending if k[0] == job and k[1] < index]:
            out += self._decide(k, self.pending.pop(k), now)
        if (job, index) in self.pending and window_complete(closed, index, _EXPECT_WINDOWS):
            out += self._decide((job, index), self.pending.pop((job, index)), now)
        drop_gone(closed, index, _EXPECT_WINDOWS)      # nodes gone from the job (evicted, moved)
        return out

    def take(self, w: PeerWindow, now: float) -> list[FaultEvent]:
        """Job side: decide with a window that the node's worker summarised (see the module doc)."""
        state = self.remote.get(w.node)
        if state is None:
            state = self.remote[w.node] = NodeState(w.node)
        state.job = w.job
        ns = state.detectors.get(self.name)
        if ns is None:
            ns = state.detectors[self.name] = _NodeSoft()
        # the job's earlier windows first, while every node's window is the one being judged (their
        # evidence and trigger time are that window's, whatever order the summaries came in)
        out: list[FaultEvent] = []
        for k in sorted(k for k in self.pending if k[0] == w.job and k[1] < w.index):
            out += self._decide(k, self.pending.pop(k), now)
        ns.window = _Window.of(w)
        return out + self._close(state, ns, now)

    def forget_jobs(self, jobs) -> None:
        """Job side: these jobs are judged by another worker now (their partition moved)."""
        jobs = set(jobs)
        for node in [n for n, st in self.remote.items() if st.job in jobs]:
            del self.remote[node]
        for k in [k for k in self.pending if k[0] in jobs]:
            del self.pending[k]
        for k in [k for k in self.decided if k[0] in jobs]:
            del self.decided[k]
        for job in jobs:
            self.closed.pop(job, None)

    def flush(self, now: float) -> list[FaultEvent]:
        """Decide every window still waiting for peers (end of a replay)."""
        out: list[FaultEvent] = []
        for k in list(self.pending):
            out += self._decide(k, self.pending.pop(k), now)
        return out

    def _decide(self, key: tuple[str, int], peers: dict, now: float) -> list[FaultEvent]:
        """Judge the nodes of ``peers`` in the job's window ``key``: with each other, or, when the window
        was decided before (they came late), with the nodes it was decided with. Nodes whose step stood
        still in it are judged apart (:meth:`_judge_stood`)."""
        stood = {node: p for node, p in peers.items() if _stood(p[5])}
        if stood:
            peers = {node: p for node, p in peers.items() if node not in stood}
            out = self._judge_stood(stood, now)
            return out + self._decide(key, peers, now) if peers else out
        before = self.decided.pop(key, None)
        view = _View.of(peers) if before is None else before.plus(peers)
        self.decided[key] = view          # the newest last: the oldest go first (_LATE_KEEP_S)
        while self.decided and next(iter(self.decided))[1] < key[1] - self._late_keep:
            del self.decided[next(iter(self.decided))]
        n = len(view.nodes)
        xs = np.vstack([p[0] for p in peers.values()])
        rel = xs - np.median(view.xs, 0) if n >= 3 else xs
        out: list[FaultEvent] = []
        cfg = self.config
        flagged = set()
        scores = {}
        if self.since_fit >= cfg.soft_refit_every and all(len(h) >= cfg.soft_min_history for h in self.history.values()):
            self._fit()
        ready = bool(self.models)
        Z = (rel - self.center) / self.spread
        fam_scores = {}
        if ready:
            for fam, cols in FAMILIES.items():
                # only rows past the z gate need a model score (pyod scoring is the costly part)
                need = np.flatnonzero(Z[:, list(cols)].max(1) >= cfg.soft_min_z)
                sc = np.full(len(rel), -np.inf)
                if len(need):
                    sc[need] = self.models[fam].decision_function(rel[need][:, list(cols)])
                fam_scores[fam] = sc
        # cold start: no model yet, but a job of 3+ nodes gives a median to stand out from
        cold = not ready and cfg.soft_cold_z > 0 and n >= 3
        culprit, culprit_gap = self._keeps_working(view)
        below = self._below_job(view, peers) if n >= 3 and cfg.straggler_evict_drop > 0 else {}
        for j, (row, (node, (x, worst, medians, ns, state, win))) in enumerate(zip(rel, peers.items())):
            z = Z[j]
            fam_hit = None
            for fam, cols in FAMILIES.items():
                zmax = float(np.max(z[list(cols)]))
                if ready:
                    s, thr, mode = float(fam_scores[fam][j]), self.thresholds[fam], "model"
                    hit = s > thr and zmax >= cfg.soft_min_z
                    if not hit and cfg.soft_cold_z > 0 and zmax >= cfg.soft_cold_z:
                        # one feature far out alone (a slow GPU whose peers' power fell as they wait for it):
                        # a joint model can score it under its threshold
                        s, thr, mode, hit = zmax, float(cfg.soft_cold_z), "z", True
                elif cold:
                    s, thr, mode = zmax, float(cfg.soft_cold_z), "cold"
                    hit = zmax >= thr
                else:
                    hit = False
                if hit and (fam_hit is None or zmax > fam_hit[2]):
                    fam_hit = (fam, s, zmax, thr, mode)
            # the GPU says why it is slow: a clock soft_min_z noise floors (4 %) or more below the job's median
            # while its clock-event reasons show a power cap or a thermal slowdown (the driver's own evidence; a
            # joint model, or a spread learned from history that holds such windows, can let a modest drop pass)
            if fam_hit is None and (ready or cold) and float(row[_CLOCK]) >= cfg.soft_min_z * _FLOOR[_CLOCK] \
                    and int(worst.get("clock", {}).get("reasons", 0)) & (_POWER_CAP_BITS | _THERMAL_BITS):
                fam_hit = ("gpu", float(row[_CLOCK]), float(z[_CLOCK]), float(cfg.soft_min_z * _FLOOR[_CLOCK]), "reason")
            # the GPU is slow and the job waits for it: a clock soft_min_z spreads or more below the job's median
            # while the other nodes' utilisation fell (their median by _WAIT_UTIL / 2 or more): cause and effect
            # together (ECOD caps what one extreme feature can score near log(history), under its threshold)
            # (or the node's own other GPUs wait for it: a job of one or two nodes has no job median to judge by)
            if fam_hit is None and float(z[_CLOCK]) >= cfg.soft_min_z and (ready or cold) \
                    and ((n >= 3 and self._job_waits(view, node) >= _WAIT_UTIL / 2)
                         or worst.get("util", {}).get("keeps", -1) == worst.get("clock", {}).get("gpu")):
                fam_hit = ("gpu", float(z[_CLOCK]), float(z[_CLOCK]), float(cfg.soft_min_z), "slows")
            # a GPU clocked straggler_evict_drop or more below its job's median is slow, whatever a model
            # fitted on this job's history says (history that may hold such windows already)
            # its clock drop: against its own baseline relative to the job's, or its working GPU's clock against
            # the job's working GPUs' now, whichever is larger (a GPU slow since it joined, or since the job
            # began, has no healthy baseline of its own to drop from)
            drop = float(row[_CLOCK])
            slowest = below.get(node)
            if slowest is not None and slowest["below"] > drop:
                drop = slowest["below"]
                worst["clock"] = {"gpu": slowest["gpu"], "value": slowest["value"], "job_median": slowest["job"],
                                  "below_job": round(drop, 4), "reasons": win.reasons.get(slowest["gpu"], 0)}
            evident = n >= 3 and cfg.straggler_evict_drop > 0 and drop >= cfg.straggler_evict_drop
            if evident and (fam_hit is None or fam_hit[0] == "nic"):
                fam_hit = ("gpu", drop, float(z[_CLOCK]), float(cfg.straggler_evict_drop), "rule")
            if fam_hit is not None and fam_hit[0] == "thermal" and float(x[_RISE]) < cfg.soft_min_z * _FLOOR[_RISE]:
                fam_hit = None          # hotter than its peers only because they cooled (they wait on a slow node
                                        # and kept their busy baselines): a hot GPU is also hotter than its own normal
            if fam_hit is not None and fam_hit[0] == "gpu" and fam_hit[4] != "rule" \
                    and float(z[_RISE]) >= cfg.soft_min_z and float(x[_RISE]) >= cfg.soft_min_z * _FLOOR[_RISE] \
                    and worst.get("thermal", {}).get("gpu") == worst.get("clock", {}).get("gpu"):
                fam_hit = ("thermal", *fam_hit[1:])   # its slow GPU is hot too (hotter than its own normal): the
                                                      # heat slows it, whichever feature stood out further
            if fam_hit is not None and fam_hit[0] == "thermal" and fam_hit[4] != "rule" \
                    and worst.get("util", {}).get("drop", 0.0) <= -_WAIT_UTIL:
                fam_hit = None          # hotter than its baseline only because busier than when it learned it (a
                                        # job's slow first steps at low load; its peers, if 3+, rose alike)
            if fam_hit is not None and fam_hit[4] not in ("rule", "reason", "slows") and self._waiting(x, worst, fam_hit[0]):
                fam_hit = None          # a node whose GPUs wait on a slow peer suffers the slowdown, it is no cause
                self.waiting += 1
            if fam_hit is None and node == culprit:
                fam_hit = ("gpu", float(culprit_gap), float(culprit_gap / 0.05), _WAIT_PEERS, "wait")
            scores[node] = fam_hit
            if fam_hit is not None:
                flagged.add(node)
            out += self._advance(state, ns, win, row, z, worst, fam_hit, n, now, evident, drop)
        # a node of the job that is the cause of a soft fault slows every other one (they wait at the
        # all-reduce, by less than _WAIT_UTIL when the fault is mild): the others' windows meanwhile are not
        # their normal either, or their baselines learn the waiting power and, once the fault ends, the
        # node that caused it stands out against them (a false straggler)
        culprit_open = bool(flagged) or any(p[3].open_fault is not None for p in peers.values())
        for row, (node, (x, worst, medians, ns, state, _)) in zip(rel, peers.items()):
            if node in flagged or ns.open_fault is not None:
                continue
            for fam, cols in FAMILIES.items():
                self.history[fam].append(row[list(cols)])
            if (culprit_open or worst.get("util", {}).get("drop", 0.0) >= _WAIT_UTIL) and ns.waited < _WAIT_LEARN:
                ns.waited += 1      # waiting on a slow peer is not this node's normal: its baselines keep
                continue            # (unless it lasts: then it is the job's new normal)
            ns.waited = 0
            for k, m in medians.items():
                ns.base[k].append(m)
        self.since_fit += 1
        return out

    def _judge_stood(self, peers: dict, now: float) -> list[FaultEvent]:
        """Windows in which the node's step stood still (a pause, a hang, a job waiting for a lost node):
        their GPUs idle or spin, so nothing of them is learned and nothing is judged but the NIC's error
        rate. A failing link shows its symbol and receive errors without traffic, and a job that stands
        still because of another fault must not hide it (a link degraded for a minute while the job waited
        for a lost node was missed). An error rate ``soft_cold_z`` spreads or more above the clean median
        (against the job's median as well, with 3 nodes or more stood still in the window) is a hit; a
        window without one breaks the node's run of anomalous windows (the windows on either side of a
        stop, each half spent waiting, are no slowdown's run)."""
        cfg = self.config
        n = len(peers)
        errs = [float(p[0][_ERR]) for p in peers.values()]
        median = _median(errs) if n >= 3 else 0.0
        out: list[FaultEvent] = []
        for err, (node, (x, worst, medians, ns, state, win)) in zip(errs, peers.items()):
            row = np.zeros(len(FEATURES))
            row[_ERR] = err - median
            z = np.zeros(len(FEATURES))
            z[_ERR] = (row[_ERR] - self.center[_ERR]) / self.spread[_ERR]
            if z[_ERR] < cfg.soft_cold_z:
                ns.stalled = max(ns.stalled, win.index)
                continue
            worst = {"nic_errors": {"value": round(err, 3), "job_median": round(median, 3),
                                    "steps": [min(win.steps), max(win.steps)]}}
            hit = ("nic", float(z[_ERR]), float(z[_ERR]), float(cfg.soft_cold_z), "stood")
            out += self._advance(state, ns, win, row, z, worst, hit, n, now)
        return out

    @staticmethod
    def _in_step(ns: _NodeSoft, medians: dict) -> bool:
        """Whether the node's window, in which its step did not move, is part of a step as long as several
        windows (a large model's step of 20-40 s) rather than a standstill: its step moved ``g`` windows apart
        or more (the median of its last moves, ``g`` >= 2), the window is less than 1.5 g after its last move,
        and its GPUs work at half their baseline power or more (a pause idles them, and a hang idles them or
        spins at a wait's power, so those windows still stand). Such a window is judged as one that moved:
        otherwise only the window of each step's end would be, and a slowdown of a job of long steps would
        be found minutes late. ``medians``: the window's per-GPU medians (``_raw_features``). Keeps, in
        ``ns``, where the node's step moved (job side: the windows come in order)."""
        win = ns.window
        if not win.steps:
            return False
        if min(win.steps) != max(win.steps):
            if ns.moved >= 0 and win.index > ns.moved:
                ns.gaps.append(win.index - ns.moved)
            ns.moved = win.index
            return False
        if ns.moved < 0 or len(ns.gaps) < 3 or not win.index > ns.moved:
            return False
        g = _median(ns.gaps)
        if g < 2 or win.index - ns.moved >= 1.5 * g:
            return False
        now, base = [], []
        for gi in win.gpu:
            hist = ns.base.get((gi, DCGM.POWER_USAGE))
            if hist and (gi, DCGM.POWER_USAGE) in medians:
                now.append(medians[(gi, DCGM.POWER_USAGE)])
                base.append(_median(hist))
        return bool(now) and _median(now) >= _STEP_POWER * _median(base)

    @staticmethod
    def _waiting(x, worst: dict, fam: str) -> bool:
        """Whether a node's GPU or NIC symptoms are those of waiting on a slow peer: its utilisation fell
        (>= 10 % of its own baseline) while its SM clock did not, and no NIC errors (link_degraded needs
        errors or a bandwidth drop of its own, not the job's)."""
        drop = worst.get("util", {}).get("drop", 0.0)
        if drop < _WAIT_UTIL or x[_CLOCK] >= _WAIT_UTIL or fam == "thermal":
            return False
        return fam == "gpu" or x[_ERR] < _FLOOR[_ERR]

    @staticmethod
    def _below_job(view: _View, peers: dict) -> dict[str, dict]:
        """Per node of ``peers`` (judged in ``view``, a job of 3+), its slowest working GPU against the
        median SM clock of the job's working GPUs in this window: ``{"gpu", "value", "job", "below"}``
        (``below`` a share of ``job``). A GPU works when its utilisation is at least ``_WORKING_UTIL`` of
        the job's median: a GPU the job leaves unused idles at a fraction of its clock, and a spare's first
        window in a job, half of it idle, is not a slow GPU; a slow one is as busy as its peers or busier
        (they wait for it). Needs 3 nodes with a working GPU. Assumes one GPU model per job."""
        if view.clock is None or int(view.works.sum()) < 3:
            return {}
        out = {}
        for node, p in peers.items():
            g = _View.working(p, view.floor)
            if g:
                m, gi = min(g)
                out[node] = {"gpu": gi, "value": m, "job": view.clock, "below": (view.clock - m) / max(view.clock, 1.0)}
        return out

    @staticmethod
    def _job_waits(view: _View, node: str) -> float:
        """The median utilisation drop (against their own baselines) of the job's nodes other than ``node``."""
        drops = [d for n, d in zip(view.nodes, view.drops.tolist()) if n != node and d == d]
        return _median(drops) if drops else 0.0

    @staticmethod
    def _keeps_working(view: _View) -> tuple[str | None, float]:
        """The one node of a job of 3+ whose GPUs keep their utilisation while at least two thirds of the
        others' fall by ``_WAIT_PEERS`` or more (they wait for it at the all-reduce): the straggler, even
        when its clocks look healthy. None when no single node stands out that way."""
        if len(view.nodes) < 3 or np.isnan(view.drops).any():
            return None, 0.0
        drops = dict(zip(view.nodes, view.drops.tolist()))
        keep = [n for n, d in drops.items() if d < _WAIT_UTIL / 2]
        if len(keep) != 1:
            return None, 0.0
        others = [d for n, d in drops.items() if n != keep[0]]
        waiting = sum(1 for d in others if d >= _WAIT_PEERS)
        if waiting * 3 < 2 * len(others):
            return None, 0.0
        return keep[0], float(_median(others))

    def _fit(self) -> None:
        cfg = self.config
        for fam, hist in self.history.items():
            H = np.vstack(hist)
            model = make_model(cfg.soft_detector)
            model.fit(H)
            s = np.asarray(model.decision_scores_, dtype=float)
            self.models[fam] = model
            q = float(np.quantile(s, cfg.soft_quantile))
            self.thresholds[fam] = q + abs(q) * (cfg.soft_margin - 1.0)
        allh = np.hstack([np.vstack(self.history[f]) for f in FAMILIES])
        order = [c for cols in FAMILIES.values() for c in cols]
        center = np.median(allh, 0)
        # the clean history's 99th percentile off the median, from its quartiles (2.33 sigma, = 3.45 x the
        # half interquartile range): unmoved by the few percent of a missed fault's windows the history holds
        # (its raw 99th percentile took a missed straggler's windows as the spread, and the next was missed too)
        q25, q75 = np.percentile(allh, [25, 75], 0)
        spread = 2.33 / 1.349 * (q75 - q25)
        self.center = np.zeros(len(FEATURES))
        self.spread = _FLOOR.copy()
        for j, c in enumerate(order):
            self.center[c] = center[j]
            self.spread[c] = max(_FLOOR[c], spread[j])
        self.since_fit = 0

    def _classify(self, fam: str, worst: dict) -> FaultClass:
        if fam == "nic":
            return FaultClass.LINK_DEGRADED
        reasons = int(worst.get("clock", {}).get("reasons", 0))
        if fam == "thermal" or reasons & _THERMAL_BITS:
            return FaultClass.THERMAL
        if reasons & _POWER_CAP_BITS:
            return FaultClass.POWER_CAP
        return FaultClass.STRAGGLER

    def _advance(self, state: NodeState, ns: _NodeSoft, win: _Window, row, z, worst, hit, n_peers, now,
                 evident: bool = False, clock_drop: float = 0.0) -> list[FaultEvent]:
        """One decided window of a node (``win``, the window judged: the node may have opened its next one);
        ``evident``: its SM clock is ``straggler_evict_drop`` or more below its job's median; ``clock_drop``:
        how far (``_decide``)."""
        cfg = self.config
        if hit is None:
            ns.run = 0
            if ns.open_fault is not None:
                ns.clean += 1
                if ns.clean >= cfg.soft_clear:
                    f, ns.open_fault, ns.clean = ns.open_fault, None, 0
                    return [FaultEvent(**{**f.__dict__, "resolved": True, "detected_ts": now,
                                          "observed_ts": win.last_ts,
                                          "summary": f"resolved: {f.summary}"})]
            return []
        ns.clean = 0
        if ns.open_fault is not None:
            return []
        if ns.run and ns.stalled > ns.run_index and n_peers < 3:
            ns.run = 0                  # the job stood still in between: the windows on either side of a stop (a
                                        # hang's first and last, half of each spent waiting) are no slowdown's run
                                        # (in a job of 3+ the job's median takes the waiting out of both)
        if ns.run == 0:
            ns.run_start, ns.run_hot = win.first_ts, False
        ns.run += 1
        ns.run_index = win.index
        ns.run_hot = ns.run_hot or hit[0] == "thermal"
        if ns.run < (cfg.straggler_evict_windows if evident else cfg.soft_consecutive):
            return []
        fam, score, zmax, threshold, mode = hit
        if fam == "gpu" and mode not in ("rule", "reason") and ns.run_hot:
            fam = "thermal"     # a window of the run found the slow GPU hot: the heat slows it, though this window
                                # did not show it (its rise under the gate by noise, or the job paused and the GPU
                                # cooled with its peers: agents of 5 s, whose window is two samples)
        cls = self._classify(fam, worst)
        severity, action = Severity.WARNING, Action.OBSERVE
        if cls == FaultClass.STRAGGLER and clock_drop >= cfg.straggler_evict_drop:
            severity, action = Severity.CRITICAL, Action.EVICT    # a whole job waits on it: replace it
        feats = {name: {"value": round(float(row[i]), 4), "z": round(float(z[i]), 2)} for i, name in enumerate(FEATURES)}
        top = sorted(feats, key=lambda n: -feats[n]["z"])[:3]
        evidence = {"class": cls.value, "family": fam, "score": round(score, 4),
                    "threshold": round(threshold, 4), "z": round(zmax, 2),
                    "model": {"model": cfg.soft_detector, "cold": "cold start: z off the job's median",
                              "rule": f"SM clock {cfg.straggler_evict_drop:.0%} or more below the job's median",
                              "wait": "its GPUs keep working while most peers' utilisation fell (they wait for it)",
                              "z": "one feature soft_cold_z spreads or more off the job's clean median",
                              "reason": "SM clock soft_min_z noise floors or more below the job's median, with a "
                                        "power-cap or thermal clock-event reason",
                              "slows": "SM clock soft_min_z spreads or more below the job's median while the other "
                                       "nodes' utilisation fell (they wait for it)",
                              "stood": "NIC error rate soft_cold_z spreads or more above the clean median while the "
                                       "job stood still (a failing link shows errors without traffic)"}[mode],
                    "top_features": {n: feats[n] for n in top}, "devices": worst,
                    "window_s": cfg.soft_window_s, "window": [win.first_ts, win.last_ts],
                    "since_ts": ns.run_start, "peers": n_peers,
                    "baseline": "each device's own clean history" + (", relative to the job's median" if n_peers >= 3 else "")}
        dev = worst.get({"thermal": "thermal", "gpu": "clock", "nic": "nic_bw"}[fam], {})
        where = f"GPU {dev['gpu']}" if "gpu" in dev else f"port {dev['device']}" if "device" in dev else "NIC"
        detector = {"model": f"pyod.{cfg.soft_detector}.peers", "cold": "peers.cold", "rule": "peers.rule",
                    "wait": "peers.wait", "z": "peers.z", "reason": "peers.reason",
                    "slows": "peers.slows", "stood": "peers.stood"}[mode]
        f = fault(KIND_OF[cls], severity, action,
                  fault_id=stable_id(state.node, "soft", cls.value, ns.run_start), node=state.node,
                  job=None if win.job == state.node else win.job, detector=detector,
                  observed_ts=win.last_ts, now=now,
                  score=score, threshold=threshold, evidence=evidence,
                  summary=(f"{cls.value} on {state.node} {where}: SM clock {dev['value']:.0f} MHz, {clock_drop:.0%} "
                           f"below the job's median, for {ns.run} windows" if mode == "rule" else
                           f"{cls.value} on {state.node} {where}: {top[0]} {feats[top[0]]['value']:g} "
                           f"({feats[top[0]]['z']:.1f} spreads from the clean median) for {ns.run} windows"))
        ns.open_fault = f
        return [f]
