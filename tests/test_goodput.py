"""bench/goodput.py's cheap parts: --help, the seeded schedule by steps, the evaluation pause, the figures,
the straggler and pause hooks, and injection.

The bench itself (four runs of several minutes) is not run by the suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from transom.agents.agent import Agent
from transom.agents.intake import send_inject

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "goodput.py"


def _bench():
    spec = importlib.util.spec_from_file_location("goodput_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_help_lists_the_knobs():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for flag in ("--seed", "--quick", "--fault-every-steps", "--fault-every", "--kinds", "--watchdog", "--ckpt-every",
                 "--width", "--straggler-factor", "--runs", "--pause", "--hosts", "--services-nice",
                 "--torchft-pg-timeout", "--torchft-heartbeat-ms", "--plain-steps"):
        assert flag in out.stdout


def test_schedule_is_by_steps_a_function_of_the_seed_and_mixes_every_kind():
    g = _bench()
    a = g.make_schedule(7, 40, 8, 4)
    assert a == g.make_schedule(7, 40, 8, 4)
    assert a != g.make_schedule(8, 40, 8, 4)
    assert sorted(f.kind for f in a[:4]) == sorted(g.KINDS) == sorted(f.kind for f in a[4:])
    for i, f in enumerate(a):
        assert f.index == i and 0 <= f.rank < 4
        assert 40 * (i + 1) - 8 <= f.after_step <= 40 * (i + 1) + 8
    assert all(x.after_step < y.after_step for x, y in zip(a, a[1:]))
    tight = g.make_schedule(3, 1, 6, 2)                        # jitter cannot put two faults on one step
    assert all(x.after_step < y.after_step for x, y in zip(tight, tight[1:]))
    assert [f.kind for f in g.make_schedule(3, 10, 3, 2, kinds=("hang",))] == ["hang"] * 3
    with pytest.raises(ValueError, match="meltdown"):
        g.make_schedule(1, 60, 4, 4, kinds=("crash", "meltdown"))


def test_evaluation_pause_lies_between_faults_and_lasts_30_to_60s():
    g = _bench()
    for seed in range(20):
        sched = g.make_schedule(seed, 40, 5, 4)
        p = g.make_eval_pause(seed, 200, sched)
        assert p == g.make_eval_pause(seed, 200, sched)
        assert 30.0 <= p.seconds <= 60.0
        assert 1 <= p.after_step < 200 and p.after_step not in {f.after_step for f in sched}
    assert g.make_eval_pause(1, 100, []).after_step == 50


def test_spares_are_kept_warm_only_for_the_faults_that_come():
    g = _bench()
    schedule = [g.ScheduledFault(0, 100, "xid79", 1), g.ScheduledFault(1, 200, "crash", 0),
                g.ScheduledFault(2, 300, "straggler", 2), g.ScheduledFault(3, 400, "xid79", 3),
                g.ScheduledFault(4, 500, "straggler", 0)]
    assert g.spares_needed(schedule, 350) == 3          # the XID 79 and the straggler before step 350, plus one
    assert g.spares_needed(schedule, 600) == 5
    assert g.spares_needed(schedule, 50) == 1           # nothing comes: the one spare a job keeps
    assert g.spares_needed(schedule, 350, floor=4) == 4


def test_bad_flags_name_what_is_wrong(capsys):
    g = _bench()
    with pytest.raises(SystemExit):
        g.parse_args(["--runs", "slurm"])
    assert "slurm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        g.parse_args(["--pause", "60,30"])
    assert "--pause" in capsys.readouterr().err
    args = g.parse_args(["--quick", "--seed", "5"])
    assert (args.steps, args.width, args.seed) == (g.QUICK["steps"], g.QUICK["width"], 5)
    assert args.schedule == g.make_schedule(5, g.QUICK["fault_every_steps"], g.QUICK["faults"], 4)
    assert args.eval_pause == g.make_eval_pause(5, g.QUICK["steps"], args.schedule)
    assert g.parse_args(["--pause", "off", "--fault-every-steps", "10"]).eval_pause is None
    later = g.parse_args([])                     # the schedule waits for the plain run's step time
    assert later.schedule is None
    g.plan(later, 0.5)
    assert later.every_steps == 240 and later.schedule == g.make_schedule(1, 240, 16, 4)


def test_figures_lost_seconds_overhead_effective_ratio_and_targets(tmp_path):
    g = _bench()
    args = g.parse_args(["--steps", "40", "--fault-every-steps", "10", "--faults", "1", "--kinds", "crash",
                         "--pause", "30,30"])
    run = g.TorchrunRun(args, tmp_path, args.schedule, g.EvalPause(25, 30.0))
    run.t0 = 1000.0
    rows = [(s, 0, 1000.0 + s) for s in range(1, 13)]                   # 1 s steps, fault after step 12
    rows += [(s, 1, 1020.0 + s) for s in range(11, 26)]                  # relaunched: 8 s gap, steps 11-12 redone
    rows += [(s, 1, 1065.0 + s) for s in range(26, 41)]                  # the pause: 30 s + one step of 10 s extra
    run.steps.rows = rows
    run.result.faults.append(g.FaultRecord(0, "crash", 1, 10, delivered_s=12.5, step_at_fault=12, gen_at_fault=0,
                                           detected_s=14.0, first_step_s=31.0, resume_step=10))
    run.result.pause.delivered_s = 45.2
    run.end_ts = 1105.0
    run._measure()
    r = run.result
    assert r.steady_step_s == pytest.approx(1.0)
    f = r.faults[0]
    assert (f.detect_s, f.recover_s, f.steps_redone) == (1.5, 17.0, 2)
    assert f.lost_s == pytest.approx((1045.2 - 1012.5) - (25 - 12) * 1.0)
    assert r.pause.lost_s == pytest.approx((1105.0 - 1045.2) - (40 - 25) * 1.0 - 30.0)
    r.wall_s = 105.0
    g.grade(r, [0.5], g.EvalPause(25, 30.0))
    assert r.overhead == pytest.approx(1.0)                                   # twice the plain step
    assert r.useful_s == pytest.approx(40 * 0.5 + 30.0) and r.effective_ratio == pytest.approx(50.0 / 105.0, abs=1e-3)
    base = g.RunResult("torchrun", 40, faults=[g.FaultRecord(0, "crash", 1, 10, lost_s=40.0)])
    t = g.targets({"torchrun": base, "transom": r}, 120.0)
    assert t["lost_crash_s"] == {"target": 3.0, "value": f.lost_s, "met": False}
    assert t["lost_crash_vs_retry_loop"]["met"] is (f.lost_s <= 10.0)
    assert t["overhead"]["met"] is False and t["effective_ratio"]["met"] is False
    assert t["lost_hang_s"]["met"] is None                                # not measured: no flag either way


def test_a_faults_loss_is_graded_by_the_pace_just_before_it_not_by_the_drift_since_the_start(tmp_path):
    """The machine slows from 1.0 to 1.2 s a step before the fault; the heal costs one step of 3.5 s.
    Graded by the steady step of the start over the 200 steps to the end, drift would be charged to
    the fault (about 22 s); graded by the 30 steps before it, over 60 steps of progress, 2.3 s."""
    g = _bench()
    args = g.parse_args(["--steps", "300", "--fault-every-steps", "100", "--faults", "1", "--kinds", "crash",
                         "--pause", "off"])
    run = g.TorchrunRun(args, tmp_path, args.schedule, None)
    run.t0 = 1000.0
    rows = [(s, 0, 1000.0 + s) for s in range(1, 51)]
    rows += [(s, 0, 1050.0 + 1.2 * (s - 50)) for s in range(51, 101)]           # step 100 at 1110
    rows += [(s, 0, 1114.0 + 1.2 * (s - 101)) for s in range(101, 301)]         # healed in the job at 1114
    run.steps.rows = rows
    run.result.faults.append(g.FaultRecord(0, "crash", 1, 100, delivered_s=110.5, step_at_fault=100, gen_at_fault=0))
    run.end_ts = rows[-1][2]
    run._window_figures()
    assert run.result.faults[0].lost_s == pytest.approx((1114.0 - 1110.5) - 1.2, abs=0.01)
    assert (g.LOSS_STEPS, g.LOCAL_STEPS) == (60, 30)
    # the machine speeds up again after it (1.2 -> 1.0 s): graded by the mean of the paces on both sides
    fast = [(s, 0, 1114.0 + 1.0 * (s - 101)) for s in range(101, 301)]
    run.steps.rows = rows[:100] + fast
    run.end_ts = fast[-1][2]
    run._window_figures()
    assert run.result.faults[0].lost_s == pytest.approx((1114.0 - 1110.5) + 59 * 1.0 - 60 * 1.1, abs=0.01)
    run.steps.rows = rows
    # a straggler slows every step until its node is replaced: graded to 60 steps past the replacement
    # (steps 101-130 at 2.4 s, replaced at step 130, then 1.2 s again); never replaced: to the end
    slow = [(s, 0, 1110.0 + 2.4 * (s - 100)) for s in range(101, 131)]
    slow += [(s, 0, slow[-1][2] + 1.2 * (s - 130)) for s in range(131, 301)]
    run.steps.rows = rows[:100] + slow
    run.end_ts = slow[-1][2]
    straggler = g.FaultRecord(0, "straggler", 1, 100, delivered_s=110.0, step_at_fault=100, gen_at_fault=0,
                              restarted=True, detected_s=slow[29][2] - 1000.0)
    run.result.faults = [straggler]
    run._window_figures()
    assert straggler.lost_s == pytest.approx(30 * 1.2, abs=0.01)
    straggler.restarted = False
    run._window_figures()
    assert straggler.lost_s == pytest.approx(30 * 1.2, abs=0.01)      # the same: it ended, and the end is graded


def test_each_system_is_graded_against_the_plain_runs_that_bracket_it():
    """The machine drifts within one invocation (a plain step of 0.30 s at its start, 0.34-0.43 s half an
    hour later): each system's overhead and effective ratio use the mean of the plain steps right before
    and after it; without the one after (--no-bracket, or it failed), the one before."""
    g = _bench()
    r = g.RunResult("transom", 100, wall_s=60.0, steady_step_s=0.44)
    g.grade(r, [0.30, 0.50], g.EvalPause(50, 10.0))
    assert r.plain_step_s == pytest.approx(0.40) and r.overhead == pytest.approx(0.10)
    assert r.useful_s == pytest.approx(40.0) and r.effective_ratio == pytest.approx(40.0 / 60.0, abs=1e-3)
    assert g.summary(r)["plain_step_s"] == pytest.approx(0.40)
    alone = g.RunResult("torchrun", 100, wall_s=60.0, steady_step_s=0.33)
    g.grade(alone, [0.30, None], None)
    assert alone.plain_step_s == pytest.approx(0.30) and alone.overhead == pytest.approx(0.10)
    assert g.parse_args([]).bracket is True and g.parse_args(["--no-bracket"]).bracket is False


def test_steady_step_starts_once_the_warm_spares_are_ready(tmp_path):
    g = _bench()
    args = g.parse_args(["--steps", "40", "--fault-every-steps", "30", "--faults", "1", "--kinds", "crash",
                         "--pause", "off"])
    run = g.TorchrunRun(args, tmp_path, args.schedule, None)
    run.t0 = 1000.0
    # steps 1-10 take 2 s while the spares start (import torch, build the model), then 1 s
    times = [1000.0 + 2 * s for s in range(1, 11)] + [1020.0 + s for s in range(1, 21)]
    run.steps.rows = [(s, 0, t) for s, t in zip(range(1, 31), times)]
    run._window_figures()
    assert run.result.steady_step_s > 1.15            # without the warm mark, the start-up is in the window
    run.warm_ts = 1020.0
    run._window_figures()
    assert run.result.steady_step_s == pytest.approx(1.0)


def test_overhead_pairs_grade_the_median_ratio_of_fault_free_pairs():
    g = _bench()
    pairs = [[0.25, 0.26], [0.30, 0.29], [0.22, 0.30], [None, 0.3]]     # drift between pairs, one pair failed
    assert g.paired_overhead(pairs) == pytest.approx(0.04)             # median of +4 %, -3.3 %, +36 %
    t = g.RunResult("transom", 40)
    t.overhead = 0.20                                                   # against the one plain run: drift in it
    out = g.targets({"transom": t}, 120.0, {"value": g.paired_overhead(pairs), "pairs": pairs,
                                            "mtbf": "the product's default"})
    assert out["overhead"]["value"] == pytest.approx(0.04) and out["overhead"]["met"] is True
    assert out["overhead"]["method"].endswith("pairs, the cadence's MTBF the product's default")
    # the pairs' Transom runs get the product's default MTBF (no --mtbf), the fault runs the schedule's
    args = g.parse_args(["--fault-every-steps", "300"])
    assert args.pairs_mtbf == "default"
    assert g.ckpt_args(argparse.Namespace(**{**vars(args), "mtbf_s": None})) == ["--ckpt-every", "auto"]
    assert g.ckpt_args(argparse.Namespace(**{**vars(args), "mtbf_s": 123.0})) == \
        ["--ckpt-every", "auto", "--mtbf", "123.0"]
    assert out["overhead"]["in_the_fault_run"] == 0.20
    assert g.targets({"transom": t}, 120.0)["overhead"]["met"] is False


def _saved_run(g, path, seed, stragglers, world=4):
    """A run's output as a user saves it (progress text, then the JSON line), with one straggler per
    entry of ``stragglers``: (after step, retry loop's lost s, Transom's lost s)."""
    runs = {}
    for name, col, target in (("torchrun", 1, "slot"), ("transom", 2, "node")):
        r = g.RunResult(name, 900, completed=True, effective_ratio=0.9)
        r.faults = [g.FaultRecord(i, "straggler", 1, s[0], target=f"{target}1", lost_s=s[col])
                    for i, s in enumerate(stragglers)]
        runs[name] = g.summary(r)
    line = {"bench": "goodput", "seed": seed, "world": world, "steps": 900, "width": 384, "layers": 4,
            "batch_size": 2, "fault_every_steps": 450, "kinds": ["straggler"], "straggler_factor": 0.7,
            "runs": runs, "targets": {}, "met": None}
    path.write_text("== run torchrun ==\n  progress ...\n" + json.dumps(line) + "\n")
    return str(path)


def test_combine_pools_the_faults_of_saved_runs_and_grades_them(tmp_path, capsys):
    g = _bench()
    files = [_saved_run(g, tmp_path / f"s{seed}.log", seed, [(400 + seed, base, mine)])
             for seed, base, mine in ((1, 40.0, 4.0), (2, 50.0, 6.0), (3, 8.0, 5.0))]
    assert g.main(["--combine", *files]) == 0
    out = capsys.readouterr().out
    got = json.loads(out.strip().splitlines()[-1])
    assert got["per_kind"]["torchrun"]["straggler"] == {"n": 3, "lost_s": 40.0, "detect_s": None,
                                                        "recover_s": None, "recompute_s": None}
    assert got["per_kind"]["transom"]["straggler"]["lost_s"] == 5.0
    assert got["targets"]["lost_straggler_vs_retry_loop"] == {"target": 0.25, "value": 0.125, "met": True}
    assert [c["seed"] for c in got["combined"]] == [1, 2, 3]
    row = next(line.split() for line in out.splitlines() if line.split()[:4] == ["2", "3", "403", "straggler"])
    assert row[4:] == ["8.0s", "5.0s"]                    # each fault's row: what it cost each system


def test_combine_refuses_a_cut_short_run_or_runs_of_another_setup(tmp_path, capsys):
    g = _bench()
    good = _saved_run(g, tmp_path / "good.log", 1, [(401, 40.0, 4.0)])
    cut = tmp_path / "cut.log"
    cut.write_text("== run torchrun ==\n  [ 15.0s] torchrun: step 31/900\n")
    assert g.main(["--combine", good, str(cut)]) == 2
    assert "cut.log: no goodput JSON line" in capsys.readouterr().err
    other = _saved_run(g, tmp_path / "other.log", 2, [(402, 40.0, 4.0)], world=8)
    assert g.main(["--combine", good, other]) == 2
    assert "not comparable" in capsys.readouterr().err


def test_a_false_restart_during_the_pause_is_counted(tmp_path):
    g = _bench()
    args = g.parse_args(["--steps", "40", "--fault-every-steps", "10", "--faults", "0"])
    run = g.TorchrunRun(args, tmp_path, [], g.EvalPause(20, 40.0))
    run.t0 = 1000.0
    run.result.pause.delivered_s = 30.0
    run.detected(1050.0, "watchdog")
    run.detected(1200.0, "watchdog")                      # long after the pause: not this pause's
    assert run.result.pause.false_restarts == 1 and "watchdog" in run.result.pause.false_events[0]


def _thread_nices(pid: int) -> list[int]:
    from transom.priority import read
    return [read(int(task.name)).nice for task in Path(f"/proc/{pid}/task").iterdir()]   # /proc/TID is the thread


@pytest.mark.skipif(not hasattr(os, "setpriority") or os.geteuid() != 0,
                    reason="lowering a nice value back to 0 needs root")
def test_renice_reaches_every_thread_of_a_process_also_those_started_before():
    """A spare started at the services' nice has threads (its gloo ones) by the time it takes a rank:
    the bench puts every thread of a rank at 0, and every thread of a service at the services' nice."""
    import psutil
    gp = _bench()
    code = ("import os, threading, time\n"
            "os.setpriority(os.PRIO_PROCESS, 0, 10)\n"
            "ts = [threading.Thread(target=time.sleep, args=(60,), daemon=True) for _ in range(3)]\n"
            "[t.start() for t in ts]\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        rank, service = procs
        assert _thread_nices(rank.pid) == [10] * 4              # the threads inherited the spare's nice
        gp.renice_threads([psutil.Process(p.pid) for p in procs], {rank.pid}, 7)
        assert _thread_nices(rank.pid) == [0] * 4               # every thread of the rank, not only its main one
        assert _thread_nices(service.pid) == [7] * 4
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_pause_hook_holds_every_rank_until_the_given_time(tmp_path, monkeypatch):
    from transom.examples.train_lm import slowdown
    monkeypatch.setenv("TRANSOM_NODE", "node1")
    until = time.time() + 0.3
    (tmp_path / "pause").write_text(f"{until}\n")
    waited = slowdown(str(tmp_path), 0.01)
    assert time.time() >= until and waited > 0
    assert slowdown(str(tmp_path), 0.01) == 0.0           # a pause in the past: full speed


def test_straggler_hook_stretches_steps_only_for_the_slow_node(tmp_path, monkeypatch):
    from transom.examples.train_lm import slowdown
    monkeypatch.setenv("TRANSOM_NODE", "node2")
    assert slowdown(str(tmp_path), 0.02) == 0.0                 # no file: full speed
    (tmp_path / "node2").write_text("0.5\n")
    assert slowdown(str(tmp_path), 0.02) == pytest.approx(0.02)  # half speed: the step takes twice as long
    (tmp_path / "node2").write_text("fast\n")
    assert slowdown(str(tmp_path), 0.02) == 0.0
    monkeypatch.delenv("TRANSOM_NODE")
    monkeypatch.setenv("RANK", "3")
    (tmp_path / "slot3").write_text("0.8")
    assert slowdown(str(tmp_path), 0.04) == pytest.approx(0.01)
    (tmp_path / "slot3").write_text("0.8 0.015\n")             # the bench's fixed extra seconds win
    assert slowdown(str(tmp_path), 0.04) == pytest.approx(0.015)


def test_agent_injects_a_straggler_on_its_simulated_gpu(broker):
    with Agent(f"gp-{uuid.uuid4().hex[:6]}", broker.bootstrap, gpu_source="simulated", gpus=1, interval=0.5) as agent:
        reply = send_inject(agent.intake_addr, "straggler", gpu=0, timeout=10)
        assert reply["ok"] and reply["fault"] == "straggler", reply
        assert [f.kind for f in agent.simulated.played] == ["straggler"]
        bad = send_inject(agent.intake_addr, "straggler", gpu=3, timeout=10)
        assert not bad["ok"] and "GPU 3" in bad["error"]


def test_hosts_mode_reaches_ranks_on_their_bed_host(tmp_path):
    """--hosts wiring, without a training job: the steps file and the slowdown hook's directory in the
    stack's shared run dir; a rank's PID read from its host's launcher record and mapped to ours; a
    hang SIGSTOPs it across the PID namespace; an XID 79 SIGKILLs it and then kills its host."""
    import json
    import os
    from types import SimpleNamespace

    from tests.util import require_bed, wait_until
    from transom import testbed

    require_bed()
    g = _bench()
    args = g.parse_args(["--runs", "transom", "--steps", "10"])
    args.hosts = True
    run = g.TransomRun(args, tmp_path / "transom", [], None)
    shared = tmp_path / "transom" / "stack"
    assert run.steps.path == shared / "steps.txt" and run.slow_dir == shared / "slow"
    assert g.model_args(args, run.work, run.slow_dir)[:2] == ["--slowdown-dir", str(shared / "slow")]
    gen_dir = shared / "jobs" / run.job / "gen-0"
    gen_dir.mkdir(parents=True)
    (gen_dir / "launch.json").write_text(json.dumps({"nodes": ["node0"]}))
    rank_dir = shared / "hosts" / "node0" / run.job / "gen-0"
    rank_dir.mkdir(parents=True)
    with testbed.Bed(["node0", "node1"], share=[shared]) as bed:
        # the stack's parts the bench uses, around a real bed (a full LocalStack takes a minute)
        run.stack = SimpleNamespace(bed=bed, run_dir=shared, agents={}, kill_host=bed.kill)
        rank = bed.run("node0", ["/bin/sh", "-c", f'echo "$$ $$" > {rank_dir}/rank-0.pid; exec sleep 120'])
        wait_until(lambda: (rank_dir / "rank-0.pid").exists(), 30, "the rank's pid file")
        pid = run.rank_pid(0)
        assert pid == rank.root_pid and pid != int((rank_dir / "rank-0.pid").read_text().split()[1])
        run._deliver(g.ScheduledFault(0, 5, "hang", 0), time.time())
        state = lambda: open(f"/proc/{pid}/status").read().split("State:")[1].split()[0]  # noqa: E731
        wait_until(lambda: state() in ("T", "t"), 10, "the rank stopped")
        run._deliver(g.ScheduledFault(1, 6, "xid79", 0), time.time())
        assert run._host_kills and run._host_kills[0][0] == "node0"
        run._kill_hosts(time.time() + 31)          # no TEE here: past the deadline, the host goes
        assert not bed.is_up("node0") and not run._host_kills
        assert "host node0 killed" in run.result.faults[-1].note
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert run.rank_pid(0) is None
        # an in-job heal: node1's warm spare takes rank 0 (the launcher's host.json names its directory,
        # a path on node1); the next fault on rank 0 reaches the spare's training process
        spare_dir = shared / "hosts" / "node1" / run.job / "gen-0" / "spare-0"
        spare_dir.mkdir(parents=True)
        (spare_dir.parent / "host.json").write_text(json.dumps(
            {"node": "node1", "pids": {"0": 4242}, "dirs": {"0": f"/run/elsewhere/{run.job}/gen-0/spare-0"}}))
        spare = bed.run("node1", ["/bin/sh", "-c", f'echo "1 $$" > {spare_dir}/rank-0.pid; exec sleep 120'])
        wait_until(lambda: (spare_dir / "rank-0.pid").exists(), 30, "the spare's pid file")
        run.nodes_of[0] = ["node1"]              # what the controller's "healing" event tells the bench
        assert run.rank_pid(0) == spare.root_pid
        run._deliver(g.ScheduledFault(2, 7, "crash", 0), time.time())
        def gone(p: int) -> bool:
            try:
                return open(f"/proc/{p}/status").read().split("State:")[1].split()[0] in ("Z", "X")
            except (OSError, IndexError):
                return True
        wait_until(lambda: gone(spare.root_pid), 10, "the spare's process killed")
