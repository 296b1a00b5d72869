"""``transom demo``: the whole loop on one machine, with a fault injected mid-run.

Starts the embedded broker, five node agents with simulated GPUs (four run the job, one is the
spare), a TEE worker and the controller; runs the example language model with four ranks;
injects XID 79 ("GPU has fallen off the bus") on one node halfway through; shows progress live;
then prints the timeline of the recovery and a summary, stops everything it started, and exits
0 only if the job completed all its steps.

Where the machine can make namespaces (the test bed, :mod:`transom.testbed`), every node is a host
of its own (agent, checkpoint daemon and launcher; its own network, /tmp and /dev/shm) and the
broker, TEE and controller run on a control host: the parts meet only over the bed's network, as
on a cluster. Elsewhere it runs on this one host and says so in one line. ``--hosts`` /
``--no-hosts`` choose.

With ``--scheduler slurm`` the same loop runs on the hosts test bed under a real Slurm cluster
(slurmctld, one slurmd per node host; see transom/demo_slurm.py): the ranks are Slurm batch jobs
and the faulty node is drained in Slurm. It needs root (namespaces) and slurm-wlm and munge.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["register", "run_demo"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole loop on this machine with an injected XID 79",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--steps", type=int, default=300, help="training steps of the job (default 300)")
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval in steps (default 20)")
    p.add_argument("--fault-at", type=int, default=None, help="inject the fault once this step is reached "
                                                             "(default: half of --steps)")
    p.add_argument("--fault-node", default="node1", help="node to inject XID 79 on (default node1)")
    p.add_argument("--run-dir", default=None, help="where logs, checkpoints and rank outputs go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds (default 600)")
    p.add_argument("--hosts", action=argparse.BooleanOptionalAction, default=None,
                   help="run on the test bed: a control host and five node hosts as namespaces, ranks started by "
                        "each host's launcher (default: when this machine can make them; --no-hosts: every part on "
                        "this one host)")
    p.add_argument("--scheduler", choices=("local", "slurm"), default="local",
                   help="local: ranks as local processes (default); slurm: on the hosts test bed under a real "
                        "Slurm cluster (needs root, slurm-wlm and munge)")
    p.set_defaults(func=run_demo)


def _on_hosts(wanted: bool | None) -> bool:
    """Whether to run on the test bed: ``wanted`` (None: when it is available, else one line saying why not)."""
    from . import testbed

    if wanted is False:
        return False
    ok, reason = testbed.available()
    if not ok:
        if wanted:
            raise SystemExit(f"transom demo: error: --hosts: {reason}")
        print(f"demo: the test bed is unavailable ({reason}): running every part on this one host", flush=True)
    return ok


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.time()

    def say(self, text: str, ts: float | None = None) -> None:
        print(f"[{(ts or time.time()) - self.t0:6.1f}s] {text}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    from . import contracts
    from .stack import LocalStack, Monitor, train_command

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    scheduler = getattr(args, "scheduler", "local")
    if scheduler == "slurm":
        from . import demo_slurm
        ok, reason = demo_slurm.available()
        if not ok:
            print(f"demo: --scheduler slurm cannot run here: {reason}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, interrupted)   # so that a SIGTERM still stops what the demo started
    clock = _Clock()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="transom-demo-"))
    fault_at = args.fault_at or args.steps // 2
    if scheduler == "slurm":
        stack = demo_slurm.BedStack(run_dir)
        inject = stack.inject
        where = "Slurm cluster on the test bed (slurmctld on ctl, slurmd on node0..node4)"
    else:
        on_hosts = _on_hosts(getattr(args, "hosts", None))
        stack = LocalStack(run_dir, hosts=on_hosts)
        inject = stack.inject
        where = (f"the test bed {stack.bed.subnet}: hosts {', '.join(stack.bed.hosts)}; bed tb{stack.bed.index}"
                 if on_hosts else "local processes on this host")
    print(f"Transom demo ({where}): 4 ranks on node0..node3, spare node4; XID 79 on {args.fault_node} at step "
          f"{fault_at}. Logs in {run_dir}/logs", flush=True)
    job = "demo"
    timeline: dict[str, float] = {}
    steps_lost = None
    healed: list[dict] = []
    last_step = -1
    result = 1
    report_path = None
    try:
        bootstrap = stack.start_broker()
        clock.say(f"broker ready at {bootstrap}")
        monitor = Monitor(bootstrap)
        stack.start_agents()
        stack.start_tee()
        clock.say("agents (5 nodes, simulated GPUs) and the TEE worker started")
        ctl = stack.start_controller(job, train_command(args.steps, args.ckpt_every), world_size=4,
                                     extra=["--exit-when-done"])
        clock.say("controller started; job submitted")
        injected = False
        deadline = time.monotonic() + args.timeout
        next_progress = 0.0
        drain_until = time.monotonic() + 3
        while time.monotonic() < deadline:
            got = monitor.poll(0.2)
            if ctl.popen.poll() is not None and (got is None or result == 0 or time.monotonic() > drain_until):
                break               # the controller has ended the job: what is left is metrics traffic
            if ctl.popen.poll() is None:
                drain_until = time.monotonic() + 3
            if got is None:
                continue
            topic, ev = got
            if topic == contracts.METRICS:
                for s in ev.of(contracts.Source.TRAIN):
                    if s.tags.get("job") != job or s.index != 0 or "step" not in s.fields or s.tags.get("event"):
                        continue
                    step = int(s.fields["step"])
                    last_step = max(last_step, step)
                    if time.monotonic() >= next_progress:
                        loss = s.fields.get("loss", float("nan"))
                        clock.say(f"train  step {step:4d}/{args.steps} loss {loss:.3f} "
                                  f"gen {s.tags.get('generation')}")
                        next_progress = time.monotonic() + 5
                    if not injected and step >= fault_at:
                        inject(args.fault_node, "xid79")
                        injected = True
                        clock.say(f"INJECT XID 79 on {args.fault_node} (GPU 0)")
            elif topic == contracts.FAULTS and ev.job in (job, None):
                clock.say(f"fault  {ev.kind.value} on {ev.node} by {ev.detector}: {ev.summary}", ev.detected_ts)
                if ev.kind == contracts.FaultKind.XID and "fault event (TEE)" not in timeline:   # the first XID
                    timeline["fault observed (XID sample)"] = ev.observed_ts
                    timeline["fault event (TEE)"] = ev.detected_ts
            elif topic == contracts.CHECKPOINTS and ev.job == job:
                clock.say(f"ckpt   step {ev.step} ready ({len(ev.shards)} shards, "
                          f"{sum(s.size for s in ev.shards) / 1e6:.1f} MB)", ev.ts)
            elif topic == contracts.LIFECYCLE and ev.job == job and ev.state != "request":
                clock.say(f"life   {ev.name} -> {ev.state} {_brief(ev.detail)}", ev.ts)
                if ev.name == "healing":
                    timeline.setdefault("in-job heal decided (controller): spare takes the rank", ev.ts)
                elif ev.name == "healed":
                    timeline.setdefault("group re-formed, state synced (in-job)", ev.ts)
                    healed.append(ev.detail)
                    clock.say(f"HEALED in the job: rank {ev.detail.get('rank')} now on {ev.detail.get('node')}, "
                              f"{ev.detail.get('seconds')} s from the decision; survivors kept their processes")
                elif ev.name == "relaunching" and "evicted" in ev.detail:
                    timeline.setdefault("eviction decided (controller)", ev.ts)
                elif ev.name == "launched" and ev.detail.get("generation", 0) > 0:
                    timeline.setdefault("relaunched on the spare", ev.ts)
                elif ev.name == "resumed":
                    timeline.setdefault("first step after resume", ev.ts)
                    steps_lost = ev.detail.get("steps_lost")
                elif ev.name in ("completed", "failed"):
                    if ev.name == "failed":
                        clock.say(f"job failed: {ev.detail.get('reason')}")
                    result = 0 if ev.name == "completed" else 1
        else:
            print(f"demo: timed out after {args.timeout:.0f}s", file=sys.stderr)
            result = 1
        code = ctl.popen.wait(30) if ctl.popen.poll() is None else ctl.popen.returncode
        if scheduler == "slurm":
            print("\nSlurm's nodes (scontrol show nodes; a drained node waits for an operator's RESUME)")
            for line in stack.node_report():
                print(f"  {line}")
        monitor.close()
        from .report import write_report
        report_path = write_report(bootstrap, job, run_dir / "report.html")
        if code != 0:
            result = 1
    finally:
        clock.say("stopping everything the demo started")
        stack.stop()
    _report(timeline, steps_lost, last_step, args.steps, result, healed)
    if report_path:
        print(f"\nRun report (open in a browser): {report_path}", flush=True)
    return result


def _brief(detail: dict) -> str:
    keep = {k: v for k, v in detail.items() if k in ("path", "generation", "nodes", "evicted", "replacement", "spare",
                                                      "resume_step", "step", "steps_lost", "seconds", "reason")}
    return " ".join(f"{k}={v}" for k, v in keep.items())


def _report(timeline: dict[str, float], steps_lost, last_step: int, steps: int, result: int,
            healed: list[dict] | None = None) -> None:
    print("\nTimeline")
    t0 = timeline.get("fault observed (XID sample)")
    for name, ts in sorted(timeline.items(), key=lambda kv: kv[1]):
        rel = f"+{ts - t0:6.2f}s" if t0 else ""
        print(f"  {time.strftime('%H:%M:%S', time.localtime(ts))}.{int(ts % 1 * 1000):03d} {rel}  {name}")
    print("\nSummary")
    detect = timeline.get("fault event (TEE)")
    resumed = timeline.get("first step after resume") or timeline.get("group re-formed, state synced (in-job)")
    print(f"  recovery path  : {'in-job (warm spare, survivors kept their state)' if healed else 'relaunch'}")
    print(f"  time to detect : {detect - t0:.2f} s" if t0 and detect else "  time to detect : n/a")
    print(f"  time to recover: {resumed - t0:.2f} s (fault to first step after resume)" if t0 and resumed
          else "  time to recover: n/a")
    print(f"  steps lost     : {steps_lost if steps_lost is not None else ('1 (the failed step, redone)' if healed else 'n/a')}")
    print(f"  job            : {'completed' if result == 0 else 'NOT completed'}"
          f" (last step seen {last_step}/{steps})")
