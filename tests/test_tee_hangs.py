"""Hangs told from pauses (streams/hangs.py), on the pure engine: three nodes of one synchronous job."""

from __future__ import annotations

import pytest

from transom import contracts as c
from transom.config import ConfigError
from transom.streams.config import TEEConfig
from transom.streams.engine import TEEEngine

T0 = 1_700_000_000.0
NODES = ("node0", "node1", "node2")


def _batch(node: str, ts: float, step: int, *, util: float | tuple = 95.0, hb: float = 0.3, phase: str = "",
           stack: str = "", stopped: bool = False, rank: int | None = None, step_time: float = 0.5,
           power: float | None = None, seq: int | None = None, write: float | None = None,
           bye: bool = False) -> c.MetricBatch:
    """``util``: every GPU's utilisation (two GPUs), or a tuple of each GPU's; ``power``: every GPU's power
    draw (None: not reported); ``write``: the rank process's write rate, bytes per second (None: unknown);
    ``bye``: the agent's goodbye batch (it stops: a restart, an upgrade)."""
    fields = {"step": step, "loss": 2.0, "step_time": step_time, "alive": 1, "heartbeat_age_s": hb}
    if bye:
        fields["agent_stopping"] = 1
    if stopped:
        fields["stopped"] = 1
    if write is not None:
        fields["write_bytes_per_s"] = write
    tags = {"job": "j", "generation": "0", "pid": "77"}
    if phase:
        tags["phase"] = phase
    if stack:
        tags["stack"] = stack
    utils = util if isinstance(util, tuple) else (util, util)
    watts = {} if power is None else {c.DCGM.POWER_USAGE: power}
    gpus = tuple(c.Sample(c.Source.GPU, {c.DCGM.GPU_UTIL: u, c.DCGM.SM_CLOCK: 1980.0, **watts}, index=i)
                 for i, u in enumerate(utils))
    rank = int(node.removeprefix("node")) if rank is None else rank
    return c.MetricBatch(node=node, ts=ts, seq=int(ts - T0) if seq is None else seq, job="j",
                         samples=gpus + (c.Sample(c.Source.TRAIN, fields, index=rank, tags=tags),))


def _run(engine: TEEEngine, seconds: range, per_node, nodes=NODES) -> list[c.FaultEvent]:
    """Feed one batch per node per second; ``per_node(node, t)`` gives _batch's keywords (with ``step``),
    or None: that node sends nothing that second."""
    out = []
    for t in seconds:
        for node in nodes:
            kw = per_node(node, t)
            if kw is not None:
                out += engine.process(_batch(node, T0 + t, **kw), now=T0 + t + 0.1)
    return out


@pytest.fixture
def engine() -> TEEEngine:
    return TEEEngine(TEEConfig(soft_detectors=()))


def test_a_job_wide_pause_with_idle_gpus_is_not_a_hang_and_is_learned(engine):
    # 60 s steps, a 240 s job-wide stop (GPUs idle, heartbeats fresh; under the 300 s floor), 60 s steps again
    def feed(node, t):
        paused = 60 <= t < 300
        return {"step": 60 if paused else (t if t < 60 else t - 240), "util": 3.0 if paused else 95.0}

    assert _run(engine, range(360), feed) == []
    assert engine._hang.jobs["j"].longest_pause >= 239
    assert engine._hang.pause_limit(engine._hang.jobs["j"], "") == pytest.approx(1.5 * 240, abs=3)


def test_a_declared_checkpoint_phase_may_stand_still_past_the_pause_floor(engine):
    def feed(node, t):
        return {"step": min(t, 30), "util": 5.0 if t >= 30 else 95.0, "phase": "checkpoint" if t >= 30 else ""}

    assert _run(engine, range(400), feed) == []


def test_a_stopped_rank_is_the_one_hang_event_with_its_state_and_the_waiting_ranks_stacks(engine):
    # node1's rank stops at t=30 (heartbeat stops); the others wait in the all-reduce, GPUs spinning
    def feed(node, t):
        if t < 30:
            return {"step": t}
        if node == "node1":
            return {"step": 30, "util": 0.0, "hb": t - 30.0}
        return {"step": 30, "util": 100.0, "stack": "distributed_c10d.py:2050 all_reduce < train.py:80 step"}

    found = _run(engine, range(90), feed)
    assert [(f.kind, f.node, f.rank, f.evidence["cause"]) for f in found] == [(c.FaultKind.HANG, "node1", 1, "stuck")]
    [f] = found
    assert f.action == c.Action.RESTART and f.detected_ts - T0 <= 30 + 10 + 2      # within the step limit (one batch later)
    assert {w["node"] for w in f.evidence["waiting_ranks"]} == {"node0", "node2"}
    assert all("all_reduce" in w["stack"] for w in f.evidence["waiting_ranks"])


def test_a_rank_the_kernel_reports_stopped_is_hung_after_the_stopped_limit_not_the_step_limit(engine):
    # node2's rank is SIGSTOPped at t=30: the agent sees state T (stopped = 1) from the next sample on
    def feed(node, t):
        if t < 30:
            return {"step": t}
        if node == "node2":
            return {"step": 30, "util": 0.0, "hb": t - 30.0, "stopped": True}
        return {"step": 30, "util": 100.0}

    [f] = _run(engine, range(60), feed)
    assert (f.node, f.evidence["cause"], f.evidence["stopped"]) == ("node2", "stuck", True)
    assert 30 + 3 < f.detected_ts - T0 <= 30 + 3 + 2        # hang_stopped_s (3 s), not the 10 s step limit


def test_a_job_whose_ranks_are_all_stopped_is_not_hung_at_the_stopped_limit(engine):
    # the whole job suspended (every rank stopped): a pause until the pause limit, no rank singled out
    def feed(node, t):
        return {"step": min(t, 30), "util": 0.0 if t >= 30 else 95.0, "stopped": t > 30}

    assert _run(engine, range(60), feed) == []


def test_gpus_idle_on_one_node_while_its_peers_spin_name_that_node(engine):
    # no heartbeat evidence at all (an older agent): only the GPUs tell who is not in the collective
    def feed(node, t):
        if t < 30:
            return {"step": t, "hb": 0.0}
        return {"step": 30, "util": 0.0 if node == "node2" else 100.0, "hb": 0.0}

    found = _run(engine, range(80), feed)
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node2", "not in the collective")]
    # named once it stood still and idled alone for the step limit (10 s), both counted from t=30; the
    # idling used to be counted only from the moment the stall passed the limit (t=51, twice the limit)
    assert found[0].observed_ts - T0 <= 30 + 10 + 1


def test_in_a_job_of_two_nodes_the_idle_one_while_the_other_spins_is_hung(engine):
    # one node against one: the other spinning is the whole rest of the job waiting for it
    def feed(node, t):
        if t < 30:
            return {"step": t, "hb": 0.0}
        return {"step": 30, "util": 0.0 if node == "node1" else 100.0, "hb": 0.0}

    found = _run(engine, range(80), feed, nodes=("node0", "node1"))
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node1", "not in the collective")]
    assert found[0].observed_ts - T0 <= 30 + 30


def test_one_idle_gpu_among_spinning_ones_names_its_node_though_its_other_gpus_spin(engine):
    # one rank per GPU: the stuck rank's GPU idles; every waiting rank's spins, its node's other GPU too
    # (node1's mean is 50 %, neither idle nor busy); no heartbeat evidence
    def feed(node, t):
        if t < 30:
            return {"step": t, "hb": 0.0}
        return {"step": 30, "util": (0.0, 100.0) if node == "node1" else 100.0, "hb": 0.0}

    found = _run(engine, range(80), feed)
    assert [(f.node, f.evidence["cause"], f.evidence["gpus_idle"]) for f in found] == \
        [("node1", "not in the collective", "1 of 2")]
    assert found[0].observed_ts - T0 <= 30 + 10 + 1


def _stuck_gpu_among_noisy_spins(noisy):
    """One rank per GPU, 8 GPUs a node: from t=30 node1's rank on GPU 0 is stuck (its GPU idles) and every other
    rank spins in the collective; ``noisy(node, t)`` gives the GPUs of that report sampled at 80 %."""
    def feed(node, t):
        if t < 30:
            return {"step": t, "util": (95.0,) * 8, "hb": 0.0}
        util = [100.0] * 8
        if node == "node1":
            util[0] = 0.0
        for i in noisy(node, t):
            util[i] = 80.0
        return {"step": 30, "util": tuple(util), "hb": 0.0}
    return feed


def test_one_idle_gpu_among_spinning_ones_sampled_with_noise_names_its_node(engine):
    # the spinning GPUs' utilisation is sampled with noise, one or two of the 23 at 80 % in each second's
    # reports (a spin is 100 % only on average): the stuck GPU still stands apart
    def noisy(node, t):
        return [1 + t % 7] if NODES.index(node) == t % 3 or node == "node2" and t % 2 else []

    found = _run(engine, range(80), _stuck_gpu_among_noisy_spins(noisy))
    assert [(f.node, f.evidence["cause"], f.evidence["gpus_idle"]) for f in found] == \
        [("node1", "not in the collective", "1 of 8")]
    assert found[0].observed_ts - T0 <= 30 + 10 + 1


