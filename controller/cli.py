"""``transom controller`` (run the controller), ``transom run`` (submit a job), ``transom jobs`` (list, show)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from transom.cli import add_bootstrap

__all__ = ["register"]


def _node(text: str) -> tuple[str, str]:
    name, sep, addr = text.partition("=")
    if not name or (sep and ":" not in addr):
        raise argparse.ArgumentTypeError(f"--node {text!r}: expected NAME=HOST:PORT (the node's agent intake), "
                                         "or NAME alone for the kubernetes and slurm backends")
    return name, addr


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-restarts", type=int, default=5, help="relaunches allowed per --restart-window (default 5)")
    p.add_argument("--restart-window", type=float, default=3600.0, metavar="S",
                   help="seconds over which --max-restarts counts (default 3600)")
    p.add_argument("--backoff", type=float, default=0.0, metavar="S",
                   help="delay before the 2nd relaunch within the window, doubling after (default 0)")
    p.add_argument("--min-world-size", type=int, default=0,
                   help="shrink down to this many ranks when no spare is left (default 0: never shrink)")


def _spec(args: argparse.Namespace, command: list[str], world: int):
    from .state import JobSpec
    return JobSpec(tuple(command), world, max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                   backoff_s=args.backoff, min_world_size=args.min_world_size)


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
    add_bootstrap(p)
    p.add_argument("--backend", default="local", choices=["local", "kubernetes", "slurm"],
                   help="where ranks run (default: local)")
    p.add_argument("--run-dir", default=os.environ.get("TRANSOM_RUN_DIR", "runs"),
                   help="directory for rank logs and launch records (default: runs; env TRANSOM_RUN_DIR)")
    p.add_argument("--ckpt-dir", default=os.environ.get("TRANSOM_CKPT_DIR"),
                   help="checkpoint directory handed to the ranks (default: RUN_DIR/JOB/ckpt)")
    p.add_argument("--node", type=_node, action="append", default=[], metavar="NAME=HOST:PORT",
                   help="a node and its agent's intake address, in order; the first WORLD_SIZE run the job, "
                        "the rest are spares (repeat); kubernetes and slurm: default all schedulable nodes")
    p.add_argument("--job-id", help="submit this job")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the submitted job (default: all but one node)")
    _policy_args(p)
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
    p.add_argument("--exit-when-done", action="store_true", help="exit once the submitted job (without --job-id: every job) has completed or failed; "
                        "exit status 0 completed, 1 failed, 3 lease lost")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command of the submitted job")
    p.set_defaults(func=run)

    r = sub.add_parser("run", help="submit a job to the running controller",
                       description="Submit a job: the active controller picks NODES schedulable nodes (and SPARES "
                                   "more as spares), pre-checks them and launches the command, one rank per node.",
                       epilog="example: transom run --nodes 4 --spares 1 --job-id lm -- python -m "
                              "transom.examples.train_lm --steps 300")
    add_bootstrap(r)
    r.add_argument("--nodes", type=_positive, required=True, help="ranks, one per node")
    r.add_argument("--spares", type=int, default=0, help="spare nodes kept for the job (default 0)")
    r.add_argument("--job-id", default=None, help="job id (default: a new one)")
    _policy_args(r)
    r.add_argument("--follow", action="store_true", help="print the job's lifecycle until it ends")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    r.set_defaults(func=run_submit)

    j = sub.add_parser("jobs", help="list jobs, or show one job's timeline",
                       description="Rebuilt from transom.lifecycle: every job and its state; "
                                   "`transom jobs show ID` prints the job's timeline with causes.")
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
    with bootstrap_or_embedded(args.bootstrap) as bootstrap:
        backend = _make_backend(args, bootstrap, nodes)
        precheck = PrecheckConfig(metrics=args.precheck != "off", collective=args.precheck == "full")
        ctl = Controller(bootstrap, backend, precheck=precheck,
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
    from transom.kafka import ensure_topics, make_producer, publish

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("transom run: error: give the training command after --")
    if not args.bootstrap:
        raise SystemExit("transom run: error: give --bootstrap HOST:PORT (or TRANSOM_BOOTSTRAP): the controller's Kafka")
    job_id = args.job_id or f"job-{int(time.time())}"
    spec = _spec(args, command, args.nodes)
    ensure_topics(args.bootstrap)
    producer = make_producer(args.bootstrap)
    ev = contracts.LifecycleEvent(job=job_id, seq=-1, ts=time.time(), name="submit_requested", state="pending",
                                  detail={"spec": spec.to_dict(), "spares": args.spares})
    publish(producer, contracts.LIFECYCLE, job_id, ev)
    if producer.flush(30):
        raise SystemExit("transom run: error: could not write the submission to the broker")
    print(job_id, flush=True)
    if not args.follow:
        return 0
    from transom.stack import Monitor
    monitor = Monitor(args.bootstrap, (contracts.LIFECYCLE,))
    try:
        while True:
            got = monitor.poll(0.5)
            if got and got[1].job == job_id and got[1].seq >= 0:
                e = got[1]
                print(_line(e), flush=True)
                if e.name in ("completed", "failed"):
                    return 0 if e.name == "completed" else 1
    finally:
        monitor.close()


def _line(e) -> str:
    step = e.snapshot.get("step") if e.snapshot else None
    keep = {k: v for k, v in e.detail.items() if k not in ("command", "spec", "pids")}
    cause = f" cause={json.dumps(dict(e.cause))}" if e.cause else ""
    when = time.strftime("%H:%M:%S", time.localtime(e.ts)) + f".{int(e.ts % 1 * 1000):03d}"
    return (f"{when} {e.seq:4d} {e.name:<16} {e.state + ('/' + step if step else ''):<24} "
            f"{json.dumps(keep, separators=(',', ':'))}{cause}")


def run_jobs(args: argparse.Namespace) -> int:
    from transom import contracts
    from transom.kafka import read_topic

    from .lease import LEASE_KEY
    from .state import Job

    if not args.bootstrap:
        raise SystemExit("transom jobs: error: give --bootstrap HOST:PORT (or TRANSOM_BOOTSTRAP)")
    events = []
    for key, value, _p, _o in read_topic(args.bootstrap, contracts.LIFECYCLE):
        if key == LEASE_KEY.encode():
            continue
        try:
            events.append(contracts.decode(contracts.LIFECYCLE, value))
        except contracts.ContractError:
            continue
    if args.action == "show":
        if not args.job:
            raise SystemExit("transom jobs show: error: give the job id")
        mine = [e for e in events if e.job == args.job]
        if not mine:
            print(f"transom jobs show: no job {args.job!r} in {contracts.LIFECYCLE}", file=sys.stderr)
            return 1
        for e in mine:
            print(json.dumps(contracts._plain(e)) if args.json else _line(e))
        return 0
    jobs: dict[str, Job] = {}
    for e in events:
        if e.snapshot:
            jobs[e.job] = Job.from_dict(e.snapshot)
    if not args.json:
        print(f"{'JOB':<20} {'STATE':<24} {'GEN':>3} {'RESTARTS':>8}  NODES / REASON")
    for job in jobs.values():
        if args.json:
            print(json.dumps(job.to_dict()))
            continue
        state = job.state.value + (f"/{job.step.value}" if job.step else "")
        print(f"{job.job:<20} {state:<24} {job.generation:>3} {job.restarts:>8}  "
              f"{','.join(job.nodes)}{'  ' + job.failure if job.failure else ''}")
    return 0
