"""``transom testbed check|clean|up``: the test bed (transom/testbed.py) from the command line."""

from __future__ import annotations

import argparse
import sys

from .testbed import Bed, BedError, available, beds_in_use, clean_stale

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="a bed of namespaced hosts on this machine (check, clean, up)",
                       description="The test bed: hosts as Linux namespaces on a private bridge "
                                   "(198.18.N.0/24). See docs/testbed.md.")
    tsub = p.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    c = tsub.add_parser("check", help="say whether beds can be made here (exit 0) or why not (exit 1)",
                        description="Print 'ok: ...' and exit 0 when this machine can make beds, else "
                                    "'unavailable: REASON' and exit 1.")
    c.set_defaults(func=_cmd_check)
    c = tsub.add_parser("clean", help="remove beds left by dead owners (namespaces, links, processes)",
                        description="Remove every bed whose owner process is dead; beds in use are kept.")
    c.set_defaults(func=_cmd_clean)
    c = tsub.add_parser("up", help="bring up a bed and keep it until SIGINT/SIGTERM",
                        description="Bring up a bed, print its hosts with their addresses and how to "
                                    "enter them, and keep it until interrupted.")
    c.add_argument("hosts", nargs="*", default=None, metavar="HOST",
                   help="host names (default: node0..node{N-1} from --count)")
    c.add_argument("--count", "-n", type=int, default=3, help="number of hosts when no names are given (3)")
    c.add_argument("--share", action="append", default=[], metavar="PATH",
                   help="a path every host sees even under its private /tmp (repeatable)")
    c.set_defaults(func=_cmd_up)


def _cmd_check(args) -> int:
    ok, reason = available()
    print(reason if ok else f"unavailable: {reason}")
    return 0 if ok else 1


def _cmd_clean(args) -> int:
    ok, reason = available()
    if not ok:
        print(f"unavailable: {reason}")
        return 1
    cleaned = clean_stale()
    print(f"cleaned {len(cleaned)} stale bed(s){': ' + ', '.join(map(str, cleaned)) if cleaned else ''}")
    for n, state in beds_in_use().items():
        print(f"in use: bed {n} (198.18.{n}.0/24) of pid {state.get('owner', '?')}: "
              f"{' '.join(ns.split('-', 1)[1] for ns in state.get('netns', [])[1:])}")
    return 0


def _cmd_up(args) -> int:
    from .cli import wait_for_signal

    if args.count < 1:
        print("transom testbed up: --count: expected a number >= 1", file=sys.stderr)
        return 2
    hosts = args.hosts or args.count
    try:
        bed = Bed(hosts, share=args.share).up()
    except BedError as exc:
        print(f"transom testbed up: {exc}", file=sys.stderr)
        return 1
    with bed:
        print(f"bed {bed.index}: {bed.subnet}, this namespace is {bed.root_addr} on link {bed.link}", flush=True)
        for h in bed.hosts:
            print(f"  {h:<12} {bed.addr(h):<15} enter: nsenter -t {bed.init_pid(h)} -n -m -p -u -i", flush=True)
        wait_for_signal()
    return 0