def test_one_idle_gpu_among_spinning_ones_stays_apart_through_a_report_of_more_noise(engine):
    # every third second node0's report shows four of its GPUs at 80 %: more than a tenth of the 23 in between,
    # in that report only. The stuck GPU stood apart all along: one report does not end it
    def noisy(node, t):
        return [1, 2, 3, 4] if node == "node0" and t % 3 == 0 else []

    found = _run(engine, range(80), _stuck_gpu_among_noisy_spins(noisy))
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node1", "not in the collective")]
    assert found[0].observed_ts - T0 <= 30 + 10 + 1


def test_a_gpu_idle_all_along_is_not_the_job_s_and_names_no_node(engine):
    # node0 has a GPU the job does not use (idle while its rank steps); the job then stops with every GPU
    # it uses spinning (a deadlock inside mismatched collectives): nothing shows which rank, so no node is
    # named at the step limit; the stuck rank's GPU idling on node2 is still found beside it
    def feed(stuck_idles):
        def per_node(node, t):
            spare = (0.0, 95.0 if t < 30 else 100.0)
            if t < 30:
                return {"step": t, "hb": 0.0, **({"util": spare} if node == "node0" else {})}
            util = spare if node == "node0" else (0.0, 100.0) if node == "node2" and stuck_idles else 100.0
            return {"step": 30, "util": util, "hb": 0.0}
        return per_node

    assert _run(TEEEngine(TEEConfig(soft_detectors=())), range(120), feed(False)) == []
    found = _run(TEEEngine(TEEConfig(soft_detectors=())), range(80), feed(True))
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node2", "not in the collective")]


@pytest.mark.parametrize("others", [65.0, 3.0])
def test_one_idle_gpu_is_no_hang_while_the_others_do_not_all_spin(engine, others):
    # an evaluation-like stop (the others at 65 %) or a job-wide pause (all idle) with one GPU lower still:
    # nothing stands out, so the pause ceiling decides (300 s), not the step limit
    def feed(node, t):
        if t < 30:
            return {"step": t, "hb": 0.0}
        return {"step": 30, "util": (0.0, 100.0) if node == "node1" else others, "hb": 0.0}

    assert _run(engine, range(120), feed) == []


def test_in_a_one_node_job_one_idle_gpu_among_spinning_ones_is_hung_and_all_idle_is_a_pause():
    # one rank reports for the node (no peer ranks): its own GPUs are the evidence
    def feed(utils):
        return lambda node, t: {"step": t, "hb": 0.0} if t < 30 else {"step": 30, "util": utils, "hb": 0.0}

    hung = _run(TEEEngine(TEEConfig(soft_detectors=())), range(80), feed((100.0, 0.0, 100.0, 100.0)), nodes=("node0",))
    assert [(f.node, f.evidence["cause"], f.evidence["gpus_idle"]) for f in hung] == \
        [("node0", "not in the collective", "1 of 4")]
    paused = _run(TEEEngine(TEEConfig(soft_detectors=())), range(200), feed((2.0, 0.0, 3.0, 1.0)), nodes=("node0",))
    assert paused == []
    # two GPUs, one idle while the other spins: the whole rest of the job waits for it (as two nodes do)
    two = _run(TEEEngine(TEEConfig(soft_detectors=())), range(80), feed((0.0, 100.0)), nodes=("node0",))
    assert [(f.node, f.evidence["gpus_idle"]) for f in two] == [("node0", "1 of 2")]


def test_a_rank_behind_its_stepping_peers_is_hung(engine):
    def feed(node, t):
        return {"step": min(t, 20) if node == "node0" else t, "hb": 0.0}

    found = _run(engine, range(60), feed)
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node0", "behind")]


def test_in_a_declared_phase_rank_0_working_alone_while_the_others_wait_is_no_hang_until_its_ceiling():
    # rank 0 saves (or scores an eval) with its GPUs idle while the other ranks wait at a barrier, their
    # GPUs spinning in the collective: undeclared, that is a node not in the collective (10 s); declared,
    # it is the phase's work, up to the phase's ceiling (here 400 s; heartbeats fresh, nothing stuck)
    def feed(phase):
        def per_node(node, t):
            if t < 30:
                return {"step": t}
            return {"step": 30, "util": 0.0 if node == "node0" else 100.0, "phase": phase if node == "node0" else ""}
        return per_node

    declared = TEEEngine(TEEConfig(soft_detectors=(), hang_phase_ceilings={"checkpoint": 400.0}))
    found = _run(declared, range(460), feed("checkpoint"))
    assert [(f.node, f.evidence["cause"], f.threshold) for f in found] == [("node0", "pause ceiling", 400.0)]
    assert found[0].observed_ts - T0 > 30 + 400
    undeclared = _run(TEEEngine(TEEConfig(soft_detectors=())), range(60), feed(""))
    assert [(f.node, f.evidence["cause"]) for f in undeclared] == [("node0", "not in the collective")]


@pytest.mark.parametrize("idle", [0.0, (0.0, 100.0)], ids=["node idle", "one GPU idle"])
def test_rank_0_saving_undeclared_behind_a_barrier_is_no_hang_while_it_writes(idle):
    """DDP's own examples save with ``if rank == 0: torch.save(...)`` and a barrier: rank 0's GPU idles while
    it writes, the other ranks spin in the collective. Without a declared phase that was a node "not in the
    collective" at the step limit (a restart at every save longer than 10 s). The agent measures how fast the
    rank's process writes (``write_bytes_per_s``): one that writes at a save's rate is saving."""
    def feed(write_until, rate=200e6):
        def per_node(node, t):
            if t < 30 or t >= 150:
                return {"step": t if t < 30 else t - 120, "write": 0.0 if node == "node0" else None}
            saving = node == "node0" and t < write_until
            return {"step": 30, "util": idle if node == "node0" else 100.0,
                    "write": (rate if saving else 2e3) if node == "node0" else None}
        return per_node

    # a save of 120 s (4 x 30 s, each file written between copies: 2 s without writes before each) resumes
    def chunked(node, t):
        kw = feed(150)(node, t)
        if node == "node0" and 30 <= t < 150 and t % 30 >= 28:
            kw["write"] = 0.0
        return kw

    assert _run(TEEEngine(TEEConfig(soft_detectors=())), range(200), chunked) == []
    # writes that stop while its GPU still idles alone: the hang, once the save's grace is over
    found = _run(TEEEngine(TEEConfig(soft_detectors=())), range(90), feed(50))
    assert [(f.node, f.rank, f.evidence["cause"]) for f in found] == [("node0", 0, "not in the collective")]
    assert 50 + 5 <= found[0].observed_ts - T0 <= 50 + 7
    assert found[0].evidence["write_bytes_per_s"] == 2e3
    # a log file's trickle is no save; the setting at 0 turns the evidence off
    for engine, per_node in ((TEEEngine(TEEConfig(soft_detectors=())), feed(150, rate=1e6)),
                             (TEEEngine(TEEConfig(soft_detectors=(), hang_save_write_mb_s=0)), feed(150))):
        found = _run(engine, range(60), per_node)
        assert [(f.node, f.evidence["cause"]) for f in found] == [("node0", "not in the collective")]
        assert found[0].observed_ts - T0 <= 30 + 12


def test_a_save_that_writes_past_the_checkpoint_ceiling_is_one_job_level_hang():
    def per_node(node, t):
        if t < 30:
            return {"step": t}
        return {"step": 30, "util": 0.0 if node == "node0" else 100.0, "write": 50e6 if node == "node0" else None}

    engine = TEEEngine(TEEConfig(soft_detectors=(), hang_phase_ceilings={"checkpoint": 400.0}))
    found = _run(engine, range(460), per_node)
    assert [(f.node, f.evidence["cause"], f.threshold, f.evidence["phase"]) for f in found] == \
        [("node0", "pause ceiling", 400.0, "checkpoint")]


def test_the_save_write_rate_setting_refuses_a_bad_value():
    for bad in (-1, "fast", True, float("inf")):
        with pytest.raises(ConfigError, match="hang_save_write_mb_s"):
            TEEConfig(hang_save_write_mb_s=bad)


def test_a_stop_longer_than_every_pause_is_one_job_level_hang(engine):
    def feed(node, t):
        return {"step": min(t, 20), "util": 5.0 if t > 20 else 95.0}

    found = _run(engine, range(380), feed)
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node0", "pause ceiling")]
    assert found[0].threshold == 300.0


def test_phase_ceilings_refuse_a_bad_value():
    with pytest.raises(ConfigError, match="hang_phase_ceilings"):
        TEEConfig(hang_phase_ceilings={"checkpoint": -1})
    assert dict(TEEConfig(hang_phase_ceilings={"eval": 60}).hang_phase_ceilings) == {"eval": 60}


