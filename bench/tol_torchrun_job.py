"""The torchrun baseline's job for bench/tol_recovery.py and bench/goodput.py: the example LM with synchronous torch.save.

Same model (``--width``, ``--layers``, ``--heads``), data (``--seed``), batch, optimizer, warm-up
and gradient clipping as ``transom.examples.train_lm`` (and its ``--slowdown-dir`` straggler hook, with
node name ``slot<RANK>``); rank 0 writes
``CKPT_DIR/step-N.pt`` with ``torch.save`` every ``--ckpt-every`` steps (the others wait at a
barrier: a synchronous checkpoint), or with ``--ckpt-every auto`` at Young's interval from the
measured cost of its saves and ``--mtbf`` (the same rule, :class:`transom.checkpoint.cadence.Cadence`,
as Transom's), and every rank resumes from the newest one. Rank 0 appends
``step generation epoch_seconds`` to ``--steps-file`` after every step (`` s``: a save follows), so
the bench can time the first step after a restart.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import os
import random
import re
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from transom.examples.train_lm import TemplateText, TinyLM, ckpt_every, slowdown, train_step

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/tol_torchrun_job.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--ckpt-every", type=ckpt_every, default="10", help="steps between saves, or auto (default 10)")
    p.add_argument("--mtbf", type=float, default=None, help="--ckpt-every auto: mean seconds between faults")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps-file", required=True)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=64, help="model width d_model (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init and the data (default 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate after warm-up (default 3e-3)")
    p.add_argument("--slowdown-dir", default=None, help="benchmark straggler hook, as train_lm's (default: off)")
    args = p.parse_args(argv)
    cadence = None
    if args.ckpt_every is None:
        from transom.checkpoint.cadence import DEFAULT_MTBF_S, Cadence, agree_max
        cadence = Cadence(args.mtbf or DEFAULT_MTBF_S)
    torch.set_num_threads(1)
    # denormal floats (weights, gradients and Adam's moments drift into them as training goes) take
    # the CPU's slow path: steps here grew 45 % over the first 150; GPUs flush them, so do we
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = TinyLM(args.seq_len, d_model=args.width, n_heads=args.heads, n_layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    data = TemplateText(args.seed, rank)
    step = 0
    saved = sorted(glob.glob(os.path.join(args.ckpt_dir, "step-*.pt")),
                   key=lambda f: int(re.search(r"step-(\d+)", f).group(1)))
    if saved:
        state = torch.load(saved[-1], weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        data.load_state_dict(state["data"][rank])
        step = state["step"]
        random.setstate(state["python_rng"])
    net = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    out = open(args.steps_file, "a") if rank == 0 else None
    while step < args.steps:
        t0 = time.perf_counter()
        train_step(net, model, opt, loss_fn, data, step, args)      # the very step train_lm takes
        if args.slowdown_dir:
            slowdown(args.slowdown_dir, time.perf_counter() - t0)
        step += 1
        if cadence is None:
            saving = bool(args.ckpt_every) and step % args.ckpt_every == 0
        else:                    # every rank alike, as Transom's ranks agree it
            cadence.tick(step, busy=False)
            saving = cadence.due(step, agree_max)
        if out:
            out.write(f"{step} {args.attempt} {time.time():.6f}{' s' if saving else ''}\n")
            out.flush()
        if saving:
            t_save = time.perf_counter()
            datas = [None] * world
            dist.all_gather_object(datas, data.state_dict())
            if rank == 0:
                tmp = os.path.join(args.ckpt_dir, f".step-{step}.pt")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "data": datas,
                            "step": step, "python_rng": random.getstate()}, tmp)
                os.replace(tmp, os.path.join(args.ckpt_dir, f"step-{step}.pt"))
            dist.barrier()
            if cadence is not None:
                cadence.saved(step, time.perf_counter() - t_save)
    del net                      # as train_lm: DDP keeps the group alive past destroy_process_group
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
