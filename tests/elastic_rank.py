"""A minimal rank of an elastic job for tests/test_elastic_exit.py: the public API of transom.elastic only.

Environment as Transom gives it (TRANSOM_JOB, TRANSOM_BOOTSTRAP, TRANSOM_NODE, TRANSOM_GENERATION,
TRANSOM_SPARE, RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). ``python elastic_rank.py STEPS STEP_S``: a
one-layer model, one all-reduce of its gradients per step, ``STEP_S`` seconds per step; it prints
``step N epoch E`` after each step and ``closed`` after ``group.close()``, then exits 0.
"""

from __future__ import annotations

import sys
import time

import torch

from transom.elastic import ElasticGroup, Replica


def main() -> int:
    steps, step_s = int(sys.argv[1]), float(sys.argv[2])
    group = ElasticGroup.from_env()
    assert group is not None, "no control channel"
    group.join()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    replica = Replica(model, torch.optim.SGD(model.parameters(), lr=0.01))
    if group.spare:
        group.sync(replica)

    def train_step() -> None:
        replica.optimizer.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        group.all_reduce_mean_([p.grad for p in model.parameters()])
        replica.optimizer.step()
        time.sleep(step_s)

    while replica.step < steps:
        group.step(train_step, replica)
        print(f"step {replica.step} epoch {group.epoch}", flush=True)
    group.close()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