def test_a_one_node_hiccup_right_after_a_job_wide_checkpoint_is_not_a_hang(engine):
    # a 15 s checkpoint (all idle), then node1's data loader idles it 3 s while the others spin: the stall
    # is long, but node1 idles alone only for a moment (shorter than the step limit)
    def feed(node, t):
        if t < 30:
            return {"step": t}
        if t < 45:
            return {"step": 30, "util": 5.0}
        if t < 48:
            return {"step": 30, "util": 5.0 if node == "node1" else 100.0}
        return {"step": t - 17}

    assert _run(engine, range(90), feed) == []


def test_a_node_gone_silent_does_not_hide_a_later_hang_of_its_job(engine):
    # node3 stops reporting at t=20 (its node lost, or its agent down) while the job steps on; at t=120
    # node2's GPUs idle while node0 and node1 spin (no heartbeat evidence): node2 is not in the collective.
    # node3's rank, last seen 100 s before, must not count as a peer that still steps (it held every rule)
    nodes = ("node0", "node1", "node2", "node3")

    def feed(node, t):
        if node == "node3":
            return {"step": t, "hb": 0.0} if t < 20 else None
        if t < 120:
            return {"step": t, "hb": 0.0}
        return {"step": 120, "util": 0.0 if node == "node2" else 100.0, "hb": 0.0}

    found = [f for f in _run(engine, range(200), feed, nodes) if f.kind == c.FaultKind.HANG]
    assert [(f.node, f.evidence["cause"]) for f in found] == [("node2", "not in the collective")]
    assert found[0].detected_ts - T0 <= 120 + 2 * 10 + 2        # idle alone for the step limit, after the stall's


def test_a_nodes_silent_gap_is_not_learned_as_a_pause_the_job_survived(engine):
    # node2's agent is down from t=30 to t=330 while the job steps on; its rank comes back 300 steps on.
    # It was never seen standing still: the job's pause limit stays at the floor
    def feed(node, t):
        if node == "node2" and 30 <= t < 330:
            return None
        return {"step": t, "hb": 0.0}

    assert [f for f in _run(engine, range(360), feed) if f.kind == c.FaultKind.HANG] == []
    job = engine._hang.jobs["j"]
    assert job.longest_pause < 5
    assert engine._hang.pause_limit(job, "") == 300.0


def test_a_rank_whose_clock_runs_ahead_is_not_behind_its_peers_as_a_pause_ends(engine):
    # a job-wide pause at t=30-44; node0's clock runs 1.5 s ahead, and its batch of t=44 (the pause's last,
    # sample time 45.5) comes after its peers' of t=45, their first step after the pause (sample time 45):
    # for a moment a peer's step seems to come before node0's last report of the pause. Its next report
    # shows the step: no hang (before, node0 was named hung, "behind", at once: a restart)
    def batch(node, t):
        step = t if t < 30 else 29 if t < 45 else t - 15
        return _batch(node, T0 + t + (1.5 if node == "node0" else 0.0), step=step, hb=0.0,
                      util=3.0 if 30 <= t < 45 else 95.0)

    out = []
    for t in range(80):
        for node in NODES:
            if node == "node0" and t in (44, 45):
                continue
            out += engine.process(batch(node, t), now=T0 + t + 0.1)
        if t == 45:
            out += engine.process(batch("node0", 44), now=T0 + t + 0.2)
            out += engine.process(batch("node0", 45), now=T0 + t + 0.3)
    assert out == []


def test_peers_are_told_by_when_the_tee_heard_them_not_by_their_skewed_clocks(engine):
    # node0's clock runs 15 s behind, node2's 15 s ahead; node2's rank stops at t=30 while the others step
    # on: it is behind its peers, although their sample times lie 15-30 s before its own
    skew = {"node0": -15.0, "node1": 0.0, "node2": 15.0}
    out = []
    for t in range(80):
        for node in NODES:
            step = min(t, 30) if node == "node2" else t
            out += engine.process(_batch(node, T0 + t + skew[node], step=step, hb=0.0), now=T0 + t + 0.1)
    assert [(f.node, f.evidence["cause"]) for f in out if f.kind == c.FaultKind.HANG] == [("node2", "behind")]


@pytest.mark.parametrize("idle", [0.0, (0.0, 100.0)], ids=["node idle", "one GPU idle"])
def test_a_replay_read_minutes_apart_finds_the_hang_a_live_worker_finds(idle):
    """Event clock, split (a replay, `transom tee --clock event`): the node side reads node0's metrics
    10 minutes of sample time behind the other nodes' (partitions read apart) and says how far it has
    read each node (:meth:`TEEEngine.read_up_to`); node3 falls silent for good at t=200 (its partition
    read on). The job's worker takes their rank reports in time order, so node2, idle while its peers
    spin from t=600 (its GPUs, or one of them: the counts travel in the job feed), is not in the
    collective, as in order; not held back by the silent node3."""
    config = TEEConfig(soft_detectors=(), clock="event")
    node_side, job_side = TEEEngine(config, split_peers=True), TEEEngine(config, split_peers=True)

    def feed(node, t):
        if node == "node3" and t >= 200:
            return None
        if t < 600:
            return {"step": t, "hb": 0.0}
        return {"step": 600, "util": idle if node == "node2" else 100.0, "hb": 0.0}

    found = []
    for t in range(900 + 600):
        for node in (*NODES, "node3"):
            at = t - 600 if node == "node0" else t        # node0 read 600 s behind
            if 0 <= at < 900 and (kw := feed(node, at)) is not None:
                found += node_side.process(_batch(node, T0 + at, **kw), now=T0 + at)
        node_side.read_up_to({"node0": T0 + t - 600, **{n: T0 + min(t, 900) for n in ("node1", "node2", "node3")}})
        for f in node_side.feeds():
            found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)))
    [hang] = [f for f in found if f.kind == c.FaultKind.HANG]
    assert (hang.node, hang.evidence["cause"]) == ("node2", "not in the collective")
    assert T0 + 600 < hang.detected_ts <= T0 + 600 + 30          # on the replay's clock, as live


def test_a_replay_whose_workers_read_hours_apart_waits_for_the_node_read_behind_and_finds_nothing():
    """Event clock, split, one worker per node: all three read together to t=95, then node1's worker reads on
    to t=1,500 and node0's to t=4,000 (more than ``JOB_REPORTS_WAIT_S`` past node2) while node2's, busy,
    is still at t=95. From t=96 node2's data loader hiccups for 5 s (its GPUs idle, the job stands still,
    the others spin): ordinary life. Node2's worker still sends its reports and read marks, so the job's
    worker waits for it, then takes the hiccup in time order, and finds nothing. Before, a node an hour
    of sample time behind the job's newest was taken for gone, the others' reports were taken without
    it, and node2 was found lost 2 s into its hiccup (a false evict; seen in the two-worker replay of 30
    clean node-hours on a busy machine)."""
    config = TEEConfig(soft_detectors=(), clock="event")
    sides = {n: TEEEngine(config, split_peers=True) for n in NODES}
    job_side = TEEEngine(config, split_peers=True)
    found = []

    def read(node, t):
        nonlocal found
        hiccup = 96 <= t < 101
        found += sides[node].process(_batch(node, T0 + t, step=95 if hiccup else t, hb=0.0,
                                            util=0.0 if hiccup and node == "node2" else 100.0), now=T0 + t)
        sides[node].read_up_to({node: T0 + t})
        for f in sides[node].feeds():
            found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)))

    for t in range(96):
        for node in NODES:
            read(node, t)
    for node, end in (("node1", 1500), ("node0", 4000), ("node2", 1500)):
        for t in range(96, end):
            read(node, t)
    assert [(f.node, f.kind.value, f.summary) for f in found] == []
    assert job_side.job_reports._jobs["j"].newest.keys() == set(NODES)    # none taken for gone


def test_a_replay_finds_no_node_lost_in_2_s_without_its_partition_read_past_it():
    """Event clock, split: node2's worker stops at t=95 (nothing more of node2: no report, no read mark).
    After 30 s of its worker's silence the job's worker stops waiting for it and takes the others'
    reports, in which the job stands still from t=96, the others spinning. The silence of node2 is
    the stopped worker's, not proven on node2's partition: no node lost before the heartbeat timeout
    (which node2's next worker decides). Before, the job's worker found it lost at t=97. (The job steps
    again from t=110, as after a hiccup.)"""
    config = TEEConfig(soft_detectors=(), clock="event")
    sides = {n: TEEEngine(config, split_peers=True) for n in NODES}
    job_side = TEEEngine(config, split_peers=True)
    wall = [0.0]
    job_side.job_reports.clock = lambda: wall[0]
    found = []
    for t in range(3800):           # past JOB_REPORTS_WAIT_S: node2 is given up on after its 30 s of nothing
        wall[0] = t
        for node in NODES:
            if node == "node2" and t >= 96:
                continue
            step = t if t < 96 else 95 if t < 110 else t - 14
            found += sides[node].process(_batch(node, T0 + t, step=step, hb=0.0, util=100.0), now=T0 + t)
            sides[node].read_up_to({node: T0 + t})
            for f in sides[node].feeds():
                found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)))
    assert "node2" not in job_side.job_reports._jobs["j"].newest       # given up on after 30 s
    assert [(f.node, f.kind.value) for f in found if f.kind == c.FaultKind.NODE_LOST] == []


