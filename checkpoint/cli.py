"""``transom ckpt``: inspect checkpoint directories written by the checkpoint engine.

``transom ckpt list --dir D [--verify]`` prints one line per step dir: complete steps (those
with manifest.json) and incomplete ones, flagged. With ``--verify`` every shard of a complete
step is checked against its sha256 and size; the exit status is 1 when one fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime

__all__ = ["register"]


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect checkpoints written by the checkpoint engine",
                          description="Inspect checkpoints written by the checkpoint engine (TCE).")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")
    ckpt_sub.required = True
    p = ckpt_sub.add_parser(
        "list", help="list complete and incomplete checkpoint steps of a directory",
        description="List the step dirs of a checkpoint directory: complete ones (manifest.json "
                    "present) and incomplete ones, flagged.")
    p.add_argument("--dir", default=os.environ.get("TRANSOM_CKPT_DIR") or None, metavar="DIR",
                   help="checkpoint directory (env TRANSOM_CKPT_DIR)")
    p.add_argument("--verify", action="store_true",
                   help="check every shard of complete steps against its size and sha256")
    p.set_defaults(func=_list)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _list(args: argparse.Namespace) -> int:
    from transom.config import ConfigError

    if not args.dir:
        raise ConfigError("no checkpoint directory: pass --dir or set TRANSOM_CKPT_DIR")
    if not os.path.isdir(args.dir):
        print(f"transom ckpt list: {args.dir}: no such directory", file=sys.stderr)
        return 1

    from transom import contracts
    from transom.checkpoint import layout, store
    from transom.checkpoint.errors import CorruptCheckpoint

    steps = layout.list_steps(args.dir)
    if not steps:
        print(f"no checkpoints in {args.dir}")
        return 0
    bad = 0
    print(f"{'STEP':>10}  {'STATUS':<10}  {'RANKS':>7}  {'SIZE':>10}  {'GEN':>4}  COMMITTED")
    for s in steps:
        world = s.world_size if s.world_size is not None else "?"
        status, when, notes = ("complete" if s.complete else "INCOMPLETE"), "-", []
        if s.complete:
            try:
                man = layout.read_manifest(s.path)
                when = datetime.fromtimestamp(man.ts).isoformat(timespec="seconds")
                ranks = f"{len(man.shards)}/{man.world_size}"
                if args.verify:
                    for shard in man.shards:
                        try:
                            store.verify_shard(s.path, shard)
                        except CorruptCheckpoint as exc:
                            notes.append(str(exc))
                    status = "CORRUPT" if notes else "verified"
            except (OSError, contracts.ContractError) as exc:
                status, ranks = "CORRUPT", f"?/{world}"
                notes.append(f"{s.path / layout.MANIFEST}: unreadable manifest: {exc}")
        else:
            ranks = f"{len(s.ranks)}/{world}"
        bad += bool(notes)
        gen = "-" if s.generation is None else s.generation
        print(f"{s.step:>10}  {status:<10}  {ranks:>7}  {_human(s.size):>10}  {gen:>4}  {when}")
        for note in notes:
            print(f"{'':>12}{note}")
    done = sum(s.complete for s in steps)
    print(f"{done} complete, {len(steps) - done} incomplete step(s) in {args.dir}")
    return 1 if bad else 0
