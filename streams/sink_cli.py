"""The ``transom sink`` command: write Transom's topics into InfluxDB (a Faust worker)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def register(sub) -> None:
    from transom.cli import add_bootstrap

    p = sub.add_parser(
        "sink", help="write metrics, faults, lifecycle and checkpoint events into InfluxDB",
        description=("Run one InfluxDB sink worker (Faust, consumer group transom-sink): read transom.metrics, "
                     "transom.faults, transom.lifecycle and transom.checkpoints and write them to InfluxDB in "
                     "batches (gauges as floats; faults and lifecycle events also as annotation points). The "
                     "write path follows the server's version: the v2 API for InfluxDB 2.x, 3.x and 1.8+, "
                     "the v1 /write API for older 1.x. Malformed events go to transom.deadletter. Stops on "
                     "SIGINT/SIGTERM. Every flag has an environment variable (shown in brackets)."))
    add_bootstrap(p, embedded=True)
    p.add_argument("--influx-url", default=None, metavar="URL",
                   help="InfluxDB URL, e.g. http://127.0.0.1:8086 [TRANSOM_INFLUX_URL]")
    p.add_argument("--influx-db", default=None, metavar="NAME",
                   help="database (1.x) or bucket (2.x/3.x) (default transom) [TRANSOM_INFLUX_DB]")
    p.add_argument("--influx-org", default=None, metavar="ORG",
                   help="organisation for 2.x/3.x (default '-') [TRANSOM_INFLUX_ORG]")
    p.add_argument("--influx-api", choices=("auto", "v1", "v2"), default=None,
                   help="write path; auto (default) chooses from the server's version [TRANSOM_INFLUX_API]")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="most events per write (default 1000) [TRANSOM_SINK_BATCH]")
    p.add_argument("--flush", type=float, default=None, metavar="S",
                   help="longest wait before a partial batch is written (default 1) [TRANSOM_SINK_FLUSH_S]")
    p.add_argument("--datadir", default=None, metavar="DIR",
                   help="Faust's data directory (default: a temporary directory, removed on exit)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from transom.broker import bootstrap_or_embedded

    from .sink import SinkConfig, SinkError
    from .sink_app import run_sink

    # token, user and password come from the environment only (TRANSOM_INFLUX_TOKEN/USER/PASSWORD):
    # a flag would show them in the process list
    config = SinkConfig.from_env(url=args.influx_url, database=args.influx_db, org=args.influx_org,
                                 api=args.influx_api, batch_size=args.batch, flush_s=args.flush)
    with bootstrap_or_embedded(args.bootstrap, args.embedded_broker) as bootstrap:
        try:
            return run_sink(bootstrap, config, datadir=args.datadir)
        except SinkError as exc:     # the server never answered, or refused the database
            print(f"transom sink: error: {exc} (check --influx-url / TRANSOM_INFLUX_URL)", file=sys.stderr)
            return 2