def _live(engine: TEEEngine, seconds: range, per_node, nodes=NODES) -> list[c.FaultEvent]:
    """:func:`_run` with the heartbeat check a live worker runs every second."""
    out = []
    for t in seconds:
        out += _run(engine, range(t, t + 1), per_node, nodes)
        out += engine.check_heartbeats(now=T0 + t + 0.6)
    return out


def test_a_node_that_falls_silent_as_its_job_stops_and_its_peers_spin_is_lost_within_2_s_and_no_rank_hangs(engine):
    # node2 dies after its batch of t=29: its peers block in the next all-reduce, GPUs spinning, for good
    def feed(node, t):
        if t < 30:
            return {"step": t}
        return None if node == "node2" else {"step": 29, "util": 100.0}

    [f] = _live(engine, range(400), feed)          # past the 300 s pause floor: the job waits for its lost node
    assert (f.kind, f.node, f.action, f.detector) == (c.FaultKind.NODE_LOST, "node2", c.Action.EVICT, "rule.heartbeat")
    assert f.evidence["cause"] == "its job stopped as it fell silent"
    assert {w["node"] for w in f.evidence["waiting_ranks"]} == {"node0", "node1"}
    assert f.detected_ts - (T0 + 30) <= 2.0 < engine.config.heartbeat_timeout
    # the same fault the heartbeat timeout finds later (one id: a controller that sees both evicts once)
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 29)


def test_with_node_clocks_seconds_apart_a_late_node_of_a_job_that_stands_for_its_lost_node_is_not_lost_too(engine):
    """Four nodes whose clocks disagree: node1's and node3's run 2.5 s ahead, node2's 2 s behind. node2 dies after
    its batch of t=29 and is found lost; the job stands for it, spinning. node0's batches of t=33 and 34 are
    lost on the way: node0 is silent while its job stands, but the job stood for node2 before node0 fell
    silent. Compared on the nodes' own clocks, the job's stop (node1's t=29, stamped 31.5) looked 4.5 s later
    than node2's last batch (stamped 27), past the 4 s that tie a stop to a silence, and node0 was lost too."""
    nodes = ("node0", "node1", "node2", "node3")
    skew = {"node0": 0.0, "node1": 2.5, "node2": -2.0, "node3": 2.5}
    out = []
    for t in range(120):
        for node in nodes:
            if node == "node2" and t > 29 or node == "node0" and t in (33, 34):
                continue
            kw = {"step": t} if t < 30 else {"step": 29, "util": 100.0}
            out += engine.process(_batch(node, T0 + t + skew[node], **kw), now=T0 + t + 0.1)
        out += engine.check_heartbeats(now=T0 + t + 0.6)
    assert [(f.kind, f.node) for f in out] == [(c.FaultKind.NODE_LOST, "node2")]
    assert out[0].detected_ts - (T0 + 30) <= 2.0


def test_in_a_job_of_1_4_s_steps_a_node_lost_mid_step_is_found_within_2_s(engine):
    # steps of 1.4 s, reports every second: node2 dies at t=30.6, in step 22 (21 done at 29.4); its peers
    # never finish step 22. A healthy rank shows one step for at most 2 reports (a stall of 1 s): the wait
    # is told from a step by a stall of 2 s, the median step plus half a second (1.5 steps asked for 3 s)
    def feed(node, t):
        if node == "node2":
            return None if t >= 30.6 else {"step": int(t / 1.4), "step_time": 1.4}
        return {"step": min(int(t / 1.4), 21), "step_time": 1.4, "util": 100.0 if t >= 30.6 else 95.0}

    [f] = _live(engine, range(120), feed)
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped as it fell silent")
    assert f.detected_ts - (T0 + 30.6) <= 2.0


def test_a_node_silent_while_its_job_of_1_4_s_steps_steps_on_is_not_lost(engine, caplog):
    # a healthy rank of 1.4 s steps stands still for up to 1 s between reports: no wait, so no haste; and at the
    # heartbeat timeout its job has stepped on without a pause, which it cannot without node2's rank
    def feed(node, t):
        return None if node == "node2" and t >= 30 else {"step": int(t / 1.4), "step_time": 1.4, "util": 100.0}

    assert _live(engine, range(60), feed) == []
    assert "node node2 has sent no metrics for" in caplog.text and "only its agent is silent" in caplog.text


def _pause_with_restart(node2_back: float | None, pause_to: int = 90, bye: bool = True, spin_after: bool = False):
    """A job-wide pause (a checkpoint: steps stand, GPUs idle) from t=30 to ``pause_to``; node2's agent stops at
    t=40 (its goodbye batch where ``bye``) and is back at ``node2_back`` (None: never, the node lost); after the
    pause the job steps on, or (``spin_after``) its ranks spin in the next collective, waiting for node2."""
    def feed(node, t):
        if node == "node2" and t > 40 and (node2_back is None or t < node2_back):
            return None
        if t < 30:
            return {"step": t}
        if t < pause_to:
            return {"step": 29, "util": 2.0, "bye": bye and node == "node2" and t == 40}
        return {"step": 29, "util": 100.0} if spin_after else {"step": t - pause_to + 30}
    return feed


def test_an_agent_that_said_it_stops_is_not_lost_in_a_job_wide_pause_and_is_once_its_job_waits_for_it(caplog):
    """An agent restarted inside a job-wide pause: nothing steps, so nothing tells a silent agent from a lost
    node, and without its goodbye the node is lost at the heartbeat timeout (the case "An agent silent while
    its job trains on" left). With it the node is held: back at t=70, nothing; never back, and the job's ranks
    spin in the next collective after the pause, waiting for it: lost once they spun for the timeout without a
    step (a first step after a pause spins too); never back, the pause long: lost at ``heartbeat_bye_grace_s``."""
    new = lambda: TEEEngine(TEEConfig(soft_detectors=()))
    [f] = _live(new(), range(120), _pause_with_restart(70, bye=False))
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped with it")

    assert _live(new(), range(200), _pause_with_restart(70)) == []
    assert "since its agent said it stops" in caplog.text

    [f] = _live(new(), range(200), _pause_with_restart(None, spin_after=True))
    assert (f.kind, f.node, f.action) == (c.FaultKind.NODE_LOST, "node2", c.Action.EVICT)
    assert f.evidence["cause"] == "its agent said it stops, then its job stood waiting while it stayed silent"
    assert 96 <= f.detected_ts - T0 <= 98
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 40)

    [f] = _live(new(), range(200), _pause_with_restart(None, pause_to=170))
    assert f.evidence["cause"] == "its agent said it stops and did not come back"
    assert 100 <= f.detected_ts - T0 <= 102           # 60 s after its goodbye


def test_an_agent_that_said_it_stops_as_its_rank_hiccups_is_not_lost_and_its_host_shut_down_is(engine):
    """node2's agent stops at t=40 (its goodbye) as node2's own rank stalls 3 s in its data loader: its peers spin
    in the next collective, waiting for it, as node2 falls silent, which the fast rule took for a lost node (at
    2 s; 10406's pipeline replay). After a goodbye that wait must last the heartbeat timeout and two steps: the
    hiccup ends first, the job steps on, nothing. A host shut down (its agent says goodbye, then its ranks die
    and the peers spin for good) is lost once they waited that long."""
    def feed(node2_back):
        def f(node, t):
            if node == "node2" and t > 40 and (node2_back is None or t < node2_back):
                return None
            if t <= 40:
                return {"step": t, "bye": node == "node2" and t == 40}
            if node2_back is not None and t >= 44:
                return {"step": t - 3}
            return {"step": 40, "util": 100.0}
        return f

    assert _live(TEEEngine(TEEConfig(soft_detectors=())), range(120), feed(55)) == []
    [f] = _live(engine, range(120), feed(None))
    assert (f.kind, f.node) == (c.FaultKind.NODE_LOST, "node2")
    assert f.evidence["cause"] == "its agent said it stops, then its job stood waiting while it stayed silent"
    assert 46 <= f.detected_ts - T0 <= 49


def _every_5_s(engine: TEEEngine, seconds: int, per_node, late=lambda node, t: 0.1) -> list[c.FaultEvent]:
    """Agents that report every 5 s, node<k> at the seconds t with t % 5 == k (seq 0, 1, ...), each batch
    delivered ``late(node, t)`` s after its sample time; ``per_node`` as for :func:`_run`; the heartbeat check
    a live worker runs every second."""
    due = []
    for t in range(seconds):
        for k, node in enumerate(NODES):
            if t % 5 == k and (kw := per_node(node, t)) is not None:
                due.append((T0 + t + late(node, t), node, t, kw))
    due.sort()
    out, seq, i = [], dict.fromkeys(NODES, 0), 0
    for t in range(seconds):
        while i < len(due) and due[i][0] < T0 + t + 0.6:
            at, node, ts, kw = due[i]
            out += engine.process(_batch(node, T0 + ts, seq=seq[node], **kw), now=at)
            seq[node] += 1
            i += 1
        out += engine.check_heartbeats(now=T0 + t + 0.6)
    return out


