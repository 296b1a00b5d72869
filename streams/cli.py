"""The ``transom tee`` command: run one TEE worker (Faust) against Kafka."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def register(sub) -> None:
    from transom.cli import add_bootstrap

    p = sub.add_parser(
        "tee", help="run the TEE fault detectors (a Faust worker) over transom.metrics",
        description=("Run one TEE worker: read transom.metrics, apply the fault rules (XID, double-bit ECC, "
                     "row-remap failure, GPU lost, link down and flapping, NaN loss, hang, missing heartbeat) "
                     "and the soft-fault detectors (per-window pyod over each GPU's own history and the job's "
                     "peers), and write fault events with evidence to transom.faults; malformed metrics go to "
                     "transom.deadletter. Several workers share the partitions (consumer group transom-tee). "
                     "Stops on SIGINT/SIGTERM. See docs/tee.md."))
    add_bootstrap(p, embedded=True)
    p.add_argument("--hang-timeout", type=_positive, default=None, metavar="S",
                   help="seconds without step progress (sample time) before a live rank is hung; "
                        "at least 5 median step times are allowed anyway (default 10)")
    p.add_argument("--heartbeat-timeout", type=_positive, default=None, metavar="S",
                   help="seconds without metrics from a node before it is lost (default 6)")
    p.add_argument("--node-lost-fast", type=_positive, default=None, metavar="S",
                   help="seconds without metrics from a node before it is lost when its job stopped as it "
                        "fell silent and the job's other ranks spin their GPUs, waiting for it (default 2; "
                        "the node's partition must be read that far past its newest batch, so a node alone "
                        "on its partition waits for --heartbeat-timeout)")
    p.add_argument("--soft-detector", default=None, choices=("ecod", "copod", "iforest", "hbos", "lof", "combo"),
                   help="pyod model of the soft-fault detector (default ecod)")
    p.add_argument("--cooldown", type=_positive, default=None, metavar="S",
                   help="repeats of a fault class on the same node and device within S seconds are merged "
                        "(default 300)")
    p.add_argument("--clock", default=None, choices=("wall", "event"),
                   help="wall: the host's clock (live metrics, the default); event: the clock follows the "
                        "sample times read, to replay recorded metrics faster than real time")
    p.add_argument("--datadir", default=None, metavar="DIR",
                   help="Faust's data directory (default: a temporary directory, removed on exit)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from transom.broker import bootstrap_or_embedded

    from .app import run_worker
    from .config import TEEConfig

    config = TEEConfig.from_mapping({"hang_timeout": args.hang_timeout,
                                     "heartbeat_timeout": args.heartbeat_timeout,
                                     "node_lost_fast_s": args.node_lost_fast,
                                     "soft_detector": args.soft_detector, "cooldown_s": args.cooldown,
                                     "clock": args.clock})
    with bootstrap_or_embedded(args.bootstrap, args.embedded_broker) as bootstrap:
        return run_worker(bootstrap, config, datadir=args.datadir)
