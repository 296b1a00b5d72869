"""``transom controller`` (run the controller), ``transom run`` (submit a job), ``transom jobs`` (list, show)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time

from transom.cli import add_bootstrap, need_bootstrap

__all__ = ["register"]


def _node(text: str) -> tuple[str, str]:
    name, sep, addr = text.partition("=")
    if not name or (sep and ":" not in addr):
        raise argparse.ArgumentTypeError(f"--node {text!r}: expected NAME=HOST:PORT (the node's agent intake), "
                                         "or NAME alone for the kubernetes and slurm backends")
    return name, addr


#: Variables of the submitter's environment that never reach the ranks: anything that looks like a
#: secret (it would be written into every lifecycle event), and Transom's own settings, which the
#: controller and the nodes decide.
NOT_INHERITED = re.compile(r"(TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|AUTH|COOKIE|"
                           r"SESSION|_KEY$)|^(TRANSOM_|PWD$|OLDPWD$|SHLVL$|_$)", re.I)


def submitter_env(environ: dict[str, str], inherit: bool = True, extra: list[str] = ()) -> dict[str, str]:
    """The environment a job's ranks get from the submitter: ``environ`` less :data:`NOT_INHERITED`
    (nothing with ``inherit`` False), then ``extra`` (``K=V`` each, given explicitly, never filtered)."""
    env = {k: v for k, v in environ.items() if not NOT_INHERITED.search(k)} if inherit else {}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"transom run: error: --env {item!r}: expected NAME=VALUE")
        env[key] = value
    return env


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-restarts", type=int, default=5, help="relaunches allowed per --restart-window (default 5)")
    p.add_argument("--restart-window", type=float, default=3600.0, metavar="S",
                   help="seconds over which --max-restarts counts (default 3600)")
    p.add_argument("--backoff", type=float, default=1.0, metavar="S",
                   help="delay before a relaunch on the same nodes, doubling with each relaunch in the window "
                        "(the first relaunch that replaced a faulty node does not wait; default 1)")
    p.add_argument("--report-warn", type=float, default=60.0, metavar="S",
                   help="a generation with no training report (report()) this long after its launch gets a "
                        "warning event (default 60)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="a generation that has not reached its first training step this long after its launch "
                        "(rendezvous, pods Pending, a queue) fails that launch with the reason (default 600)")
    p.add_argument("--min-world-size", type=int, default=0,
                   help="shrink down to this many ranks when no spare is left (default 0: never shrink)")
    p.add_argument("--heal", choices=("in-job", "relaunch"), default="in-job",
                   help="in-job (default): when the ranks joined the elastic API (transom.elastic) and a warm spare "
                        "waits on a spare node, a rank fault is healed in the job (survivors keep their state, the "
                        "spare takes the failed rank), else relaunched; relaunch: every fault relaunches the job "
                        "from the newest checkpoint")
    p.add_argument("--heal-timeout", type=float, default=60.0, metavar="S",
                   help="an in-job heal whose group has not stepped this long after the decision falls back to a "
                        "relaunch (default 60)")


def _spec(args: argparse.Namespace, command: list[str], world: int):
    from .state import JobSpec
    return JobSpec(tuple(command), world, max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                   backoff_s=args.backoff, min_world_size=args.min_world_size, report_warn_s=args.report_warn,
                   start_timeout_s=args.start_timeout, spares=getattr(args, "spares", 0), heal=args.heal,
                   heal_timeout_s=args.heal_timeout)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "controller", help="run the controller (TOL): heal jobs from fault events",
        description="Wait for the controller lease (one active controller; the others stand by), replay "
                    "transom.lifecycle, then drive every job from fault, checkpoint and training events. With "
                    "--job-id and a command after --, submit that job (once: a restarted controller finds it in "
                    "the lifecycle and does not submit it again). Jobs submitted with `transom run` are picked up "
                    "too. Test hook (off by default): TRANSOM_TEST_CRASH_AT=STEP makes the controller SIGKILL "
                    "itself after carrying out that step (e.g. evicting, relaunching).",
        epilog="example: transom controller --node node0=127.0.0.1:7000 --node node1=127.0.0.1:7001 "
               "--job-id demo --world-size 1 -- python -m transom.examples.train_lm --steps 100")
    add_bootstrap(p, embedded=True)
    p.add_argument("--backend", default="local", choices=["local", "hosts", "kubernetes", "slurm"],
                   help="where ranks run (default: local; hosts: through each node host's `transom launcher`)")
    p.add_argument("--run-dir", default=os.environ.get("TRANSOM_RUN_DIR", "runs"),
                   help="directory for rank logs and launch records (default: runs; env TRANSOM_RUN_DIR)")
    p.add_argument("--ckpt-dir", default=os.environ.get("TRANSOM_CKPT_DIR"),
                   help="checkpoint directory handed to the ranks (default: RUN_DIR/JOB/ckpt)")
    p.add_argument("--node", type=_node, action="append", default=[], metavar="NAME=HOST:PORT",
                   help="a node and its agent's intake address, in order; the first WORLD_SIZE run the job, "
                        "the rest are spares (repeat); kubernetes and slurm: default all schedulable nodes")
    p.add_argument("--launcher", type=_node, action="append", default=[], metavar="NODE=HOST:PORT",
                   help="hosts backend: a node's launcher address (repeat); launchers that advertise themselves "
                        "in the service registry are found without it")
    p.add_argument("--unreachable", type=float, default=5.0, metavar="S",
                   help="hosts backend: a launcher silent this long is a lost node, its ranks killed (default 5)")
    p.add_argument("--job-id", help="submit this job")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the submitted job (default: all but one node)")
    _policy_args(p)
    p.add_argument("--poll-interval", type=_seconds, default=0.5, metavar="S",
                   help="seconds between looks at the backend for ranks that exited (default 0.5; on Kubernetes "
                        "or Slurm each look is API or scheduler calls); a rank whose collective failed says so, "
                        "and the controller looks at once whatever this is")
    p.add_argument("--precheck", default="full", choices=["full", "health", "off"],
                   help="before every launch: full = agent health + a gloo all-reduce across the nodes; "
                        "health = agent health only; off (default full)")
    p.add_argument("--warm-ranks", action=argparse.BooleanOptionalAction, default=True,
                   help="local backend: ranks of `python -m MODULE` / `python SCRIPT.py` jobs and the pre-check's "
                        "processes are forks of one zygote that imported torch once, so a relaunch does not wait "
                        "for the import (default: on)")
    p.add_argument("--allow-no-gpus", action="store_true",
                   help="pre-check: pass nodes whose agent reports no GPU samples")
    p.add_argument("--heartbeat-stale", type=float, default=5.0, metavar="S",
                   help="pre-check: a node whose newest agent batch is older than this fails (default 5)")
    p.add_argument("--lease", type=float, default=3.0, metavar="S",
                   help="a standby takes over when the active controller has not renewed for S seconds (default 3)")
    p.add_argument("--k8s-namespace", default="default", help="kubernetes: namespace of the job's pods")
    p.add_argument("--k8s-image", default="transom:latest", help="kubernetes: container image of the ranks")
    p.add_argument("--kubeconfig", default=None, help="kubernetes: kubeconfig file (default: in-cluster, then ~/.kube)")
    p.add_argument("--k8s-api", default=None, metavar="URL", help="kubernetes: API server URL (overrides kubeconfig)")
    p.add_argument("--k8s-gpus", type=int, default=1, metavar="N",
                   help="kubernetes: nvidia.com/gpu each rank pod requests (default 1; 0: none)")
    p.add_argument("--k8s-ckpt-pvc", default="transom-ckpt", metavar="NAME",
                   help="kubernetes: the shared checkpoint PersistentVolumeClaim, mounted at --ckpt-dir in every "
                        "rank pod (default transom-ckpt; empty: none)")
    p.add_argument("--k8s-ckpt-runtime", default="/dev/shm/transom", metavar="PATH",
                   help="kubernetes: the node's TCE runtime directory (a host path shared with the checkpoint "
                        "daemon), mounted in rank pods (default /dev/shm/transom)")
    p.add_argument("--k8s-agent-port", type=int, default=7100, metavar="PORT",
                   help="kubernetes: UDP intake port of the node agents; rank pods reach them at their node's "
                        "status.hostIP (default 7100; --node NAME=ADDR overrides per node)")
    p.add_argument("--slurm-partition", default=None, help="slurm: partition of the batch jobs (sbatch) and the pre-check (srun)")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit once the submitted job (without --job-id: every job it drove, live when it took the "
                        "lease or submitted since) has ended; exit status 0 completed, 1 failed, 3 lease lost")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command of the submitted job")
    p.set_defaults(func=run)

    r = sub.add_parser("run", help="submit a job to the running controller",
                       description="Submit a job: the active controller picks NODES schedulable nodes (and SPARES "
                                   "more as spares), pre-checks them and launches the command, one rank per node, "
                                   "in this directory with this shell's environment (see --env). The job waits "
                                   "(queued) while other jobs hold the nodes. The script must call transom's "
                                   "report() each step: that is how the controller sees progress and hangs.",
                       epilog="example: transom run --nodes 4 --spares 1 --job-id lm -- python -m "
                              "transom.examples.train_lm --steps 300")
    add_bootstrap(r)
    r.add_argument("--nodes", type=_positive, required=True, help="ranks, one per node")
    r.add_argument("--spares", type=int, default=0,
                   help="nodes held for the job besides its ranks': a node evicted for a fault is replaced by one "
                        "at once (default 0: the job then shrinks if --min-world-size allows, else fails); fewer "
                        "free nodes than asked: a warning event")
    r.add_argument("--job-id", default=None, help="job id (default: a new one)")
    _policy_args(r)
    r.add_argument("--follow", action="store_true", help="print the job's lifecycle until it ends")
    r.add_argument("--wait-controller", type=float, default=10.0, metavar="S",
                   help="wait this long for a controller to hold the lease before refusing (default 10)")
    r.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set NAME for the ranks (repeat); given explicitly, never filtered")
    r.add_argument("--no-inherit-env", action="store_true",
                   help="do not pass this shell's environment to the ranks (only --env); by default they get it, "
                        "less secret-like names (TOKEN, SECRET, PASSWORD, ..._KEY) and TRANSOM_* settings")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    r.set_defaults(func=run_submit)

    c = sub.add_parser("cancel", help="cancel a job: stop its ranks and end it",
                       description="Ask the active controller to stop every rank of JOB and end it (state "
                                   "cancelled); waits for the controller to record it, printing the events.")
    add_bootstrap(c)
    c.add_argument("job", help="the job id")
    c.add_argument("--reason", default=None, help="recorded in the job's events (default: cancelled by USER)")
    c.set_defaults(func=run_cancel)

    n = sub.add_parser("nodes", help="list nodes with their health; cordon or uncordon one",
                       description="list (default): every node the active controller's backend knows, its health "
                                   "(the platform's and the agents' heartbeats), whether it is cordoned and why, and "
                                   "the job it runs. cordon NODE / uncordon NODE --reason TEXT: keep a node out of "
                                   "launches, or let it run ranks again (a node evicted for a fault stays cordoned "
                                   "until an operator uncordons it).")
    add_bootstrap(n)
    n.add_argument("action", nargs="?", choices=["list", "cordon", "uncordon"], default="list")
    n.add_argument("node", nargs="?", help="the node (cordon, uncordon)")
    n.add_argument("--reason", default=None, help="why (required for cordon and uncordon)")
    n.add_argument("--json", action="store_true", help="print the view as JSON")
    n.set_defaults(func=run_nodes)

    j = sub.add_parser("jobs", help="list jobs, or show one job's timeline",
                       description="Every job and its state, from each job's newest snapshot on transom.lifecycle; "
                                   "`transom jobs show ID` prints the job's timeline with causes, from "
                                   "transom.history (kept when the broker compacts the lifecycle).")
    add_bootstrap(j)
    j.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    j.add_argument("job", nargs="?", help="the job id (for show)")
    j.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    j.set_defaults(func=run_jobs)


def _make_backend(args: argparse.Namespace, bootstrap: str, nodes: dict[str, str]):
    import importlib

    from .backend import create_backend

    importlib.import_module(f"transom.controller.{args.backend}")     # registers the backend
    if args.backend == "local":
        return create_backend("local", run_dir=args.run_dir, agents=nodes, ckpt_dir=args.ckpt_dir,
                              bootstrap=bootstrap, warm=args.warm_ranks)
    if args.backend == "hosts":
        from .hosts import discover_launchers
        return create_backend("hosts", run_dir=args.run_dir, launchers=dict(args.launcher), ckpt_dir=args.ckpt_dir,
                              bootstrap=bootstrap, unreachable_s=args.unreachable,
                              discover=discover_launchers(bootstrap))
    if args.backend == "kubernetes":
        return create_backend("kubernetes", namespace=args.k8s_namespace, image=args.k8s_image,
                              kubeconfig=args.kubeconfig, api_url=args.k8s_api, bootstrap=bootstrap,
                              ckpt_dir=args.ckpt_dir, agents=nodes, gpus=args.k8s_gpus,
                              ckpt_pvc=args.k8s_ckpt_pvc, ckpt_runtime=args.k8s_ckpt_runtime,
                              agent_port=args.k8s_agent_port)
    return create_backend("slurm", run_dir=args.run_dir, partition=args.slurm_partition, bootstrap=bootstrap,
                          ckpt_dir=args.ckpt_dir, agents=nodes)


def run(args: argparse.Namespace) -> int:
    from transom.broker import bootstrap_or_embedded

    from .health import HealthBook
    from .lease import Lease
    from .service import Controller, PrecheckConfig

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.job_id and not command:
        raise SystemExit("transom controller: error: --job-id needs the training command after --")
    nodes = dict(args.node)
    if args.backend == "local" and any(not addr for addr in nodes.values()):
        raise SystemExit("transom controller: error: --backend local needs --node NAME=HOST:PORT (the agent address)")
    with bootstrap_or_embedded(args.bootstrap, args.embedded_broker) as bootstrap:
        backend = _make_backend(args, bootstrap, nodes)
        precheck = PrecheckConfig(metrics=args.precheck != "off", collective=args.precheck == "full")
        ctl = Controller(bootstrap, backend, precheck=precheck, poll_interval=args.poll_interval,
                         health=HealthBook(stale_s=args.heartbeat_stale, require_gpus=not args.allow_no_gpus),
                         lease=Lease(bootstrap, duration_s=args.lease, renew_s=max(args.lease / 3, 0.2)))
        signal.signal(signal.SIGTERM, lambda *_: ctl.stop())
        signal.signal(signal.SIGINT, lambda *_: ctl.stop())
        if args.job_id:
            names = tuple(nodes) or tuple(backend.nodes())
            world = args.world_size or max(len(names) - 1, 1)
            ctl.submit(args.job_id, _spec(args, command, world), names)
        return ctl.run(exit_when_done=args.exit_when_done)


def run_submit(args: argparse.Namespace) -> int:
    from transom import contracts

    from .service import request_key
    from transom.kafka import ensure_topics, make_producer, publish

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("transom run: error: give the training command after --")
    need_bootstrap(args.bootstrap)
    holder = _controller_or_exit(args.bootstrap, "run", args.wait_controller)
    job_id = args.job_id or f"job-{int(time.time())}"
    from dataclasses import replace
    spec = replace(_spec(args, command, args.nodes), workdir=os.getcwd(),
                   env=submitter_env(dict(os.environ), not args.no_inherit_env, args.env))
    ensure_topics(args.bootstrap)
    producer = make_producer(args.bootstrap)
    ev = contracts.LifecycleEvent(job=job_id, seq=-1, ts=time.time(), name="submit_requested", state="pending",
                                  detail={"spec": spec.to_dict(), "spares": args.spares})
    publish(producer, contracts.LIFECYCLE, request_key(job_id), ev)
    publish(producer, contracts.HISTORY, job_id, ev)
    if producer.flush(30):
        raise SystemExit("transom run: error: could not write the submission to the broker")
    print(job_id, flush=True)
    print(f"submitted to controller {holder}; `transom jobs show {job_id}` for its timeline", file=sys.stderr)
    if not args.follow:
        return 0
    return _follow(args.bootstrap, job_id)


def _controller_or_exit(bootstrap: str, command: str, wait_s: float = 0.0) -> str:
    from .lease import current_holder

    deadline = time.monotonic() + wait_s
    while (got := current_holder(bootstrap)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if got is None:
        raise SystemExit(f"transom {command}: error: no controller holds the lease on {bootstrap} (start "
                         "`transom controller`, or `transom up` for a whole stack); nothing was submitted")
    return got[0]


def _follow(bootstrap: str, job_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled")) -> int:
    """Print the job's lifecycle events (from its first) until one of ``until``; 0 completed/cancelled, 1 failed."""
    from transom import contracts
    from transom.stack import Monitor

    monitor = Monitor(bootstrap, (contracts.LIFECYCLE,))
    try:
        while True:
            got = monitor.poll(0.5)
            if got and got[1].job == job_id and got[1].seq >= 0:
                e = got[1]
                print(_line(e), flush=True)
                if e.name in until:
                    return 1 if e.name == "failed" else 0
    finally:
        monitor.close()