def test_where_agents_report_every_5_s_a_late_batch_is_no_lost_node_and_a_node_lost_as_its_job_stops_is_found_soon():
    """1 s steps, agents that report every 5 s (docs/architecture.md's interval for 16,000 nodes). A batch of
    node1 2.5 s late while the job steps on is no lost node (it was, 7.4 s after the one before: the 6 s
    timeout of 1 s agents). node2 dies after its batch of t=32 and the job stops with it, its peers spinning:
    it is lost once it missed its next report by 2 s and its peers' reports show the wait (t=41), not after
    the 30 s that six missed reports take; and no rank of the job hangs."""
    def steps_on(node, t):
        return {"step": t}

    assert _every_5_s(TEEEngine(TEEConfig(soft_detectors=())), 300, steps_on,
                      late=lambda node, t: 2.5 if (node, t) == ("node1", 36) else 0.1) == []

    def lost(node, t):
        if node == "node2" and t > 32:
            return None
        return {"step": t} if t <= 32 else {"step": 32, "util": 100.0}

    [f] = _every_5_s(engine := TEEEngine(TEEConfig(soft_detectors=())), 400, lost)
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped as it fell silent")
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 32)
    assert f.detected_ts - (T0 + 32) <= 10.0 and f.evidence["heartbeat_timeout_s"] == 30.0
    assert engine._hang.jobs["j"].beats("node0") == 5.0


def test_where_agents_report_every_5_s_and_the_job_steps_every_half_second_a_silent_agent_is_no_lost_node(caplog):
    """0.5 s steps, agents that report every 5 s: each report of a rank moves its step by 10. node2's agent is
    silent for 80 s while the job steps on: held as stepping on (the steps its peers made are counted, not
    their reports: counted as one step each, 12 reports in twice the 30 s timeout stood for 12 of the 22 steps
    asked for, and the node was lost)."""
    def feed(node, t):
        return None if node == "node2" and 40 <= t < 120 else {"step": 2 * t, "step_time": 0.5}

    assert _every_5_s(TEEEngine(TEEConfig(soft_detectors=())), 200, feed) == []
    assert "only its agent is silent" in caplog.text


def _long_steps(node2_until: float, wait_from: float | None):
    """A job of 3 s steps, its GPUs at 560 W stepping: node2 sends nothing from ``node2_until``; from
    ``wait_from`` (None: never) the others stand still in step 10, spinning at 150 W (a spin-wait kernel)."""
    def feed(node, t):
        if node == "node2" and t >= node2_until:
            return None
        if wait_from is not None and t >= wait_from:
            return {"step": 10, "step_time": 3.0, "util": 100.0, "power": 150.0}
        return {"step": int(t / 3), "step_time": 3.0, "util": 100.0, "power": 560.0}
    return feed


def test_in_a_job_of_3_s_steps_a_node_lost_mid_step_is_found_within_2_s_by_its_peers_power(engine):
    # node2 dies at t=31.5, in step 10 (begun at 30): its peers block in the step's collectives and spin at a
    # fraction of their stepping power. Their step stood still for 3 s at t=33, which a healthy rank of 3 s
    # steps also shows: the stall alone (the median step plus half a second) decides at t=34, 2.5 s late
    [f] = _live(engine, range(90), _long_steps(31.5, 31.5))
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped as it fell silent")
    assert f.detected_ts - (T0 + 31.5) <= 2.0


def test_the_power_evidence_is_a_setting_that_names_its_key_and_can_be_turned_off():
    with pytest.raises(ConfigError, match=r"hang_wait_power=1\.5: expected a share of the stepping power"):
        TEEConfig(hang_wait_power=1.5)
    # off: the stall alone decides, the median step plus half a second (t=34, 2.5 s after the node died)
    [f] = _live(TEEEngine(TEEConfig(soft_detectors=(), hang_wait_power=0)), range(90), _long_steps(31.5, 31.5))
    assert f.evidence["cause"] == "its job stopped as it fell silent" and 2.0 < f.detected_ts - (T0 + 31.5) <= 3.0


def test_a_node_silent_while_its_job_of_3_s_steps_steps_on_at_full_power_is_not_lost(engine):
    # the job steps on: its ranks stand still up to 3 s between step moves at full power (computing); at the
    # heartbeat timeout (t=37) they are 2 steps past node2's last, 3 are asked for (the step in flight as it fell
    # silent, one more, and a report interval's worth), and they compute: the decision waits for the next step
    assert _live(engine, range(60), _long_steps(31.5, None)) == []


def test_a_node_silent_while_its_job_of_3_s_steps_stops_after_a_step_is_lost_once_the_step_stood(engine):
    # node2 falls silent at t=31.5; its peers finish one more step and stand still in step 12 from t=36, GPUs
    # spinning (no power samples). At the heartbeat timeout they compute (no decision); they made 2 steps since
    # node2's last report of 3 asked for, and stand: lost once they stood for the timeout, not held
    def feed(node, t):
        if node == "node2" and t >= 31.5:
            return None
        return {"step": min(int(t / 3), 12), "step_time": 3.0, "util": 100.0}

    [f] = _live(engine, range(90), feed)
    assert (f.kind, f.node, f.action, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", c.Action.EVICT,
                                                               "its job stopped with it")
    assert (f.evidence["steps_on"], f.evidence["steps_needed"]) == (2, 3)
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 31)
    assert 36 + 6 <= f.detected_ts - T0 <= 36 + 6 + 1.5


