"""When to save: the checkpoint interval that loses the least training time, from what a save costs.

A save costs the job ``C`` seconds of training: its blocking stall plus the slowdown of the steps
that run while it is hashed, replicated and persisted (on a shared host the daemons take cores and
memory bandwidth from the ranks). A fault that rolls the job back to its newest checkpoint costs,
on average, half an interval of recomputation. With ``M`` the mean time between such faults, the
fraction of training time lost to both is ``C / T + T / (2 M)``, least at Young's interval::

    T = sqrt(2 C M)          lost fraction at T: sqrt(2 C / M) (half saves, half recomputation)

(Daly's refinement adds the restart time, negligible next to ``M``.) :func:`young` and :func:`plan`
evaluate it (``transom ckpt plan --save-cost C --mtbf M``); :class:`Cadence` applies it to a running
job: it times every step, measures ``C`` of each save as the stall plus the excess over the median
quiet step of the steps that ran while the save was in flight, and saves again ``T / step time``
steps later.

Only a fault that relaunches the job rolls it back: one healed in the job (the survivors keep their
state, a spare takes it from them, :mod:`transom.elastic`) recomputes nothing. With faults every
``M`` seconds (``TRANSOM_CKPT_MTBF_S``, any kind) of which a share ``p`` needs a relaunch, rollbacks
come every ``M / p`` and the interval is ``sqrt(2 C M / p)``. The cadence learns ``p`` from the job
itself. A job that cannot heal in place (no elastic group: ``due()`` is called without an ``epoch``,
as a torchrun retry loop's) has ``p = 1``: every fault rolls it back. One that can (its ranks pass their
group's ``epoch``) starts from Laplace's rule of succession, one heal and one relaunch counted before
anything is seen (``p = 1/2``; until 4 December it started at 1, as if nothing healed)::

    p = (relaunches + 1) / (relaunches + heals + 2)        (elastic; without a group: 1)

relaunches: the job's generation (each relaunch starts a new one); heals: the groups this process
saw re-formed (each new ``epoch``). A job that heals every fault in place saves less and less often
(after four heals, at sqrt(3) x the first interval); one whose heals fall back to relaunches returns
to the short interval. The ``max_interval_s`` bound (30 min) still holds.

Every rank saves the same steps without a collective per step (on a host whose cores the ranks share,
one more tiny all-reduce per step cost 4.5-5 % of the step, docs/checkpoint.md "When to save"):
the ranks agree, with an all-reduce MAX (``agree``), on the next save step at each save step, and at
the first step of a new group (``epoch``: a heal re-formed it, a spare joined). The ranks that know the
job's schedule outvote one that does not (a spare that just joined), and among those that measured a
save the largest interval wins (the rank that saves the model sees the whole cost).

The first save comes ``first`` steps after the start, the second ``first`` steps later (the first one's
cost is measured meanwhile). The interval is at least one step more than the last save was in flight
(saves never queue) and at most ``max_interval_s`` of training.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from transom.log import get

__all__ = ["young", "plan", "IntervalPlan", "Cadence", "agree_max", "DEFAULT_MTBF_S", "DEFAULT_MAX_INTERVAL_S"]

log = get("checkpoint.cadence")

DEFAULT_MTBF_S = 4 * 3600.0          # a large job's interruptions (Llama 3: one per ~3 h on 16K GPUs)
DEFAULT_MAX_INTERVAL_S = 1800.0
_SAID = 1 << 48     # added to the vote of a rank that knows the schedule (or measured a save): above any step


def young(save_cost_s: float, mtbf_s: float) -> float:
    """Young's interval in seconds: ``sqrt(2 C M)``."""
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"save cost must be >= 0 and the mean time between faults > 0, got "
                         f"{save_cost_s} and {mtbf_s}")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


@dataclass(frozen=True)
class IntervalPlan:
    seconds: float                 # the interval, in seconds of training
    steps: int | None              # in steps, when the step time is known
    save_fraction: float           # of training time lost to saves: C / T
    rollback_fraction: float       # lost to recomputation after faults: T / 2M

    @property
    def lost_fraction(self) -> float:
        return self.save_fraction + self.rollback_fraction


def plan(save_cost_s: float, mtbf_s: float, step_s: float | None = None, *, rollback_share: float = 1.0,
         min_steps: int = 1, max_interval_s: float = DEFAULT_MAX_INTERVAL_S) -> IntervalPlan:
    """The interval for a save cost and a fault rate, of whose faults ``rollback_share`` roll the job back
    (relaunch from the checkpoint): Young's with ``M / rollback_share``, within ``[min_steps, max_interval_s]``."""
    if step_s is not None and step_s <= 0:
        raise ValueError(f"step time must be > 0, got {step_s}")
    if not 0 < rollback_share <= 1:
        raise ValueError(f"the share of faults that roll back must be in (0, 1], got {rollback_share}")
    between_rollbacks = mtbf_s / rollback_share
    seconds = min(young(save_cost_s, between_rollbacks), max_interval_s)
    steps = None
    if step_s is not None:
        steps = max(min_steps, round(seconds / step_s))
        seconds = steps * step_s
    seconds = max(seconds, 1e-9)
    return IntervalPlan(seconds, steps, save_cost_s / seconds, seconds / (2.0 * between_rollbacks))