def run_cancel(args: argparse.Namespace) -> int:
    from transom import contracts

    from .service import request_key
    from transom.kafka import make_producer, publish

    need_bootstrap(args.bootstrap)
    _controller_or_exit(args.bootstrap, "cancel")
    known = {e.job: e for e in _lifecycle_events(args.bootstrap)}
    if args.job not in known:
        print(f"transom cancel: error: no job {args.job!r} in {contracts.LIFECYCLE}", file=sys.stderr)
        return 1
    if known[args.job].state in ("completed", "failed", "cancelled"):
        print(f"transom cancel: job {args.job} has already ended ({known[args.job].state})", file=sys.stderr)
        return 0
    producer = make_producer(args.bootstrap)
    reason = args.reason or f"cancelled by {os.environ.get('USER') or os.getuid()}"
    request = contracts.LifecycleEvent(job=args.job, seq=-1, ts=time.time(), name="cancel_requested", state="pending",
                                       detail={"reason": reason})
    publish(producer, contracts.LIFECYCLE, request_key(args.job), request)
    publish(producer, contracts.HISTORY, args.job, request)
    if producer.flush(30):
        raise SystemExit("transom cancel: error: could not write the request to the broker")
    from transom.stack import Monitor

    monitor = Monitor(args.bootstrap, (contracts.LIFECYCLE,))
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            got = monitor.poll(0.5)
            if got and got[1].job == args.job and got[1].name in ("cancelled", "completed", "failed") \
                    and got[1].seq >= 0:
                print(_line(got[1]), flush=True)
                return 0
    finally:
        monitor.close()
    print(f"transom cancel: error: the controller did not record the cancellation of {args.job} within 30s",
          file=sys.stderr)
    return 1