def test_in_a_job_of_8_s_steps_a_silent_agent_is_held_and_a_node_lost_is_found_once_its_peers_stood(engine, caplog):
    """Steps of 8 s, GPUs busy (no power samples). node2's agent is silent from t=40 to t=75 while the job steps
    on: the 3 steps asked for take 24 s, and the node is held (it was lost at twice the 6 s timeout, after one
    step). Then node2 dies at t=120 and its peers stand in step 15 spinning: lost once they stood for 1.5 of
    their steps, long before the 38 s the steps asked for would take."""
    def feed(node, t):
        if node == "node2" and (40 <= t < 75 or t >= 120):
            return None
        return {"step": min(t // 8, 15), "step_time": 8.0, "util": 100.0}

    [f] = _live(engine, range(220), feed)
    assert "node node2 has sent no metrics for" in caplog.text and "only its agent is silent" in caplog.text
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped with it")
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 119)
    assert f.detected_ts - (T0 + 120) <= 15.0


def test_a_node_lost_as_a_checkpoint_ends_is_found_within_2_s_as_its_peers_take_to_spinning(engine):
    # a checkpoint from t=30 (every rank still, GPUs idle); node2 dies at t=45, as it ends: instead of
    # stepping again, the others block in the next collective (their steps stood still for 15 s already)
    def feed(node, t):
        if node == "node2" and t >= 45:
            return None
        return {"step": min(t, 29), "util": 3.0 if 30 <= t < 45 else 95.0 if t < 30 else 100.0}

    [f] = _live(engine, range(120), feed)
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped as it fell silent")
    assert f.detected_ts - (T0 + 45) <= 2.0


FOUR = ("node0", "node1", "node2", "node3")


def test_a_peer_whose_batches_are_late_while_its_job_waits_for_a_lost_node_is_not_lost_too(engine):
    # node3 dies after its batch of t=29 and the job waits for it, GPUs spinning; node1's batches of t=31 and
    # 32 come late (its agent stalled): 2 s of silence while its job stands, but the job stood for node3
    def feed(node, t):
        if node == "node3" and t >= 30 or node == "node1" and t in (31, 32):
            return None
        return {"step": min(t, 29), "util": 95.0 if t < 30 else 100.0}

    found = _live(engine, range(60), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node3")]
    assert found[0].detected_ts - (T0 + 30) <= 2.0


def test_a_peer_whose_batches_are_late_while_a_rank_of_its_job_is_stuck_is_not_lost(engine):
    # from t=30 node0's rank is stuck (its GPU idles, its node's 7 others spin with the waiting ranks);
    # node1's batches of t=31 and 32 come late: the job stands for node0, whose hang is what is found
    def feed(node, t):
        if node == "node1" and t in (31, 32):
            return None
        if t < 30:
            return {"step": t}
        return {"step": 29, "util": (0.0,) + (100.0,) * 7 if node == "node0" else 100.0}

    found = _live(engine, range(60), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.HANG, "node0")]


def test_a_peer_whose_batch_is_lost_during_another_node_s_data_loader_hiccup_is_not_lost(engine):
    # node0's data loader stalls for 2 s (its GPUs idle, the job stands with it, the others' GPUs busy), and the
    # job's next step takes 3 s more; node1's batches of t=32 and 33 never come: ordinary life twice over
    def feed(node, t):
        if node == "node1" and t in (32, 33):
            return None
        return {"step": 29 if 30 <= t < 35 else (t if t < 30 else t - 5),
                "util": 5.0 if 30 <= t < 32 and node == "node0" else 95.0}

    assert _live(engine, range(60), feed, FOUR) == []


def test_a_batch_lost_as_a_job_starts_up_is_no_lost_node(engine):
    # a job stands at step 0 for 35 s (loading, compiling), then computes its first steps, GPUs busy; node1's
    # batches of t=36 and 37 never come: its ranks never stepped yet, so a stand says nothing of a wait
    def feed(node, t):
        if node == "node1" and t in (36, 37):
            return None
        return {"step": 0 if t < 39 else t - 38, "util": 3.0 if t < 35 else 95.0}

    assert _live(engine, range(60), feed, FOUR) == []


def test_a_node_lost_during_another_node_s_hiccup_is_found_within_2_s_by_its_peers_power(engine):
    # node0's data loader stalls at t=28-29 (its GPUs idle, the job stands with it); node3 dies after its
    # batch of t=29. From t=30 every GPU left spins in the collective at a wait's power (150 W against the
    # 500 W of a step): the job no longer stands for node0, so node3's silence is its loss
    def feed(node, t):
        if node == "node3" and t >= 30:
            return None
        if t < 28:
            return {"step": t, "power": 500.0}
        if t < 30:
            return {"step": 27, "util": 5.0 if node == "node0" else 95.0, "power": 90.0 if node == "node0" else 500.0}
        return {"step": 27, "util": 100.0, "power": 150.0}

    found = _live(engine, range(60), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node3")]
    assert found[0].detected_ts - (T0 + 30) <= 2.0


def test_in_a_job_of_10_s_steps_a_node_lost_just_after_its_own_hiccup_is_found_within_2_s_by_its_peers_power(engine):
    # node3's data loader stalls at t=103-104 in step 10 (its GPUs idle); its GPUs are busy again at t=105 and
    # it dies after its batch of t=106, the others then spinning in the collective at a wait's power. Its last
    # reports show no GPU of it idle (no stuck rank of it): the peers' wait power says the job waits for it
    def feed(node, t):
        if node == "node3" and t >= 107:
            return None
        if t < 107:
            return {"step": min(int(t / 10), 10), "step_time": 10.0, "power": 560.0,
                    "util": 5.0 if node == "node3" and t in (103, 104) else 95.0}
        return {"step": 10, "step_time": 10.0, "util": 100.0, "power": 150.0}

    found = _live(engine, range(160), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node3")]
    assert found[0].evidence["cause"] == "its job stopped as it fell silent"
    assert found[0].detected_ts - (T0 + 107) <= 2.5


def test_a_node_lost_during_its_own_hiccup_is_no_hang_when_it_comes_back(engine):
    # node3's data loader stalls at t=28-29 (it idles alone: a mark of it apart), then it is lost until t=100,
    # the others spinning at a wait's power; back, it computes and the job steps on from t=102. Its hiccup's
    # mark does not carry across its silence: its node is lost, not hung
    def feed(node, t):
        if node == "node3" and 30 <= t < 100:
            return None
        if t < 28:
            return {"step": t, "power": 500.0}
        if t < 30:
            return {"step": 27, "util": 5.0 if node == "node3" else 95.0, "power": 90.0 if node == "node3" else 500.0}
        if t < 100:
            return {"step": 27, "util": 100.0, "power": 150.0}
        return {"step": 27 if t < 102 else t - 74, "util": 95.0, "power": 500.0}

    found = _live(engine, range(160), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node3")]


def test_a_batch_late_as_a_checkpoint_ends_is_no_lost_node_where_the_peers_draw_a_step_s_power(engine):
    # a checkpoint at t=30-44 (GPUs idle); from t=45 the ranks compute their first step again, GPUs busy at
    # the 500 W of a step, and step at t=48; node1's batches of t=45 and 46 come late. Without power samples
    # this is the node lost as a checkpoint ends (above); with them the peers compute, they do not wait
    def feed(node, t):
        if node == "node1" and t in (45, 46):
            return None
        if 30 <= t < 45:
            return {"step": 29, "util": 3.0, "power": 90.0}
        return {"step": t if t < 30 else 29 if t < 48 else t - 18, "util": 95.0, "power": 500.0}

    assert _live(engine, range(70), feed, FOUR) == []


def test_in_a_job_of_10_s_steps_a_peer_late_after_its_job_s_lost_node_was_left_to_the_heartbeat_timeout_is_not_lost(
        engine):
    # steps of 10 s, no power samples; node3 dies after its batch of t=101 and the others block in the
    # collective, spinning: a wait their stall tells only past a step (t=111), so the heartbeat timeout finds
    # node3 (t=107). node1's batches of t=112 and 113 come late: the job stood for node3, not for node1
    def feed(node, t):
        if node == "node3" and t >= 102 or node == "node1" and t in (112, 113):
            return None
        return {"step": min(int(t / 10), 10), "step_time": 10.0, "util": 95.0 if t < 102 else 100.0}

    found = _live(engine, range(160), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node3")]
    assert found[0].detected_ts - (T0 + 101) > engine.config.heartbeat_timeout


def test_in_a_job_of_10_s_steps_a_hung_node_whose_batches_are_lost_is_hung_not_lost(engine):
    # node2's rank hangs at t=104 in step 10 (its GPUs idle); the others block in the collective, spinning at a
    # wait's power (150 W against the 560 W of a step) from t=110. node2's batches of t=119 and 120 never come:
    # its silence began 9 s into its peers' wait, which a wait for a node lost as it fell silent never shows
    def feed(node, t):
        if node == "node2" and t in (119, 120):
            return None
        if t < 104 or node != "node2" and t < 110:
            return {"step": int(t / 10), "step_time": 10.0, "util": 95.0, "power": 560.0}
        if node == "node2":
            return {"step": 10, "step_time": 10.0, "util": 0.0, "power": 60.0}
        return {"step": 10, "step_time": 10.0, "util": 100.0, "power": 150.0}

    found = _live(engine, range(300), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.HANG, "node2")]


def test_in_a_job_of_10_s_steps_slow_steps_after_a_restore_are_no_wait_when_a_peer_s_batch_is_lost(engine):
    # steps of 10 s, then from t=200 (a restore's first steps) of 15 s, each rank computing at a step's power
    # and reporting the step time it took; node1's batches of t=227 and 228 never come, 12 s into step 15
    # (begun at t=215). Twelve seconds is more than a step of the job's median, not more than its latest ones
    def feed(node, t):
        if node == "node1" and t in (227, 228):
            return None
        if t < 200:
            return {"step": int(t / 10), "step_time": 10.0, "util": 95.0, "power": 560.0}
        return {"step": 20 + int((t - 200) / 15), "step_time": 15.0, "util": 95.0, "power": 560.0}

    assert _live(engine, range(260), feed, FOUR) == []


def test_in_a_job_of_30_s_steps_batches_lost_as_the_job_computes_again_after_its_lost_node_are_no_lost_node(
        engine):
    # steps of 30 s at 560 W; node3 dies after its batch of t=199 (mid-step) and the others spin at 150 W until it
    # is back at t=230 (found lost by their power); then every rank computes the step it stood at, at 560 W, and
    # node3's batches of t=234 and 235 never come, nor node1's of t=240 and 241. The ranks have stood since their
    # last move at t=180, before node3 was lost: the job stands for node3 until its step moves, not for node1,
    # nor for node3's new silence (probes 9565, 9566, `--step-s 20,40` with late and lost batches: four such
    # false evicts)
    def feed(node, t):
        if node == "node3" and (200 <= t < 230 or t in (234, 235)) or node == "node1" and t in (240, 241):
            return None
        step = int(t / 30) if t < 200 else 6 if t < 260 else 7 + int((t - 260) / 30)
        if 200 <= t < 230:
            return {"step": 6, "step_time": 30.0, "util": 100.0, "power": 150.0}
        return {"step": step, "step_time": 30.0, "util": 95.0, "power": 560.0}

    found = _live(engine, range(300), feed, FOUR)
    assert [(f.kind, f.node) for f in found if not f.resolved] == [(c.FaultKind.NODE_LOST, "node3")]
    assert found[0].detected_ts - (T0 + 200) <= 2.0


def test_in_a_job_of_long_steps_a_batch_lost_before_its_gpus_power_is_known_is_no_lost_node(engine):
    # a job's first steps: step 1 at t=30, step 2 at t=50 (30 s and 20 s), its GPUs at 70 % and 400 W, then
    # busier (95 %, 560 W) from t=80. node1's batches of t=84 and 85 never come: the ranks have stood 34 s, more
    # than their latest step, and their GPUs only just took to 95 %, which a spin-wait would show too. Two step
    # moves tell no stepping power, and a stall tells only within a 30 s step when a wait began: the heartbeat
    # timeout decides, and node1 is back before it (probe 9565: two such false evicts in a job's first minutes)
    def feed(node, t):
        if node == "node1" and t in (84, 85):
            return None
        step = 0 if t < 30 else 1 if t < 50 else 2
        times = {0: 30.0, 1: 30.0, 2: 20.0}
        busy = t >= 80
        return {"step": step, "step_time": times[step], "util": 95.0 if busy else 70.0,
                "power": 560.0 if busy else 400.0}

    assert _live(engine, range(110), feed, FOUR) == []


def test_a_peer_silent_just_before_its_job_stops_for_a_lost_node_is_not_lost_too(engine):
    # steps of 30 s at 560 W; node2's batches of t=200 to 202 come late (its agent stalled), and node3 dies
    # after its batch of t=200: from t=201 the others spin at 150 W. At t=203 both are silent for 2 s or more,
    # and the job stopped about as either fell silent: the one that fell silent last is what it stands for
    # (probe 9561, `--step-s 20,40` with late and lost batches: three such false evicts)
    def feed(node, t):
        if node == "node2" and 200 <= t <= 202 or node == "node3" and t > 200:
            return None
        wait = t > 200
        return {"step": min(int(t / 30), 6), "step_time": 30.0, "util": 100.0 if wait else 95.0,
                "power": 150.0 if wait else 560.0}

    found = _live(engine, range(240), feed, FOUR)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node3")]
    assert found[0].detected_ts - (T0 + 201) <= 2.5


def test_a_node_silent_long_into_a_job_wide_wait_is_lost_only_at_the_heartbeat_timeout(engine):
    # every rank has stood still since t=30, GPUs spinning (a collective waiting on something outside the
    # job); node2's metrics stop at t=100: a wait that began a minute before it fell silent says nothing
    def feed(node, t):
        if node == "node2" and t >= 100:
            return None
        return {"step": min(t, 29), "util": 95.0 if t < 30 else 100.0}

    [f] = _live(engine, range(140), feed)
    assert f.node == "node2" and f.evidence["cause"] == "its job stopped with it"
    assert f.detected_ts - (T0 + 99) > engine.config.heartbeat_timeout


def test_a_node_silent_while_its_job_steps_on_is_not_lost_its_agent_is(engine, caplog):
    # its metrics stop (the agent restarted, or the network to the broker failed): the job steps on, which a
    # synchronous job cannot without node2's rank, so node2 computes. Before, it was evicted at the heartbeat
    # timeout (6 s), and a restart of the agent under systemd (RestartSec=5) cost the job a relaunch
    def feed(node, t):
        return None if node == "node2" and 30 <= t < 45 else {"step": t}

    assert _live(engine, range(90), feed) == []
    assert caplog.text.count("node node2 has sent no metrics for") == 1      # once per silence


def test_a_node_lost_longer_than_the_heartbeat_horizon_keeps_its_state(engine):
    # node2 is lost from t=30 for 300 s (its job waits, spinning): found once, and its state (its rules' counts,
    # its soft baselines) is kept for its return, as for a node its own worker reported; a first draft of the
    # silence marks dropped it as replayed history once silent past heartbeat_horizon (120 s), and the soft
    # faults of its job came out a window apart (tuning seed 3001)
    def feed(node, t):
        if node == "node2" and 30 <= t < 330:
            return None
        return {"step": min(t, 29) if t < 333 else t - 303, "util": 95.0 if t < 30 or t >= 333 else 100.0}

    found = _live(engine, range(360), feed)
    assert [(f.kind, f.node) for f in found] == [(c.FaultKind.NODE_LOST, "node2")]
    state = engine.nodes["node2"]
    assert state.last_batch_ts == T0 + 359 and state.lost_reported_for == T0 + 29


def test_a_node_whose_job_stepped_on_through_its_silence_is_lost_once_the_job_stands_waiting(engine):
    # node2's agent is silent from t=30 while the job steps on (held); at t=50 node2 dies too: its peers stand in
    # the all-reduce, GPUs spinning. Lost once they stood for the heartbeat timeout, with the same fault id
    def feed(node, t):
        if node == "node2" and t >= 30:
            return None
        return {"step": min(t, 50), "util": 95.0 if t < 50 else 100.0}

    [f] = _live(engine, range(120), feed)
    assert (f.kind, f.node, f.action) == (c.FaultKind.NODE_LOST, "node2", c.Action.EVICT)
    assert f.evidence["cause"] == "its job stepped on, then stood waiting while it stayed silent"
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 29)
    assert 50 + engine.config.heartbeat_timeout <= f.detected_ts - T0 <= 50 + engine.config.heartbeat_timeout + 2


def test_a_node_silent_in_a_job_wide_pause_is_lost_only_at_the_heartbeat_timeout(engine):
    # a checkpoint: every rank stands still with its GPUs idle; node2's metrics are late, not its job waiting
    def feed(node, t):
        if node == "node2" and t >= 30:
            return None
        return {"step": min(t, 29), "util": 3.0 if t >= 30 else 95.0}

    [f] = _live(engine, range(60), feed)
    assert f.node == "node2" and f.evidence["cause"] == "its job stopped with it"
    assert f.detected_ts - (T0 + 29) > engine.config.heartbeat_timeout


def test_node_lost_fast_s_must_be_a_positive_number():
    with pytest.raises(ConfigError, match="node_lost_fast_s"):
        TEEConfig(node_lost_fast_s=0)


@pytest.mark.parametrize("lost", ["node2", "node0"])
def test_a_job_that_waited_for_its_lost_node_past_the_pause_floor_is_not_hung_as_the_node_comes_back(engine, lost):
    # the node is gone for 300 s; back at t=330 at its old step, its job steps again from t=333: the stall
    # (29..333, longer than the 300 s floor) was the wait for the lost node, not a job-wide stop to report at
    # the pause ceiling. node0 holds rank 0, the job's first rank: its own stall (29..330) began as it was
    # lost, the loss and not a hang (bench/tee_quality seed 9405, jobs of 4, named the node that came back)
    def feed(node, t):
        if node == lost and 30 <= t < 330:
            return None
        return {"step": t - 303 if t >= 333 else min(t, 29), "util": 95.0 if t < 30 or t >= 333 else 100.0}

    assert [(f.kind, f.node) for f in _live(engine, range(400), feed)] == [(c.FaultKind.NODE_LOST, lost)]


def _node2_lost_at_30(engine: TEEEngine, t: int, now: float, node2_partition: int = 0) -> list[c.FaultEvent]:
    """Second ``t`` of a job whose node2 dies after its batch of t=29: the others' ranks stand still at step
    29 from then on, their GPUs spinning in the collective that waits for it. Metrics partition 0, but
    node2's own (``node2_partition``)."""
    out = []
    for node in NODES:
        if t < 30 or node != "node2":
            kw = {"step": t} if t < 30 else {"step": 29, "util": 100.0}
            out += engine.process(_batch(node, T0 + t, **kw), now=now,
                                  partition=node2_partition if node == "node2" else 0)
    return out


def test_split_the_job_s_worker_finds_the_lost_node_within_2_s_and_hangs_no_rank_of_the_waiting_job():
    """Split, event clock (`transom tee --clock event` workers): the job's worker hears each node through the
    feeds; node2 falls silent after t=29 as its job stops, the others spinning, for 400 s. The job's worker
    finds it lost within 2 s of sample time and names no rank hung at the pause ceiling; the node's own
    heartbeat check, at the timeout, reports the same fault (one id)."""
    config = TEEConfig(soft_detectors=(), clock="event")
    node_side, job_side = TEEEngine(config, split_peers=True), TEEEngine(config, split_peers=True)
    found = []
    for t in range(400):
        found += _node2_lost_at_30(node_side, t, now=T0 + t)
        node_side.read_up_to({n: T0 + t for n in NODES})
        for f in node_side.feeds():
            found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)))
        found += node_side.check_heartbeats(now=T0 + t + 0.5)
    fast = [f for f in found if f.evidence.get("cause") == "its job stopped as it fell silent"]
    assert [(f.kind, f.node) for f in fast] == [(c.FaultKind.NODE_LOST, "node2")]
    assert fast[0].detected_ts - (T0 + 30) <= 2.0
    assert {(f.kind, f.fault_id) for f in found} == {(c.FaultKind.NODE_LOST, fast[0].fault_id)}