class Cadence:
    """The save schedule of one rank. Each step: :meth:`tick`, then :meth:`due`; :meth:`saved` after each
    save."""

    def __init__(self, mtbf_s: float = DEFAULT_MTBF_S, *, first: int = 10, relaunches: int = 0,
                 max_interval_s: float = DEFAULT_MAX_INTERVAL_S, window: int = 64, clock=time.perf_counter) -> None:
        if mtbf_s <= 0 or first < 1 or max_interval_s <= 0 or relaunches < 0:
            raise ValueError(f"mtbf_s and max_interval_s must be > 0, first >= 1 and relaunches >= 0, got "
                             f"{mtbf_s}, {max_interval_s}, {first}, {relaunches}")
        self.mtbf_s, self.first, self.max_interval_s = mtbf_s, first, max_interval_s
        self.relaunches = relaunches                         # the job's generation: relaunches so far
        self.heals = 0                                       # groups re-formed (epochs) this process saw
        self._clock = clock
        self._last_tick: float | None = None
        self._quiet: deque[float] = deque(maxlen=window)     # step times with no save in flight
        self.costs: deque[float] = deque(maxlen=8)          # measured cost of recent saves, s
        self._open: dict | None = None                       # the save being measured
        self._start: int | None = None
        self._busy_steps = 0                                 # steps the last measured save was in flight
        self.interval: IntervalPlan | None = None
        self.next_save: int | None = None                    # agreed by the job's ranks
        self._epoch: int | None = None

    @property
    def step_s(self) -> float | None:
        """Median step time with no save in flight."""
        return statistics.median(self._quiet) if len(self._quiet) >= 3 else None

    @property
    def save_cost_s(self) -> float | None:
        return statistics.median(self.costs) if self.costs else None

    @property
    def rollback_share(self) -> float:
        """The share of the job's faults that roll it back (a relaunch), as far as this process knows: 1 for a
        job that cannot heal in place, else Laplace's estimate from its relaunches and heals."""
        in_job = self._epoch is not None                     # due() was given the group's epoch
        return (self.relaunches + 1) / (self.relaunches + self.heals + 1 + int(in_job))

    def tick(self, step: int, busy: bool) -> None:
        """Step ``step`` just ended; ``busy``: a save's background work ran during it."""
        now = self._clock()
        dt = None if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        if self._start is None:
            self._start = step
        m = self._open
        if dt is not None:
            if m is not None and (busy or m["busy"]):
                m["steps"].append(dt)
                m["busy"] = busy
            elif m is not None:          # the save's work ended before this step: measured
                self._close(m)
                self._quiet.append(dt)
            else:
                self._quiet.append(dt)

    def due(self, step: int, agree: Callable[[int], int], epoch: int | None = None) -> bool:
        """Whether to save ``step``. ``agree(vote)`` returns the largest vote of the job's ranks (a
        collective): it is called only where every rank calls it, at the first step of each ``epoch``
        (of the group: a heal changes it; None: the job has no elastic group, a fault relaunches it) and at
        each save step."""
        if self.next_save is None or epoch != self._epoch:
            if self._epoch is not None and epoch != self._epoch:
                self.heals += 1                  # the group was re-formed: a fault healed without a rollback
                if self.interval is not None:
                    self._replan()
            self._epoch = epoch
            vote = self.next_save + _SAID if self.next_save is not None else (self._start or step) + self.first - 1
            self.next_save = _decode(agree(vote))
        if step < self.next_save:
            return False
        steps = self.interval.steps if self.interval is not None else self.first
        self.next_save = _decode(agree(step + steps + (_SAID if self.interval is not None else 0)))
        return True

    def saved(self, step: int, stall_s: float) -> None:
        """A save of ``step`` blocked the training for ``stall_s``; its background work starts now."""
        if self._open is not None:
            self._close(self._open)
        self._open = {"step": step, "stall": stall_s, "steps": [], "busy": True}

    def _close(self, m: dict) -> None:
        self._open = None
        base = self.step_s
        if base is None:
            return
        # the step that held the stall, then the ones slowed by the work, each over the quiet step; each
        # excess capped (a long pause that fell in the window is not the save's doing)
        caps = [m["stall"] + base] + [base] * (len(m["steps"]) - 1)
        excess = sum(min(dt - base, cap) for dt, cap in zip(m["steps"], caps))
        self.costs.append(max(0.0, excess) if m["steps"] else m["stall"])
        self._busy_steps = len(m["steps"])
        self._replan()

    def _replan(self) -> None:
        before = self.interval
        self.interval = plan(self.save_cost_s or 0.0, self.mtbf_s, self.step_s, rollback_share=self.rollback_share,
                             min_steps=self._busy_steps + 1, max_interval_s=self.max_interval_s)
        if before is None or abs(self.interval.steps - before.steps) > 0.2 * before.steps:
            log.info("checkpoint interval %d steps (%.1f s): a save costs %.2f s of training, faults every %.0f s "
                     "(TRANSOM_CKPT_MTBF_S), %.0f %% of them relaunches (%d healed in the job, %d relaunched): "
                     "%.1f %% of training time lost to saves, %.1f %% expected to recomputation",
                     self.interval.steps, self.interval.seconds, self.save_cost_s, self.mtbf_s,
                     100 * self.rollback_share, self.heals, self.relaunches, 100 * self.interval.save_fraction,
                     100 * self.interval.rollback_fraction)



def _decode(vote: int) -> int:
    return vote - _SAID if vote >= _SAID else vote


def agree_max(value: int) -> int:
    """The largest ``value`` of the ranks of torch.distributed's default group (``value`` without one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
