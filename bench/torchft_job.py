"""bench/goodput.py's TorchFT job: one replica group of the example LM under a TorchFT ``Manager``.

The same model (``--width``, ``--layers``, ``--heads``), data (``--seed``, the group's own data
stream), batch, optimizer, warm-up and clipping as ``transom.examples.train_lm`` (its
``train_step`` is not reused: gradients go through ``manager.allreduce`` on one flattened tensor,
the workaround of torchft 0.2.0's DDP comm-hook bug, see ../shared/notes/torchft-here.md). One
process is one replica group of one rank (``REPLICA_GROUP_ID``); it starts the group's TCPStore
itself (torchrun would). Timeouts as TorchFT's own train_ddp.py example: ``ProcessGroupGloo``
5 s, Manager 10 s. No checkpoint to disk: a restarted group heals from a live peer (no rollback).
The process appends ``step replica epoch_seconds`` to ``--steps-file`` after every committed step
and honours the bench's ``--slowdown-dir`` hook (node name ``slot<REPLICA_GROUP_ID>``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

from transom.examples.train_lm import TemplateText, TinyLM, slowdown

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/torchft_job.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--steps-file", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout, s (default 5, "
                                                                  "as TorchFT's train_ddp.py)")
    p.add_argument("--manager-timeout", type=float, default=10.0, help="Manager timeout, s (default 10)")
    p.add_argument("--slowdown-dir", default=None)
    p.add_argument("--ready-dir", default=None, help="first launch: wait until every group has a file here, so "
                                                     "the first quorum has them all (min_replicas is 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # denormal floats (weights, gradients and Adam's moments drift into them as training goes) take
    # the CPU's slow path: steps here grew 45 % over the first 150; GPUs flush them, so do we
    torch.set_flush_denormal(True)
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer
    from torchft.process_group import ProcessGroupGloo

    group = int(os.environ["REPLICA_GROUP_ID"])
    os.environ["TRANSOM_NODE"] = f"slot{group}"    # the slowdown hook's slot name
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 1, True,
                     timeout=timedelta(seconds=30))
    torch.manual_seed(args.seed)
    model = TinyLM(args.seq_len, d_model=args.width, n_heads=args.heads, n_layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    data = TemplateText(args.seed, group)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
                      load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
                      timeout=timedelta(seconds=args.manager_timeout), rank=0, world_size=1,
                      store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                      replica_id=f"group{group}")
    if args.ready_dir:
        groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
        open(os.path.join(args.ready_dir, f"group-{group}"), "w").close()
        while len([f for f in os.listdir(args.ready_dir) if f.startswith("group-")]) < groups:
            time.sleep(0.1)
    ft_opt = Optimizer(manager, opt)
    loss_fn = nn.CrossEntropyLoss()
    params = [q for q in model.parameters()]
    out = open(args.steps_file, "a")
    warmup = 20
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        ft_opt.zero_grad(set_to_none=True)          # starts the quorum (and heals a new group)
        step = manager.current_step()
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / warmup)
        batch = data.batch(args.batch_size, args.seq_len)
        logits = model(batch[:, :-1])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in params])
        manager.allreduce(flat).wait()
        off = 0
        for q in params:
            n = q.numel()
            q.grad = flat[off:off + n].view_as(q).clone()
            off += n
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if args.slowdown_dir:
            slowdown(args.slowdown_dir, time.perf_counter() - t0)
        ft_opt.step()
        if manager.current_step() > step:
            out.write(f"{manager.current_step()} {group} {time.time():.6f}\n")
            out.flush()
    manager.shutdown(wait=False)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
