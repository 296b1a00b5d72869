"""bench/tee_quality: the TEE engine on a labelled fault corpus (offline, through the detector library).

Generates corpora with seeds never used for tuning or tests and replays every batch through :class:`TEEEngine` in time order
(``now`` = the sample time plus ``LAG_S``, 0.05 s, heartbeats checked once a second of sample
time), and matches fault events to the injected faults: an event counts for an injection when it
names the same node and class and its trigger lies between the injection's start and its end plus
``GRACE_S``. Per class: precision (events that match an injection of their class, first event per
injection only), recall (injections with a matching event), F1, detection delay (the decision's
sample time minus the injection start, p50/p99; beside it the onset, the trigger sample's, which
comes earlier where the decision waits for silence: a node lost); overall: false alarms (events on a
node with no injection running) per 1,000 node-hours. Resolution events are not counted as detections.

Seeds (house rule 4, never tune on what you report): ``TUNING_SEEDS`` (1, 7, 1001, 1002, 1003, 3001,
3002, 3003, 3004) are the seeds whose false alarms and misses were looked at while the detectors were
changed (``--seeds tuning`` runs them; 3001 and 3002, then 3003 and 3004, were report seeds until a
change followed their figures); the default ``--seeds`` are ``REPORT_SEEDS`` (3005, 3006), never
looked at while tuning; the pipeline
replay uses the first seed + 500; tests use seeds below 100 and 7301. Jobs of other shapes
(``--job-size``, nodes per job, default 8; ``--gpus`` per node, default 8): ``SHAPE_TUNING_SEEDS``
(9001-9009 with jobs of 1, 2, 16 and 32 nodes of 2, 4 or 8 GPUs; 9101-9106 with jobs of 1 and 2 nodes)
were looked at while the detectors were changed for small jobs; 9111 and up are reported. Each job's
step time is drawn from ``--step-s`` (0.6-1.4 s); ``VARIANT_TUNING_SEEDS`` 9201-9207 (jobs of 8 and
steps of 0.2-0.4, 0.6-1.4, 2-6, 4-8 and 8-16 s; jobs of 3 and 5; 1.2 faults per node-hour;
checkpoints every 5 minutes) were looked at while the detectors were changed, and 9211-9217 (steps of
2-6 and 0.3-3 s; jobs of 4, of 6 x 4 GPUs, of 8 and of 16) once after the changes (none followed).
``--hang-gpus`` says what a hang idles (the hung node's GPUs, only the stuck rank's, or either: mix, the
default); 9201 (one) and tuning seed 1 (mix) were looked at while the per-GPU hang rule was built, and
9221-9225 (one; jobs of 8, of 2, and one-node jobs of 2 GPUs) once after it. Probes 9401-9420 (6-7
December; their shapes in docs/tee.md) were each run before any change they led to; those whose miss
or late figure was fixed (9403, 9405, 9406, 9407, 9409, 9410, 9411) then checked the fix, and are
tuning seeds now. ``--interval-s N``: agents that report every N s (9600-9606, 7 December, docs/tee.md
"Agents that report every few seconds"; a node lost's trigger, its last batch, may then come up to N s before
the fault's start). The hard classes' 2 s is a target for 1 s agents: a sample is seen one interval late
at worst.

The peer: the skeleton's engine (rules XID, GPU lost, NaN, hang, heartbeat + per-sample ECOD),
run on the same corpus; the JSON line carries both and the ratio of mean F1.

Then the pipeline: a corpus of another unseen seed (``--pipeline-nodes`` x ``--pipeline-hours``)
is published to the embedded broker and read by one real ``transom tee --clock event`` worker
process (its clock follows the sample times, so the hour replays in about a minute); the fault
events it writes to ``transom.faults`` are scored the same way and set beside the offline
figures of the same corpus, with the duplicate fault ids (none expected) and the rate.

Run: ``.venv/bin/python bench/tee_quality.py [--nodes 48 --hours 1.5 --seeds 3005,3006]``; quick (about
3 min here): ``--no-peer --pipeline-nodes 0``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from transom.streams.classes import HARD, SOFT, FaultClass
from transom.streams.config import TEEConfig
from transom.streams.corpus import Corpus, CorpusSpec
from transom.streams.engine import TEEEngine

GRACE_S = 60.0
#: Seeds looked at while tuning (their false alarms and misses listed, causes fixed) ...
TUNING_SEEDS = "1,7,1001,1002,1003,3001,3002,3003,3004"
#: ... and the seeds reported, never looked at while tuning.
REPORT_SEEDS = "3005,3006"
#: ... and the seeds looked at while the detectors were changed for jobs of 1 or 2 nodes (other shapes).
SHAPE_TUNING_SEEDS = "9001,9002,9003,9004,9005,9006,9007,9008,9009,9101,9102,9103,9104,9105,9106"
#: ... and those looked at while the hang limits were changed for other step times (and other variants).
VARIANT_TUNING_SEEDS = "9201,9202,9203,9204,9205,9206,9207,9211,9212,9213,9214,9215,9216,9217,9221,9222,9223,9224,9225"


#: Offline, each batch is taken this long after its sample time (and each second's heartbeat check too).
LAG_S = 0.05


def replay(corpus: Corpus, config: TEEConfig, lag: float = LAG_S, progress: bool = True):
    engine = TEEEngine(config)
    events = []
    last_sec = None
    n = 0
    t = time.time()
    for arrival, b in corpus.deliveries(lag):
        sec = int(arrival - lag)
        if sec != last_sec:
            if last_sec is not None:
                events += engine.check_heartbeats(now=last_sec + 1 + lag)
            last_sec = sec
        events += engine.process(b, now=arrival)
        n += 1
        if progress and n % 50_000 == 0:
            print(f"  {n} batches, {len(events)} events, {n / (time.time() - t):.0f} batches/s",
                  file=sys.stderr, flush=True)
    events += engine.flush(now=(last_sec or 0) + 1)
    return events, n, engine.counts


#: Seconds of sample time the pipeline replay publishes and delivers at a time (below the workers'
#: heartbeat timeout, 6 s by default).
REPLAY_SLICE_S = 2


def pipeline(corpus: Corpus, bootstrap: str | None = None, workers: int = 1,
             logdir: str | None = None) -> tuple[list, int, float]:
    """Replay ``corpus`` through the real pipeline: the embedded broker (or ``bootstrap``) and
    ``workers`` ``transom tee --clock event`` worker processes (their logs ``tee<i>.log`` in ``logdir``,
    default: a temporary folder). Returns the fault events they wrote, the batches published and the
    seconds from the first publish until the workers had committed the last one."""
    from confluent_kafka import Consumer, TopicPartition

    from tee_throughput import start_workers, stop

    from transom import contracts as c
    from transom import kafka
    from transom.broker import EmbeddedBroker
    from transom.streams.app import APP_ID
    from transom.topics import TopicSettings

    broker = EmbeddedBroker().start() if bootstrap is None else None
    bootstrap = bootstrap or broker.bootstrap
    try:
        kafka.ensure_topics(bootstrap)
        with tempfile.TemporaryDirectory() as tmp:
            procs = start_workers(bootstrap, workers, logdir or tmp, ("--clock", "event"))
            try:
                producer = kafka.make_producer(bootstrap)
                t0, n = time.time(), 0
                # a slice of sample time is delivered before the next is sent: the workers read on the
                # event clock, where a partition read to its end moves on with the others (streams/app.py),
                # and one a delivery left behind by more than the heartbeat timeout would look silent
                for chunk in corpus.encoded_slices(REPLAY_SLICE_S):
                    for node, value in chunk:
                        kafka.produce(producer, c.METRICS, node, value)
                        n += 1
                        if n % 50_000 == 0:
                            print(f"  pipeline: {n} batches published", file=sys.stderr, flush=True)
                    producer.flush(120)
                # done when the workers' group has committed the end offset of every partition of the
                # metrics and of the peer windows they sent each other (re-read: it grows until then)
                probe = Consumer({**kafka.client_config(bootstrap), "group.id": APP_ID,
                                  "enable.auto.commit": False})
                topics = TopicSettings.from_env()
                parts = [TopicPartition(t, p) for t in (c.METRICS, c.PEER_WINDOWS)
                         for p in range(topics.partitions_of(t))]
                last, settled, deadline = -1, 0, time.time() + 1800
                while time.time() < deadline:
                    ends = sum(probe.get_watermark_offsets(tp, timeout=10)[1] for tp in parts)
                    done = sum(max(tp.offset, 0) for tp in probe.committed(parts, timeout=10))
                    settled = settled + 1 if done >= ends else 0
                    if settled >= 2:             # twice, a second apart: the last windows may be in flight
                        break
                    if done != last:
                        print(f"  pipeline: workers committed {done}/{ends}", file=sys.stderr, flush=True)
                        last = done
                    for p in procs:
                        if p.poll() is not None:
                            raise RuntimeError("a TEE worker exited: " + open(p.logpath).read()[-2000:])
                    time.sleep(1)
                else:
                    raise RuntimeError("the TEE workers did not commit every batch in 30 min")
                span = time.time() - t0
                probe.close()
                time.sleep(2)                        # faults are sent before their input is committed
                events = [c.decode(c.FAULTS, v) for _k, v, _p, _o in kafka.read_topic(bootstrap, c.FAULTS)]
                return events, n, span
            finally:
                stop(procs)
    finally:
        if broker is not None:
            broker.stop()


def score(corpus: Corpus, events, lag: float = 0.0) -> dict:
    """Match ``events`` to ``corpus``'s injections. A detection's delay is the decision's time (the event's
    ``detected_ts``, on the sample clock: ``lag``, the replay's own, taken off) minus the injection start;
    the onset (its trigger sample, ``observed_ts``) is kept beside it. They differ where the decision waits
    for what did not come: a node lost is triggered by its last batch and decided on the silence after it."""
    inj_by_node = defaultdict(list)
    for inj in corpus.injections:
        inj_by_node[inj.node].append(inj)
    hit: dict[int, float] = {}
    per = {c: {"tp": 0, "fp": 0} for c in FaultClass}
    false_alarms = 0
    disruptive: list[str] = []       # false alarms that would restart or evict
    false_events: list[str] = []     # every event that matched no injection (class, node, time, detector)
    seen: set[str] = set()
    repeats = 0
    # one fault id is one fault, acted on once (the controller's handled_faults), at its first decision: the
    # same fault found by two workers (a node lost by its job's worker in 2 s and by its own at the heartbeat
    # timeout) is one detection
    # a trigger sample may carry a time this far before the fault's start (a node lost: its last batch, one
    # report interval before; a batch or two before that where its last ones were never delivered)
    every = corpus.spec.interval_s
    early = every + corpus.spec.jitter_s + (2.0 * every if corpus.spec.lost_batches else 0.0)
    for f in sorted(events, key=lambda e: e.detected_ts):
        if f.resolved:
            continue
        if f.fault_id in seen:
            repeats += 1
            continue
        seen.add(f.fault_id)
        raw = f.evidence.get("class", f.kind.value)
        cls = FaultClass(raw) if raw in FaultClass._value2member_map_ else None
        match = None
        running = False
        observed = corpus.true_time(f.node, f.observed_ts)      # the node's clock on the labels' clock
        for inj in inj_by_node.get(f.node, ()):
            if inj.start - early <= observed <= inj.end + GRACE_S:
                running = True
                if cls is None and inj.cls in SOFT:
                    cls = inj.cls   # an unclassified anomaly (the skeleton's ECOD): credited to the soft fault
                if inj.cls is cls and id(inj) not in hit:
                    match = inj
                    break
        if match is not None:
            hit[id(match)] = (max(observed, f.detected_ts - lag) - match.start, observed - match.start)
            per[cls]["tp"] += 1
        else:
            per.setdefault(cls or "unclassified", {"tp": 0, "fp": 0})["fp"] += 1
            false_events.append(f"{f.node} {raw} {f.detector} {f.action.value} at +{observed - corpus.t0:.0f}s"
                                f"{'' if running else ' (no fault running on the node)'}: {f.summary}")
            if not running:
                false_alarms += 1
                if f.action.value in ("restart", "evict"):
                    disruptive.append(f"{f.node} {raw} {f.action.value} at {observed:.0f}: {f.summary}")
    out = {}
    for c in FaultClass:
        injs = [i for i in corpus.injections if i.cls is c]
        found = [hit[id(i)][0] for i in injs if id(i) in hit]
        onset = [hit[id(i)][1] for i in injs if id(i) in hit]
        tp, fp = per[c]["tp"], per[c]["fp"]
        p = tp / (tp + fp) if tp + fp else 1.0
        r = len(found) / len(injs) if injs else 1.0
        out[c.value] = {"injected": len(injs), "detected": len(found), "false": fp,
                        "precision": round(p, 4), "recall": round(r, 4),
                        "f1": round(2 * p * r / (p + r), 4) if p + r else 0.0,
                        "delay_p50_s": round(float(np.percentile(found, 50)), 2) if found else None,
                        "delay_p99_s": round(float(np.percentile(found, 99)), 2) if found else None,
                        "onset_p99_s": round(float(np.percentile(onset, 99)), 2) if onset else None}
    misses = [f"{i.node} {i.cls.value} severity {i.severity} +{i.start - corpus.t0:.0f}s..+{i.end - corpus.t0:.0f}s"
              for i in corpus.injections if id(i) not in hit]
    return {"classes": out, "false_alarms": false_alarms, "false_restart_or_evict": disruptive,
            "false_events": false_events, "misses": misses, "repeated_ids": repeats}


def merge(results: list[dict]) -> dict:
    """Sum counts over corpora and recompute the figures."""
    out = {}
    for c in FaultClass:
        rows = [r["classes"][c.value] for r in results]
        inj = sum(r["injected"] for r in rows)
        det = sum(r["detected"] for r in rows)
        fp = sum(r["false"] for r in rows)
        p = det / (det + fp) if det + fp else 1.0
        rec = det / inj if inj else 1.0
        out[c.value] = {"injected": inj, "detected": det, "false": fp, "precision": round(p, 4),
                        "recall": round(rec, 4), "f1": round(2 * p * rec / (p + rec), 4) if p + rec else 0.0,
                        "delay_p50_s": max((r["delay_p50_s"] or 0) for r in rows),
                        "delay_p99_s": max((r["delay_p99_s"] or 0) for r in rows),
                        "onset_p99_s": max((r["onset_p99_s"] or 0) for r in rows)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=48)
    p.add_argument("--hours", type=float, default=1.5)
    p.add_argument("--seeds", default=REPORT_SEEDS,
                   help=f"corpus seeds, comma-separated, or 'tuning' ({TUNING_SEEDS}); default the report "
                        f"seeds {REPORT_SEEDS}, never looked at while tuning")
    p.add_argument("--rate", type=float, default=0.6, help="injected faults per node-hour")
    p.add_argument("--job-size", type=int, default=8, help="nodes per job (default 8; 1: one-node jobs)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--step-s", default="0.6,1.4", metavar="LO,HI",
                   help="each job's step time is drawn from LO..HI seconds (default 0.6,1.4)")
    p.add_argument("--hang-gpus", default="mix", choices=("mix", "node", "one"),
                   help="what a hang idles: the hung node's GPUs (node), only the stuck rank's GPU, its node's "
                        "other GPUs spinning with the waiting ranks (one), or either per hang (mix, the default)")
    p.add_argument("--clock-skew-s", type=float, default=0.0,
                   help="spread of the nodes' clock offsets, seconds (a normal draw per node; default 0)")
    p.add_argument("--jitter-s", type=float, default=0.0,
                   help="each batch's sample time off its node's tick by up to this, seconds (default 0)")
    p.add_argument("--late-s", type=float, default=0.0,
                   help="mean delivery delay of a batch, seconds (exponential; a node's batches keep their order; "
                        "offline replays only; default 0)")
    p.add_argument("--lost-batches", type=float, default=0.0,
                   help="share of batches never delivered (an agent that missed a beat; default 0)")
    p.add_argument("--util-noise", type=float, default=0.0,
                   help="spread of more noise on each busy GPU's utilisation sample, a spin's 100 %% too "
                        "(percentage points, normal; default 0)")
    p.add_argument("--interval-s", type=int, default=1,
                   help="each node's agent reports every this many seconds, at its own phase (an XID at once; "
                        "default 1)")
    p.add_argument("--agent-restarts", type=float, default=0.0,
                   help="per node-hour: the node's agent silent for 7-30 s while its job trains on (restarted, "
                        "upgraded, cut off from Kafka; default 0)")
    p.add_argument("--agent-goodbyes", type=float, default=0.0,
                   help="share of those restarts whose agent says it stops first (SIGTERM: its last batch before "
                        "the silence marks its ranks agent_stopping, as the real agent's goodbye does; default 0)")
    p.add_argument("--rank0-saves", type=float, default=0.0,
                   help="per job-hour: rank 0 saves a checkpoint alone behind a barrier for 15-120 s, undeclared "
                        "(its GPUs idle while the other ranks spin; its process writes 0.3-2 GB/s; default 0)")
    p.add_argument("--no-peer", action="store_true", help="skip the skeleton engine (the peer)")
    p.add_argument("--peer-hours", type=float, default=0.5, help="hours of the peer's corpus (first seed)")
    p.add_argument("--pipeline-nodes", type=int, default=24,
                   help="nodes of the corpus also replayed through the real pipeline (0: skip; default 24)")
    p.add_argument("--pipeline-hours", type=float, default=1.0, help="its hours (default 1)")
    p.add_argument("--bootstrap", default=None, help="Kafka for the pipeline replay (default: an embedded broker)")
    a = p.parse_args(argv)
    if a.job_size < 1 or a.gpus < 1:
        p.error(f"--job-size {a.job_size} / --gpus {a.gpus}: expected positive integers")
    try:
        lo, hi = (float(v) for v in a.step_s.split(","))
    except ValueError:
        lo = hi = -1.0
    if not 0 < lo <= hi:
        p.error(f"--step-s {a.step_s!r}: expected two step times in seconds, LO,HI with 0 < LO <= HI")
    for key in ("clock_skew_s", "jitter_s", "late_s"):
        if not 0 <= getattr(a, key) < 60:
            p.error(f"--{key.replace('_', '-')} {getattr(a, key)}: expected seconds, 0 <= value < 60")
    if not 0 <= a.lost_batches < 1:
        p.error(f"--lost-batches {a.lost_batches}: expected a share, 0 <= value < 1")
    if not 0 <= a.util_noise <= 50:
        p.error(f"--util-noise {a.util_noise}: expected percentage points, 0 <= value <= 50")
    if not 0 <= a.agent_restarts <= 10:
        p.error(f"--agent-restarts {a.agent_restarts}: expected restarts per node-hour, 0 <= value <= 10")
    if not 0 <= a.agent_goodbyes <= 1:
        p.error(f"--agent-goodbyes {a.agent_goodbyes}: expected a share of the agent restarts, 0 <= value <= 1")
    if not 0 <= a.rank0_saves <= 10:
        p.error(f"--rank0-saves {a.rank0_saves}: expected saves per job-hour, 0 <= value <= 10")
    shape = {"job_size": a.job_size, "gpus": a.gpus, "step_s": (lo, hi), "hang_gpus": a.hang_gpus,
             "clock_skew_s": a.clock_skew_s, "jitter_s": a.jitter_s, "late_s": a.late_s, "lost_batches": a.lost_batches,
             "util_noise": a.util_noise, "interval_s": a.interval_s, "agent_restarts": a.agent_restarts,
             "agent_goodbyes": a.agent_goodbyes,
             "rank0_saves": a.rank0_saves}
    if a.seeds == "tuning":
        a.seeds = TUNING_SEEDS
    t0 = time.time()
    config = TEEConfig()
    peer_config = TEEConfig(soft_detectors=("ecod",))
    ours, theirs, batches, node_hours, fa, fa_peer = [], [], 0, 0.0, 0, 0
    counts = {}
    for seed in [int(s) for s in a.seeds.split(",")]:
        corpus = Corpus(CorpusSpec(nodes=a.nodes, hours=a.hours, seed=seed, faults_per_node_hour=a.rate, **shape))
        print(f"seed {seed}: {len(corpus.injections)} injections on {a.nodes} nodes x {a.hours} h "
              f"(jobs of {a.job_size} nodes, {a.gpus} GPUs each, steps of {lo:g}-{hi:g} s, "
              f"hangs idle: {a.hang_gpus}"
              + (f"; clocks {a.clock_skew_s:g} s apart, jitter {a.jitter_s:g} s, {a.late_s:g} s late, "
                 f"{a.lost_batches:.1%} lost" if a.clock_skew_s or a.jitter_s or a.late_s or a.lost_batches else "")
              + (f"; utilisation noise {a.util_noise:g} points" if a.util_noise else "")
              + (f"; {sum(o.kind == 'agent_restart' for o in corpus.ordinary)} agent restarts "
                 f"({sum(o.goodbye for o in corpus.ordinary)} with a goodbye)" if a.agent_restarts
                 else "")
              + (f"; {sum(o.kind == 'rank0_save' for o in corpus.ordinary)} rank-0 saves" if a.rank0_saves else "")
              + ")", file=sys.stderr, flush=True)
        events, n, counts = replay(corpus, config)
        r = score(corpus, events, LAG_S)
        ours.append(r)
        fa += r["false_alarms"]
        batches += n
        node_hours += a.nodes * a.hours
        if not a.no_peer and not theirs:
            # the skeleton's engine (the first rules only, no ECC, row remap, link; per-sample ECOD) is
            # slow (an ECOD refit per node every 10 samples): it runs on the first seed, first peer_hours
            pc_corpus = Corpus(CorpusSpec(nodes=a.nodes, hours=a.peer_hours, seed=seed, faults_per_node_hour=a.rate,
                                          **shape))
            ours_short = score(pc_corpus, replay(pc_corpus, config, progress=False)[0], LAG_S)
            events_p, _, _ = replay(pc_corpus, peer_config, progress=False)
            events_p = [e for e in events_p if e.detector in ("rule.xid", "rule.gpu_lost", "rule.nan_loss",
                                                                "rule.hang", "rule.heartbeat", "pyod.ecod")]
            rp = score(pc_corpus, events_p, LAG_S)
            theirs.append(rp)
            fa_peer = rp["false_alarms"]
            peer_node_hours = a.nodes * a.peer_hours
    classes = merge(ours)
    hard = {c.value: classes[c.value] for c in FaultClass if c in HARD}
    soft = {c.value: classes[c.value] for c in FaultClass if c in SOFT}
    fa_rate = fa / node_hours * 1000
    hard_p99 = max((v["delay_p99_s"] or 0) for v in hard.values())
    targets = {
        "hard_f1_min": {"value": min(v["f1"] for v in hard.values()), "target": 0.95},
        "soft_f1_min": {"value": min(v["f1"] for v in soft.values()), "target": 0.9},
        "false_alarms_per_1000_node_hours": {"value": round(fa_rate, 3), "target": 1.0, "at_most": True},
        "false_restart_or_evict": {"value": sum(len(r["false_restart_or_evict"]) for r in ours), "target": 0,
                                   "at_most": True},
        # the delays (p99, the worst seed's), from the fault's start to the decision: hard faults
        # within 2 s (the hard classes but hang, which has its own), hangs within 30 s, stragglers within 60 s
        "hard_delay_p99_s": {"value": max((v["delay_p99_s"] or 0) for k, v in hard.items() if k != "hang"),
                             "target": 2.0, "at_most": True},
        "hang_delay_p99_s": {"value": classes["hang"]["delay_p99_s"], "target": 30.0, "at_most": True},
        "straggler_delay_p99_s": {"value": classes["straggler"]["delay_p99_s"], "target": 60.0, "at_most": True},
    }
    for v in targets.values():
        v["met"] = v["value"] <= v["target"] if v.get("at_most") else v["value"] >= v["target"]
    looked = sorted(set(a.seeds.split(",")) & set(",".join((TUNING_SEEDS, SHAPE_TUNING_SEEDS,
                                                            VARIANT_TUNING_SEEDS)).split(",")))
    out = {"bench": "tee_quality", "mode": "offline (detector library)", "seeds": a.seeds,
           "seeds_role": ("TUNING seeds " + ",".join(looked) + ": looked at while tuning, not a report") if looked
           else "report seeds: never looked at while tuning", "nodes": a.nodes,
           **shape, "hours": a.hours, "node_hours": node_hours, "batches": batches, "classes": classes,
           "false_alarms": fa, "hard_delay_p99_s_with_hang": hard_p99,
           "false_restart_or_evict_events": [e for r in ours for e in r["false_restart_or_evict"]][:20],
           "false_events": [e for r in ours for e in r["false_events"]][:50],
           "misses": [m for r in ours for m in r["misses"]][:50],
           "note": ("delays are the decision (detected_ts on the sample clock, the replay lag taken off) minus the "
                    "injection start; onset_p99_s is the trigger sample's; the pipeline's own latency: "
                    "bench/tee_throughput"),
           "engine_counts": counts, "targets": targets,
           "all_targets_met": all(v["met"] for v in targets.values())}
    if theirs:
        pc = merge(theirs)
        short = merge([ours_short])
        mean_ours = float(np.mean([v["f1"] for v in short.values()]))
        mean_peer = float(np.mean([v["f1"] for v in pc.values()]))
        out["peer"] = {"engine": "skeleton rules + per-sample ECOD", "corpus_hours": a.peer_hours,
                       "mean_f1": round(mean_peer, 4), "f1": {k: v["f1"] for k, v in pc.items()},
                       "ours_mean_f1_same_corpus": round(mean_ours, 4),
                       "false_alarms_per_1000_node_hours": round(fa_peer / peer_node_hours * 1000, 3)}
        out["mean_f1"] = round(float(np.mean([v["f1"] for v in classes.values()])), 4)
        out["ratio_mean_f1_to_peer"] = round(mean_ours / max(mean_peer, 1e-9), 3)
    if a.pipeline_nodes:
        seed = int(a.seeds.split(",")[0]) + 500
        corpus = Corpus(CorpusSpec(nodes=a.pipeline_nodes, hours=a.pipeline_hours, seed=seed,
                                   faults_per_node_hour=a.rate, **shape))
        print(f"pipeline: seed {seed}, {len(corpus.injections)} injections on {a.pipeline_nodes} nodes x "
              f"{a.pipeline_hours} h, through the broker and a `transom tee --clock event` worker",
              file=sys.stderr, flush=True)
        events, n, span = pipeline(corpus, a.bootstrap)
        offline = score(corpus, replay(corpus, config, progress=False)[0], LAG_S)
        live = score(corpus, events)
        nh = a.pipeline_nodes * a.pipeline_hours
        pc = live["classes"]
        out["pipeline"] = {
            "mode": "embedded broker + one TEE worker process (event clock), same scoring as offline",
            "seed": seed, "node_hours": nh, "batches": n, "seconds": round(span, 1),
            "batches_per_s": round(n / span, 1), "fault_events": sum(not e.resolved for e in events),
            "duplicate_fault_ids": live["repeated_ids"],
            "f1": {k: v["f1"] for k, v in pc.items()},
            "f1_offline_same_corpus": {k: v["f1"] for k, v in offline["classes"].items()},
            "delay_p99_s": {k: v["delay_p99_s"] for k, v in pc.items()},
            "false_alarms_per_1000_node_hours": round(live["false_alarms"] / nh * 1000, 3),
            "hard_f1_min": min(pc[c.value]["f1"] for c in FaultClass if c in HARD),
            "soft_f1_min": min(pc[c.value]["f1"] for c in FaultClass if c in SOFT)}
        print(f"pipeline: {n} batches in {span:.0f}s; F1 {out['pipeline']['f1']}", file=sys.stderr, flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