def _line(e) -> str:
    step = e.snapshot.get("step") if e.snapshot else None
    keep = {k: v for k, v in e.detail.items() if k not in ("command", "spec", "pids")}
    cause = f" cause={json.dumps(dict(e.cause))}" if e.cause else ""
    when = time.strftime("%H:%M:%S", time.localtime(e.ts)) + f".{int(e.ts % 1 * 1000):03d}"
    return (f"{when} {e.seq:4d} {e.name:<16} {e.state + ('/' + step if step else ''):<24} "
            f"{json.dumps(keep, separators=(',', ':'))}{cause}")


def _lifecycle_events(bootstrap: str, topic: str | None = None) -> list:
    """Every job's lifecycle events on ``topic`` (default the compacted lifecycle: each job's newest
    snapshot at least; transom.history: every event), in log order, lease and node records left out."""
    from transom import contracts
    from transom.kafka import read_topic

    events = []
    for key, value, _p, _o in read_topic(bootstrap, topic or contracts.LIFECYCLE):
        if key is None or key.startswith(b"__"):
            continue
        try:
            events.append(contracts.decode(contracts.LIFECYCLE, value))
        except contracts.ContractError:
            continue
    return events


def run_jobs(args: argparse.Namespace) -> int:
    from transom import contracts

    from .service import job_of
    from .state import Job

    need_bootstrap(args.bootstrap)
    if args.action == "show":
        if not args.job:
            raise SystemExit("transom jobs show: error: give the job id")
        mine = [e for e in _lifecycle_events(args.bootstrap, contracts.HISTORY) if e.job == args.job]
        if not mine:
            print(f"transom jobs show: no job {args.job!r} in {contracts.HISTORY}", file=sys.stderr)
            return 1
        for e in mine:
            print(json.dumps(contracts._plain(e)) if args.json else _line(e))
        return 0
    jobs: dict[str, Job] = {}
    for e in _lifecycle_events(args.bootstrap):          # the compacted topic: each job's newest snapshot
        if e.snapshot:
            job = job_of(e)
            if job is not None:
                jobs[e.job] = job
    if not args.json:
        print(f"{'JOB':<20} {'STATE':<24} {'GEN':>3} {'RESTARTS':>8}  NODES / REASON")
    for job in sorted(jobs.values(), key=lambda j: (j.submitted_ts, j.job)):   # not log order: compaction moves it
        if args.json:
            print(json.dumps(job.to_dict()))
            continue
        state = job.state.value + (f"/{job.step.value}" if job.step else "")
        print(f"{job.job:<20} {state:<24} {job.generation:>3} {job.restarts:>8}  "
              f"{','.join(job.nodes)}{'  ' + job.failure if job.failure else ''}")
    return 0