@pytest.mark.parametrize("read_past", [True, False], ids=["partition read past it", "node2 alone on its partition"])
def test_split_wall_clock_a_node_is_lost_within_2_s_only_where_its_partition_was_read_past_it(read_past):
    """Split, wall clock (the live `transom tee` workers). From t=30 the job's ranks stand still, GPUs
    spinning, and the job's worker hears nothing more of node2. Its node's worker says with each feed
    (read marks, ``TEEEngine.read_past``) how far it read node2's partition past node2's newest batch:
    on the partition of the other nodes, their batches move it on, and node2 is lost within 2 s. Alone
    on its partition, nothing does (as for a worker reading it late: its batches may be there, unread),
    and the job's worker waits for the heartbeat timeout, which the node's worker decides."""
    config = TEEConfig(soft_detectors=())
    node_side, job_side = TEEEngine(config, split_peers=True), TEEEngine(config, split_peers=True)
    found = []
    for t in range(60):
        _node2_lost_at_30(node_side, t, now=T0 + t + 0.1, node2_partition=0 if read_past else 1)
        node_side.read_past()
        for f in node_side.feeds():
            found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)), now=T0 + t + 0.2)
    assert not [f for f in found if f.kind == c.FaultKind.HANG]
    if read_past:
        [f] = found
        assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", "its job stopped as it fell silent")
        assert f.detected_ts - (T0 + 30) <= 2.0 and f.evidence["read_past_s"] >= config.node_lost_fast_s
    else:
        assert found == []


