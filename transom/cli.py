"""The ``transom`` command: one entry point, a subcommand per service.

Each component registers its own subcommands through a ``register(subparsers)`` function in its
``cli`` module; heavy imports (torch, faust) happen inside the command, not here, so ``--help``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from . import __version__, log

__all__ = ["main", "add_bootstrap", "need_bootstrap", "wait_for_signal"]

_COMPONENT_CLIS = (
    "transom.broker_cli",
    "transom.agents.cli",
    "transom.streams.cli",
    "transom.controller.cli",
    "transom.controller.launcher",
    "transom.checkpoint.cli",
    "transom.streams.sink_cli",
    "transom.report",
    "transom.demo",
    "transom.testbed",
    "transom.up",
)


def add_bootstrap(parser: argparse.ArgumentParser, *, embedded: bool = False) -> None:
    """--bootstrap (required: a command never starts a private broker unless asked); with ``embedded``,
    also --embedded-broker for services that can run on a broker of their own."""
    parser.add_argument(
        "--bootstrap", default=os.environ.get("TRANSOM_BOOTSTRAP") or None, metavar="HOST:PORT",
        help="Kafka bootstrap servers (env TRANSOM_BOOTSTRAP; required" +
             (" unless --embedded-broker)" if embedded else ")") + "; an unreachable broker is an error within 4 s",
    )
    if embedded:
        parser.add_argument("--embedded-broker", action="store_true",
                            help="start a private embedded broker when no --bootstrap is given "
                                 "(other components will not see it)")


def need_bootstrap(bootstrap: str | None) -> str:
    """The broker at ``bootstrap`` once it answers (within 4 s); else the one-line error."""
    from .broker import NO_BOOTSTRAP
    from .kafka import PROBE_S, BrokerUnavailable, wait_ready

    if not bootstrap:
        raise BrokerUnavailable(NO_BOOTSTRAP)
    wait_ready(bootstrap, PROBE_S)
    return bootstrap


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; return the signal number."""
    got: list[int] = []
    done = threading.Event()

    def handler(signum, _frame):
        got.append(signum)
        done.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not done.wait(0.5):
        pass
    return got[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transom", description="Transom keeps large training jobs running through faults.")
    parser.add_argument("--version", action="version", version=f"transom {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING; env TRANSOM_LOG_LEVEL")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")   # not "command": that is a job's argv
    sub.required = True
    for name in _COMPONENT_CLIS:
        importlib.import_module(name).register(sub)
    return parser


#: long-running services that share a machine with ranks: run at TRANSOM_SERVICE_PRIORITY (transom/priority.py).
#: Not the launcher, nor the controller with its embedded local backend: the ranks they start inherit it.
SERVICES = ("broker", "agent", "tee", "ckpt-server", "sink", "controller")


def _service_priority(args: argparse.Namespace) -> None:
    if args.subcommand not in SERVICES:
        return
    if args.subcommand == "controller" and getattr(args, "backend", "local") == "local":
        return
    from .priority import lower_service

    lower_service(args.subcommand)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log.setup(args.log_level)
    try:
        _service_priority(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error instead of a traceback for known errors
        from .config import ConfigError
        from .kafka import BrokerUnavailable
        if isinstance(exc, (ConfigError, BrokerUnavailable)):
            print(f"transom {args.subcommand}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