def _node_view(bootstrap: str):
    """The newest node view a controller published (a LifecycleEvent), or None."""
    from transom import contracts
    from transom.kafka import read_topic

    from .service import NODES_KEY

    newest = None
    for key, value, _p, _o in read_topic(bootstrap, contracts.LIFECYCLE):
        if key == NODES_KEY.encode():
            try:
                ev = contracts.decode(contracts.LIFECYCLE, value)
            except contracts.ContractError:
                continue
            if ev.name == "nodes":
                newest = ev
    return newest


def run_nodes(args: argparse.Namespace) -> int:
    from transom import contracts
    from transom.kafka import make_producer, publish

    from .service import NODES_KEY

    need_bootstrap(args.bootstrap)
    if args.action != "list":
        if not args.node or not args.reason:
            raise SystemExit(f"transom nodes {args.action}: error: give the node and --reason TEXT")
        _controller_or_exit(args.bootstrap, f"nodes {args.action}")
        asked = time.time()
        producer = make_producer(args.bootstrap)
        publish(producer, contracts.LIFECYCLE, NODES_KEY, contracts.LifecycleEvent(
            job=NODES_KEY, seq=-1, ts=asked, name=f"{args.action}_requested", state="pending",
            detail={"node": args.node, "reason": args.reason}))
        if producer.flush(30):
            raise SystemExit(f"transom nodes {args.action}: error: could not write the request to the broker")
        deadline = time.monotonic() + 30
        while True:
            view = _node_view(args.bootstrap)
            # the view that carried out this request: a periodic view published after it was asked, but before
            # the controller read it, does not have it yet (a controller without "answered": any newer view)
            if view is not None and view.ts >= asked and view.detail.get("answered", asked) >= asked:
                break
            if time.monotonic() > deadline:
                print(f"transom nodes {args.action}: error: the controller did not answer within 30s", file=sys.stderr)
                return 1
            time.sleep(0.3)
        if view.detail.get("error"):
            print(f"transom nodes {args.action}: error: {view.detail['error']}", file=sys.stderr)
            return 1
        if args.node not in view.detail.get("nodes", {}):
            print(f"transom nodes {args.action}: error: no node {args.node!r} (known: "
                  f"{', '.join(view.detail.get('nodes', {})) or 'none'})", file=sys.stderr)
            return 1
    else:
        view = _node_view(args.bootstrap)
        if view is None:
            print(f"transom nodes: error: no controller has published its node view on {args.bootstrap} "
                  "(is `transom controller` running?)", file=sys.stderr)
            return 1
    nodes = view.detail.get("nodes", {})
    if args.json:
        print(json.dumps(nodes))
        return 0
    print(f"{'NODE':<16} {'HEALTH':<40} {'CORDONED':<30} JOB")
    for name, info in nodes.items():
        job = info.get("job") or (f"spare for {info['spare_for']}" if info.get("spare_for") else "-")
        print(f"{name:<16} {str(info.get('health'))[:40]:<40} {str(info.get('cordoned') or '-')[:30]:<30} {job}")
    return 0
