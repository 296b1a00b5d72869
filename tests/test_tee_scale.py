"""TEE at scale: a job's windows gathered whole whatever the order (pure), and the same soft faults
from three real workers as from one (the real broker, the labelled corpus on the event clock)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from transom import contracts as c
from transom.broker import EmbeddedBroker
from transom.streams.classes import SOFT
from transom.streams.jobwindows import JobReports, JobWindows


def win(node: str, index: int, job: str = "j") -> c.PeerWindow:
    return c.PeerWindow(node=node, job=job, index=index, first_ts=index * 10.0, last_ts=index * 10.0 + 9,
                        closed_ts=index * 10.0 + 10, gpu={"0": {c.DCGM.SM_CLOCK: 1980.0}})


def names(ws) -> list[tuple[str, int]]:
    return [(w.node, w.index) for w in ws]


def test_a_job_feed_round_trips_and_refuses_a_bad_window_or_rank():
    w = c.PeerWindow(node="n1", job="j", index=7, first_ts=70.0, last_ts=79.0, closed_ts=80.0,
                     gpu={"0": {c.DCGM.GPU_TEMP: 61.5}, "3": {c.DCGM.SM_CLOCK: 1900.0}}, reasons={"0": 4},
                     nic_err=0.25, nic_bw={"mlx5_0": 4e10}, hard_ts=65.0)
    rank = c.Sample(c.Source.TRAIN, {"step": 3.0, "alive": 1.0, "heartbeat_age_s": 0.2}, index=1,
                    tags={"generation": "0", "stack": "train.py:80 step"})
    feed = c.JobFeed(job="j", windows=(w,), ranks=(c.RankReport("n1", 81.0, 93.5, (rank,), (8, 1, 7), 512.5),
                                                   c.RankReport("n2", 81.0)))
    assert c.decode(c.PEER_WINDOWS, c.encode(feed)) == feed
    assert c.decode(c.PEER_WINDOWS, c.encode(feed)).ranks[0].gpu_power == 512.5
    with pytest.raises(c.ContractError, match=r"job feed rank report 0: field 'gpu_power' must be a finite number"):
        c.decode(c.PEER_WINDOWS, c.encode(feed).replace(b'"gpu_power":512.5', b'"gpu_power":-1'))
    with pytest.raises(c.ContractError, match=r"job feed rank report 0: field 'gpus' must be \[count, idle, spinning\]"):
        c.decode(c.PEER_WINDOWS, c.encode(feed).replace(b'"gpus":[8,1,7]', b'"gpus":[8,5,7]'))
    silence = c.JobFeed(job="j", ranks=(c.RankReport("n2", 88.0, silent_s=7.0),))   # its worker leaves it to this one
    assert c.decode(c.PEER_WINDOWS, c.encode(silence)) == silence
    assert b"silent_s" not in c.encode(feed)                     # only on a silence mark
    for bad in (b'"silent_s":-1.0', b'"silent_s":"7"', b'"silent_s":7.0,"gpu_util":90.0'):
        with pytest.raises(c.ContractError, match=r"job feed rank report 0: field 'silent_s' must be a finite number"):
            c.decode(c.PEER_WINDOWS, c.encode(silence).replace(b'"silent_s":7.0', bad))
    out = c.JobFeed(job="j", windows=(dataclasses.replace(w, outside=True),))       # a node whose ranks are gone
    assert c.decode(c.PEER_WINDOWS, c.encode(out)).windows[0].outside is True
    with pytest.raises(c.ContractError, match="outside"):
        c.decode(c.PEER_WINDOWS, c.encode(out).replace(b'"outside":true', b'"outside":1'))
    bad = c.encode(feed).replace(b"61.5", b'"hot"')
    with pytest.raises(c.ContractError, match=r"peer window: gpu\['0'\] must map field names to numbers"):
        c.decode(c.PEER_WINDOWS, bad)
    bad = c.encode(feed).replace(b'"step":3.0', b'"step":"3"')
    with pytest.raises(c.ContractError, match="job feed rank report 0 sample 0: metric 'step' must be a number"):
        c.decode(c.PEER_WINDOWS, bad)
    with pytest.raises(c.ContractError, match="job feed: missing required field 'windows'"):
        c.decode(c.PEER_WINDOWS, c.encode(w))          # a bare window (an older worker's) is refused


def test_a_window_summary_gives_the_features_of_its_window_and_whether_the_job_moved():
    """What the node's worker sends is what the job's worker needs: the same features, the same
    baselines learned, and a window where the training step stood still is still one (judged on its NIC
    errors alone)."""
    from transom.streams.config import TEEConfig
    from transom.streams.peers import PeerDetector, _NodeSoft, _Window

    win = _Window(index=3, first_ts=30.0, last_ts=39.0, job="j")
    for gi, clock in ((0, (1900.0, 1980.0, 1950.0)), (1, (1700.0, 1690.0, 1720.0, 1710.0))):
        win.gpu[gi][c.DCGM.SM_CLOCK] += clock
        win.gpu[gi][c.DCGM.GPU_TEMP] += [60.0 + gi, 61.0 + gi]
        win.gpu[gi][c.DCGM.POWER_USAGE] += [500.0, 520.0]
    win.reasons[1] |= 0x4
    win.nic_err += [0.1, 0.4]
    win.nic_bw["mlx5_0"] += [4e10, 3e10, 3.5e10]
    win.steps += [7.0, 7.0, 7.0]
    back = _Window.of(c.decode(c.PEER_WINDOWS, c.encode(c.JobFeed("j", (win.summary("n1", 40.0),)))).windows[0])
    detector = PeerDetector(TEEConfig())
    here, there = _NodeSoft(window=win), _NodeSoft(window=back)
    for ns in (here, there):      # the same history of clean windows behind both
        ns.base[(0, c.DCGM.SM_CLOCK)].extend([1980.0, 1985.0, 1990.0])
    (x1, worst1, med1), (x2, worst2, med2) = detector._raw_features(here), detector._raw_features(there)
    assert x1.tolist() == x2.tolist() and worst1 == worst2 and med1 == med2
    assert min(back.steps) == max(back.steps) == 7.0 and dict(back.reasons) == {1: 4}
    bad = c.encode(c.JobFeed("j", (win.summary("n1", 40.0),))).replace(b'"steps":[7.0,7.0]', b'"steps":["x"]')
    with pytest.raises(c.ContractError, match="peer window: steps must be a list of numbers"):
        c.decode(c.PEER_WINDOWS, bad)


def test_a_jobs_window_is_released_whole_and_in_order_whatever_the_arrival():
    g = JobWindows(wait=3)
    # the first window of a job waits until a node is `wait` windows further (its nodes are not known yet)
    assert g.add(win("b", 0)) == [] and g.add(win("a", 0)) == [] and g.add(win("a", 1)) == []
    assert g.add(win("c", 0)) == [] and g.add(win("a", 2)) == []
    assert names(g.add(win("a", 3))) == [("a", 0), ("b", 0), ("c", 0)]
    # then a window is released once every node of the job has sent it (sorted by node), in window order
    assert g.add(win("b", 1)) == []
    assert names(g.add(win("c", 1))) == [("a", 1), ("b", 1), ("c", 1)]
    assert g.add(win("c", 2)) == []
    assert names(g.add(win("b", 3))) == [("a", 2), ("c", 2)]      # b skipped window 2: it sent 3
    assert names(g.add(win("c", 3))) == [("a", 3), ("b", 3), ("c", 3)]
    # a node that falls silent holds its job back `wait` windows, then is not waited for again
    g2 = JobWindows(wait=2)
    for w in (win("a", 0), win("b", 0)):
        g2.add(w)
    assert names(g2.add(win("a", 2))) == [("a", 0), ("b", 0)]
    assert names(g2.add(win("b", 1))) == [("b", 1)]                  # a skipped 1 (it sent 2): b's 1 alone
    assert names(g2.add(win("b", 2))) == [("a", 2), ("b", 2)]
    assert g2.add(win("a", 3)) == [] and g2.add(win("a", 4)) == []  # b silent from here
    assert names(g2.add(win("a", 5))) == [("a", 3)]                  # released without b after 2 windows
    assert names(g2.add(win("a", 6))) == [("a", 4), ("a", 5), ("a", 6)]   # b no longer waited for
    # a window older than what its job released goes out at once, alone
    assert names(g2.add(win("b", 3))) == [("b", 3)] and g2.late == 1
    assert names(g2.add(win("a", 7))) == [("a", 7)]
    # flush (end of a replay) releases what is held, in order
    assert g2.add(win("x", 0, job="k")) == [] and g2.add(win("y", 0, job="k")) == []
    assert names(g2.flush()) == [("x", 0), ("y", 0)]


def test_a_node_read_far_behind_is_waited_for_until_nothing_of_it_came_for_quiet_s():
    """Event clock: a node whose worker reads it far behind (more than ``wait``) but still sends its windows,
    reports or read marks holds its job; one of which nothing came for ``quiet_s`` of the worker's own time
    is gone (left the job, its worker stopped). Without ``quiet_s`` (the wall clock) the window count
    alone decides, as before."""
    clock = [0.0]
    quiet = JobWindows(wait=2, quiet_s=30.0, clock=lambda: clock[0])
    count_only = JobWindows(wait=2)
    for g in (quiet, count_only):          # the node side names the job's nodes, then both send window 0
        assert g.read_past("j", {"a": -1, "b": -1}) == [] and g.add(win("a", 0)) == []
        assert names(g.add(win("b", 0))) == [("a", 0), ("b", 0)]
    for k in (1, 2):                         # a reads on; b is read behind, its marks say it has no window 1 yet
        assert quiet.add(win("a", k)) == [] and quiet.read_past("j", {"b": 0}) == []
        assert count_only.add(win("a", k)) == []
    assert names(count_only.add(win("a", 3))) == [("a", 1)]          # b two windows behind: not waited for
    assert quiet.add(win("a", 3)) == [] and quiet.read_past("j", {"b": 0}) == []   # b heard: waited for
    assert quiet.add(win("a", 4)) == []
    clock[0] = 31.0                                                    # nothing of b for 31 s: gone
    assert names(quiet.add(win("a", 5))) == [("a", k) for k in range(1, 6)]

    clock[0] = 0.0
    reports = JobReports(wait=100.0, quiet_s=30.0, clock=lambda: clock[0])
    at_once = JobReports(wait=100.0)
    rep = lambda node, ts: c.RankReport(node, ts, 90.0)               # noqa: E731
    for r in (reports, at_once):
        assert [x.ts for x in r.add("j", [rep("a", 1.0), rep("b", 1.0)])] == [1.0, 1.0]
    ahead = [rep("a", float(t)) for t in range(2, 500)]               # a read 500 s ahead of b
    assert len(at_once.add("j", ahead)) == 498                         # b more than `wait` behind: gone
    assert reports.add("j", ahead) == []                               # b heard just now: a's held for it
    assert [x.ts for x in reports.add("j", [c.RankReport("b", 3.0)])] == [2.0, 3.0]   # b's read mark
    clock[0] = 20.0
    assert reports.add("j", [rep("a", 500.0)]) == []                    # b heard 20 s ago: still waited for
    clock[0] = 51.0                                                     # nothing of b for 51 s: gone
    out = reports.add("j", [rep("a", 501.0)])
    assert [x.ts for x in out] == [float(t) for t in range(4, 502)]


def _hangs_on(workers: int, feed, seconds: int, *, split: bool = True) -> list[tuple[str, int, str]]:
    """The hang events of NODES' job fed by ``feed`` (test_tee_hangs' scenarios), with the nodes spread
    over ``workers`` engines as the metrics partitions spread them; the job's feeds go to the engine
    that owns the job (the last). ``split=False``: each engine judges only what it reads (the old way)."""
    from test_tee_hangs import NODES, T0, _batch

    from transom.streams.config import TEEConfig
    from transom.streams.engine import TEEEngine

    engines = [TEEEngine(TEEConfig(soft_detectors=(), clock="event"), split_peers=split) for _ in range(workers)]
    found = []
    for t in range(seconds):
        for i, node in enumerate(NODES):
            engine = engines[i % workers]
            found += engine.process(_batch(node, T0 + t, **feed(node, t)), now=T0 + t)
        if t % 2 == 1:        # the node sides send what they gathered (FEED_EVERY), in worker order
            for engine in engines:
                for f in engine.feeds():
                    found += engines[-1].job_feed(c.decode(c.PEER_WINDOWS, c.encode(f)))
    return sorted((f.node, f.rank, f.evidence["cause"]) for f in found if f.kind is c.FaultKind.HANG)


def test_hangs_are_judged_with_every_node_of_the_job_whatever_the_workers():
    """The hang rules that need the job's other nodes (a rank behind its stepping peers, GPUs idle
    while the peers' spin, a stop past the pause ceiling) give the same events with the job's three
    nodes on one worker as on three: the rank reports meet on the job's worker. Judged where each
    node is read, three workers would miss the first two and report the third three times."""
    stepping = lambda node, t: {"step": min(t, 20) if node == "node0" else t, "hb": 0.0}   # noqa: E731
    idle = lambda node, t: {"step": min(t, 30), "util": 0.0 if node == "node2" and t >= 30 else 100.0,  # noqa: E731
                            "hb": 0.0}
    paused = lambda node, t: {"step": min(t, 20), "util": 5.0 if t > 20 else 95.0}   # noqa: E731
    stopped = lambda node, t: ({"step": 30, "util": 0.0, "hb": t - 30.0} if node == "node1" and t >= 30  # noqa: E731
                               else {"step": min(t, 30), "util": 100.0})
    for feed, seconds, expected in ((stepping, 60, [("node0", 0, "behind")]),
                                    (idle, 80, [("node2", 2, "not in the collective")]),
                                    (paused, 380, [("node0", 0, "pause ceiling")]),
                                    (stopped, 90, [("node1", 1, "stuck")])):
        assert _hangs_on(1, feed, seconds) == expected
        assert _hangs_on(3, feed, seconds) == expected
        assert _hangs_on(1, feed, seconds, split=False) == expected      # one process, the offline engine
    assert _hangs_on(3, stepping, 60, split=False) == []
    assert _hangs_on(3, idle, 80, split=False) == []
    assert len(_hangs_on(3, paused, 380, split=False)) == 3


@pytest.mark.integration
@pytest.mark.e2e
def test_three_workers_find_the_same_soft_faults_and_hangs_as_one(monkeypatch):
    """The labelled corpus (16 nodes in 4 jobs of 4, 12 minutes at 1 Hz, every fault class at least once; a
    straggler, a power cap, a hot GPU, a degraded link, a hang and a node lost among them; a lost node
    stops its job, so faults that reach the whole job take 4 jobs to fit), replayed on the event
    clock through the real broker by one `transom tee` worker, then by three sharing the partitions:
    the same soft faults (class and node), each on the same window (observed time within one window),
    each an injected one, and the same hang events (node and rank, observed within 10 s), on the hung
    node only. The job's nodes are spread over the three workers' metrics partitions; their windows
    and rank reports meet on the job's partition of transom.peer-windows."""
    from transom.streams.corpus import Corpus, CorpusSpec

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from tee_quality import pipeline

    corpus = Corpus(CorpusSpec(nodes=16, hours=0.2, seed=22, job_size=4, faults_per_node_hour=1.0, min_per_class=1,
                               warmup_s=240, gap_s=30))
    soft = {s.value for s in SOFT}

    batches = sum(1 for _ in corpus.encoded())

    def faults(workers: int) -> tuple[dict[tuple[str, str], float], dict[tuple[str, int], float]]:
        with EmbeddedBroker() as broker:
            events, published, _ = pipeline(corpus, broker.bootstrap, workers=workers)
        assert published == batches
        found = [f for f in events if not f.resolved and f.evidence.get("class") in soft]
        assert len({f.fault_id for f in found}) == len(found), "a soft fault was sent twice"
        hangs = [f for f in events if f.kind is c.FaultKind.HANG]
        assert len({f.fault_id for f in hangs}) == len(hangs), "a hang was sent twice"
        return ({(f.evidence["class"], f.node): f.observed_ts for f in found},
                {(f.node, f.rank): f.observed_ts for f in hangs})

    one, hangs_one = faults(1)
    injected = {(i.cls.value, i.node): i for i in corpus.injections if i.cls.value in soft}
    # what the detectors find is their business (docs/tee.md); here: real faults only, and most of them
    assert set(one) <= set(injected) and len(one) >= 3, (sorted(one), sorted(injected))
    for key, ts in one.items():
        assert injected[key].start <= ts <= injected[key].end, (key, ts - injected[key].start)
    hung = {i.node for i in corpus.injections if i.cls.value == "hang"}
    # on the hung node only; found or not: a replay at full speed reads the partitions at different
    # points of the event time, and the evidence that compares a node with its peers at one instant
    # ("not in the collective") can be missing there (docs/tee.md, "Replays"); what must hold is that
    # the worker count does not change the answer
    assert hung and {node for node, _ in hangs_one} <= hung, (sorted(hangs_one), sorted(hung))
    three, hangs_three = faults(3)
    assert set(three) == set(one)
    for key, ts in one.items():
        assert abs(three[key] - ts) <= 10.0, (key, three[key] - ts)   # soft_window_s
    assert set(hangs_three) == set(hangs_one)          # the job's ranks meet on the job's worker
    for key, ts in hangs_one.items():
        assert abs(hangs_three[key] - ts) <= 10.0, (key, hangs_three[key] - ts)