def test_split_in_a_job_of_3_s_steps_the_peers_power_reaches_the_job_s_worker_and_finds_the_lost_node_within_2_s():
    """Split, event clock: the GPUs' power draw travels in the job feed's rank reports, so the job's worker
    tells the waiting peers of a job of 3 s steps by it, as one engine does."""
    config = TEEConfig(soft_detectors=(), clock="event")
    node_side, job_side = TEEEngine(config, split_peers=True), TEEEngine(config, split_peers=True)
    feed, found = _long_steps(31.5, 31.5), []
    for t in range(90):
        for node in NODES:
            if (kw := feed(node, t)) is not None:
                found += node_side.process(_batch(node, T0 + t, **kw), now=T0 + t)
        node_side.read_up_to({n: T0 + t for n in NODES})
        for f in node_side.feeds():
            found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)))
    fast = [f for f in found if f.evidence.get("cause") == "its job stopped as it fell silent"]
    assert [(f.kind, f.node) for f in fast] == [(c.FaultKind.NODE_LOST, "node2")]
    assert fast[0].detected_ts - (T0 + 31.5) <= 2.0


def _long_hang(hung_from: float | None, slow: bool = False):
    """A job of 15 s steps, its GPUs at 560 W stepping. From ``hung_from`` node2's rank is stuck in step 10 (no
    heartbeat evidence: this agent sends heartbeat ages of 0), its GPUs idle, while the others stand still in
    it too, spinning in the collective at 150 W. ``slow``: instead, every step node2 computes 8 s longer than
    its peers, which wait for it at the all-reduce at 150 W (a straggler, not a hang)."""
    def feed(node, t):
        if hung_from is not None and t >= hung_from:
            if node == "node2":
                return {"step": 10, "step_time": 15.0, "util": 0.0, "power": 60.0, "hb": 0.0}
            return {"step": 10, "step_time": 15.0, "util": 100.0, "power": 150.0, "hb": 0.0}
        if slow:
            step, into = divmod(t, 23)
            waits = node != "node2" and into >= 15
            return {"step": step, "step_time": 23.0, "util": 100.0, "power": 150.0 if waits else 560.0, "hb": 0.0}
        return {"step": int(t / 15), "step_time": 15.0, "util": 100.0, "power": 560.0, "hb": 0.0}
    return feed


def test_in_a_job_of_15_s_steps_a_rank_not_in_the_collective_is_hung_at_the_hang_timeout_by_its_peers_power(engine):
    # node2's rank stops at t=155 in step 10 (begun at 150): its GPUs idle, the others spin at a wait's power.
    # Three median steps (45 s) is how long a rank of 15 s steps may stand still computing; its peers' power
    # says they compute nothing, so the hang timeout (10 s) is the limit
    [f] = _run(engine, range(400), _long_hang(155))
    assert (f.kind, f.node, f.evidence["cause"]) == (c.FaultKind.HANG, "node2", "not in the collective")
    assert f.detected_ts - (T0 + 155) <= 30.0 and f.evidence["limit_s"] == engine.config.hang_timeout


def test_in_a_job_of_15_s_steps_a_straggler_its_peers_wait_for_at_low_power_is_no_hang(engine):
    # node2 computes at full power 8 s past its peers every step; they spin at a wait's power meanwhile
    assert [f for f in _run(engine, range(600), _long_hang(None, slow=True)) if f.kind == c.FaultKind.HANG] == []


@pytest.mark.parametrize("case", ["agent restarts", "lost in a pause"])
def test_split_a_node_alone_on_its_partition_is_judged_by_its_job_s_worker_from_its_silence(case):
    """Wall clock, split, each node read by a worker of its own (no other node's progress proves its silence):
    node2 sends nothing from t=30. Its worker does not decide at the heartbeat timeout: it sends the job's worker
    a silence mark (:attr:`RankReport.silent_s`, through the contract), and the job's worker decides. Its agent
    restarted (back at t=48) while the job stepped on: nothing (before: evicted at t=36, a relaunch of a healthy
    job). Lost in a job-wide pause (GPUs idle, nothing steps): the heartbeat's NODE_LOST, its fault id."""
    config = TEEConfig(soft_detectors=())
    sides = {n: TEEEngine(config, split_peers=True) for n in NODES}
    job_side = TEEEngine(config, split_peers=True)
    found = []
    for t in range(90):
        for node in NODES:
            if node == "node2" and (30 <= t < 48 if case == "agent restarts" else t >= 30):
                continue
            kw = {"step": t} if case == "agent restarts" else {"step": min(t, 29), "util": 3.0 if t >= 30 else 95.0}
            found += sides[node].process(_batch(node, T0 + t, hb=0.0, **kw), now=T0 + t + 0.1)
        for node, side in sides.items():
            found += side.check_heartbeats(now=T0 + t + 0.6)
            side.read_past()
            for feed in side.feeds():
                found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(feed)), now=T0 + t + 0.7)
    if case == "agent restarts":
        assert found == []
        return
    [f] = found
    assert (f.kind, f.node, f.action, f.detector) == (c.FaultKind.NODE_LOST, "node2", c.Action.EVICT, "rule.heartbeat")
    assert f.fault_id == c.stable_id("node2", "node_lost", T0 + 29)
    assert f.evidence["cause"] == "its job stopped with it" and f.evidence["decided_by"] == "its job's worker"
    assert config.heartbeat_timeout < f.detected_ts - (T0 + 29) <= config.heartbeat_timeout + 2


def test_a_replay_decides_a_node_lost_in_a_pause_from_its_silence_mark():
    """Event clock, split, a worker per node: node2 sends nothing from t=30, in a job-wide pause (GPUs idle:
    no fast rule). Its worker's heartbeat check sends the job's worker a silence mark, which the job's reports
    must release in their time order (they held back every read mark: the node lost was never decided, and
    bench/tee_quality.py's pipeline replay missed 1-2 of 11 node losses in 3 of 5 runs)."""
    config = TEEConfig(soft_detectors=(), clock="event")
    sides = {n: TEEEngine(config, split_peers=True) for n in NODES}
    job_side = TEEEngine(config, split_peers=True)
    found = []
    for t in range(90):
        for node in NODES:
            if node == "node2" and t >= 30:
                continue
            found += sides[node].process(_batch(node, T0 + t, step=min(t, 29), hb=0.0, util=3.0 if t >= 30 else 95.0),
                                         now=T0 + t)
        for node, side in sides.items():
            found += side.check_heartbeats(now=T0 + t + 0.5)
            side.read_up_to({node: T0 + t + 0.5})
            for feed in side.feeds():
                found += job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(feed)))
    [f] = found
    assert (f.kind, f.node, f.action, f.evidence["cause"]) == (c.FaultKind.NODE_LOST, "node2", c.Action.EVICT,
                                                               "its job stopped with it")
    assert config.heartbeat_timeout < f.detected_ts - (T0 + 29) <= config.heartbeat_timeout + 2


def test_a_silence_mark_keeps_its_place_among_the_reports_of_a_feed_sent_in_parts():
    """Event clock, split: node2 is silent from t=30 to t=45, in a job-wide pause (no fast rule), and the node
    side sends a minute of the job at once, in parts of 10 reports (a replay; ``TEEEngine.feeds``). Its silence
    marks must stay among the reports of their time: as read marks they went last, after node2's own return,
    and the job's worker judged them against the job stepping again (lost only at twice the timeout, or, before
    that bound, never: bench/tee_quality.py's pipeline replay missed node losses so)."""
    config = TEEConfig(soft_detectors=(), clock="event")
    side, job_side = TEEEngine(config, split_peers=True), TEEEngine(config, split_peers=True)
    for t in range(60):
        for node in NODES:
            if node == "node2" and 30 <= t < 45:
                continue
            paused = 30 <= t < 45
            side.process(_batch(node, T0 + t, step=29 if paused else t if t < 30 else t - 15, hb=0.0,
                                util=3.0 if paused else 95.0), now=T0 + t)
        side.check_heartbeats(now=T0 + t + 0.5)
    side.read_up_to({n: T0 + 59.5 for n in NODES})
    feeds = side.feeds(most=10)
    found = [f for feed in feeds for f in job_side.job_feed(c.decode(c.PEER_WINDOWS, c.encode(feed)))]
    [f] = found
    assert (f.node, f.action) == ("node2", c.Action.EVICT)
    assert config.heartbeat_timeout < f.detected_ts - (T0 + 29) <= config.heartbeat_timeout + 2
    assert f.evidence["cause"] == "its job stopped with it"
    assert len(feeds) > 5 and any(r.silent_s is not None for f in feeds[:-1] for r in f.ranks)
