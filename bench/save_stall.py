"""bench/save_stall: what ``CheckpointEngine.save()`` blocks for on a busy host, against a plain copy.

A rank's ``save()`` in the default (``copy``) mode should block for the copy of its tensors into
the staging segment and nothing else, however busy the host: the node's TCE daemon runs at a low
CPU priority and may wait for a core, so a save that waits for the daemon's answers is held by it.
This bench starts the three ``transom ckpt-server`` daemons of bench/tce.py, a state of ``--mib``
MiB (4 MiB tensors), and ``--busy`` CPU-bound processes beside (the other ranks of a job sharing the
host's cores), then times ``--saves`` saves (each waited for, a short pause between them) and, under
the same load in the same run, a plain copy of the same bytes into warm memory, alternately.

Figure: the mean stall over the mean plain copy (target <= 1.5, the copy being the physical limit);
the stalls' median and max beside. Prints a table, then one JSON line.

    python bench/save_stall.py [--mib 40] [--busy 4] [--saves 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tce  # noqa: E402  (the daemons and the state of bench/tce.py)

from transom.checkpoint import CheckpointEngine  # noqa: E402

TARGET = 1.5


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=40, help="state size in MiB (default 40: a ~3M-parameter model "
                                                        "with AdamW, as bench/goodput's)")
    p.add_argument("--busy", type=int, default=4, help="CPU-bound processes beside the rank (default 4)")
    p.add_argument("--saves", type=int, default=20, help="timed saves (default 20)")
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="transom-bench-stall-", dir="/tmp"))
    daemons = tce.Daemons(root, "auto")
    busy: list[subprocess.Popen] = []
    try:
        state = tce.make_state(args.mib << 20, 4)
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        eng = CheckpointEngine(root / "ckpt", "stall", 0, 1, "node0", runtime=daemons.runtime, shared=False)
        eng.reserve(state)
        for step in range(1, 4):                      # the steady state: segments allocated and reused
            eng.save(step, state)
            eng.wait()
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        time.sleep(1.0)
        stalls, copies = [], []
        for i in range(args.saves):
            time.sleep(0.3)
            t0 = time.perf_counter()
            for k, v in state.items():
                dst[k].copy_(v)
            copies.append(time.perf_counter() - t0)
            time.sleep(0.3)
            t0 = time.perf_counter()
            eng.save(4 + i, state)
            stalls.append(time.perf_counter() - t0)
            eng.wait()
            if (i + 1) % 5 == 0:
                print(f"[{time.strftime('%H:%M:%S')}] {i + 1}/{args.saves} saves", file=sys.stderr, flush=True)
        eng.close()
    finally:
        for b in busy:
            b.kill()
            b.wait()
        daemons.close()
        shutil.rmtree(root, ignore_errors=True)
    stall, copy = statistics.mean(stalls), statistics.mean(copies)
    ratio = stall / copy
    print(f"state {args.mib} MiB, {args.busy} CPU-bound processes beside, {args.saves} saves")
    print(f"{'save() stall, mean s':<34}{stall:.4f}  (median {statistics.median(stalls):.4f}, max {max(stalls):.4f})")
    print(f"{'plain copy, mean s':<34}{copy:.4f}")
    print(f"{'stall / plain copy (<= 1.5)':<34}{ratio:.2f}{' ok' if ratio <= TARGET else ' X'}")
    print(json.dumps({"bench": "save_stall", "mib": args.mib, "busy": args.busy, "saves": args.saves,
                      "figures": {"stall_mean_s": round(stall, 5), "stall_median_s": round(statistics.median(stalls), 5),
                                  "stall_max_s": round(max(stalls), 5), "plain_copy_mean_s": round(copy, 5),
                                  "stall_vs_plain_copy": round(ratio, 3)},
                      "targets": {"stall_vs_plain_copy": f"<= {TARGET}"},
                      "met": {"stall_vs_plain_copy": ratio <= TARGET}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
