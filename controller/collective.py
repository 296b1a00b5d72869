"""The pre-check's collective test: one tiny gloo all-reduce across the chosen nodes.

``python -m transom.controller.collective --rank R --world N --master HOST:PORT`` joins a gloo
group of N processes (one per node), all-reduces a small tensor of ones and checks that every
element is N. Exit 0: passed; 1: the sum was wrong; 2: the group did not form or the
all-reduce failed within ``--timeout`` seconds (the reason on stderr).

Importing torch is most of the test's cost: the local backend runs :func:`run_once` in forks of
its zygote (:mod:`.zygote`) instead, and this command only when warm starts are off.
"""

from __future__ import annotations

import argparse
import datetime
import sys

__all__ = ["main"]


def run_once(rank: int, world: int, master: str, timeout: float) -> tuple[int, str]:
    """(0, "") when the all-reduce gave the right sum; else (1 or 2, the reason)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        t = torch.ones(256)
        dist.all_reduce(t)
    except Exception as exc:   # the reason goes to the controller
        return 2, f"collective test rank {rank}: {type(exc).__name__}: {exc}".replace("\n", " ")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not bool((t == world).all()):
        return 1, f"collective test rank {rank}: all-reduce gave {t[0].item()}, expected {world}"
    return 0, ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transom.controller.collective",
                                description="pre-check: a tiny gloo all-reduce across the chosen nodes")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--master", metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds for forming the group and the all-reduce")
    args = p.parse_args(argv)
    if args.rank is None or args.world is None or not args.master:
        p.error("give --rank, --world and --master")
    code, why = run_once(args.rank, args.world, args.master, args.timeout)
    if why:
        print(why, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
