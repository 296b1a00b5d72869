"""``transom controller``: run the controller (TOL), optionally submitting one job."""

from __future__ import annotations

import argparse
import os
import signal

from transom.cli import add_bootstrap

__all__ = ["register"]


def _node(text: str) -> tuple[str, str]:
    name, sep, addr = text.partition("=")
    if not sep or not name or ":" not in addr:
        raise argparse.ArgumentTypeError(f"--node {text!r}: expected NAME=HOST:PORT (the node's agent intake)")
    return name, addr


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "controller", help="run the controller (TOL): heal jobs from fault events",
        description="Replay transom.lifecycle, then drive every job from fault, checkpoint and training "
                    "events. With --job-id and a command after --, submit that job (once: a restarted "
                    "controller finds it in the lifecycle and does not submit it again).",
        epilog="example: transom controller --node node0=127.0.0.1:7000 --node node1=127.0.0.1:7001 "
               "--job-id demo --world-size 1 -- python -m transom.examples.train_lm --steps 100")
    add_bootstrap(p)
    p.add_argument("--backend", default="local", choices=["local"], help="where ranks run (default: local)")
    p.add_argument("--run-dir", default=os.environ.get("TRANSOM_RUN_DIR", "runs"),
                   help="local backend: directory for rank logs and launch records (default: runs; env TRANSOM_RUN_DIR)")
    p.add_argument("--ckpt-dir", default=os.environ.get("TRANSOM_CKPT_DIR"),
                   help="checkpoint directory handed to the ranks (default: RUN_DIR/JOB/ckpt)")
    p.add_argument("--node", type=_node, action="append", default=[], metavar="NAME=HOST:PORT",
                   help="a node and its agent's intake address, in order; the first WORLD_SIZE run the job, "
                        "the rest are spares (repeat)")
    p.add_argument("--job-id", help="submit this job")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the submitted job (default: all but one node)")
    p.add_argument("--max-restarts", type=int, default=5, help="relaunches before the job is failed (default 5)")
    p.add_argument("--exit-when-done", action="store_true", help="exit once every job has completed or failed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command of the submitted job")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transom.broker import bootstrap_or_embedded

    from .local import LocalBackend
    from .service import Controller
    from .state import JobSpec

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.job_id and not command:
        raise SystemExit("transom controller: error: --job-id needs the training command after --")
    nodes = dict(args.node)
    with bootstrap_or_embedded(args.bootstrap) as bootstrap:
        backend = LocalBackend(args.run_dir, nodes, ckpt_dir=args.ckpt_dir, bootstrap=bootstrap)
        ctl = Controller(bootstrap, backend)
        signal.signal(signal.SIGTERM, lambda *_: ctl.stop())
        signal.signal(signal.SIGINT, lambda *_: ctl.stop())
        if args.job_id:
            world = args.world_size or max(len(nodes) - 1, 1)
            ctl.submit(args.job_id, JobSpec(tuple(command), world, args.max_restarts), tuple(nodes))
        return ctl.run(exit_when_done=args.exit_when_done)
