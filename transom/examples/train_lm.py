"""A tiny transformer language model trained with torch DDP (gloo, CPU): the job Transom keeps alive.

Run ``python -m transom.examples.train_lm --steps 300``. With RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (the launcher sets them) it joins a gloo process group of
WORLD_SIZE ranks; without them it runs alone.

Contract with the rest of Transom:

- resumes through :class:`transom.checkpoint.CheckpointEngine` from TRANSOM_RESUME_STEP when set
  (every rank must load that step, else all exit with status 3), otherwise from the newest
  complete step that every rank can load (ranks agree on it), otherwise from scratch;
- a checkpoint holds the model, the optimizer, the RNG states and the data stream's position, so
  a resumed run continues exactly as the uninterrupted run would have; data-parallel ranks hold the
  same model and optimizer, so only rank 0's shard has them (each rank's shard has its own data
  position and RNG) and every rank loads them from rank 0's shard, wherever its fastest copy is
  (``--no-dedup-replicas``: every rank saves everything);
- checks before the first step that this node's shared memory (/dev/shm, RAM, the daemon's
  budget) can hold its checkpoints, and exits 4 with the reason when it cannot;
- saves when the checkpoint engine's cadence says (``--ckpt-every auto``, the default: Young's
  interval from the measured cost of its saves, TRANSOM_CKPT_MTBF_S and the share of faults that
  relaunched the job rather than healed in it, agreed by the ranks at each save,
  :mod:`transom.checkpoint.cadence`) or every ``--ckpt-every K`` steps, and after the last one,
  and waits for that save to persist before exiting 0;
- reports nothing about checkpoints itself: the checkpoint engine sends each save's stall
  (``ckpt_stall_s``) and each restore's tier and time (``restore_tier``: 0 local memory, 1 peer
  memory, 2 local disk, 3 shared; ``restore_s``) as training events (``report_event``);
- reports every step to the node agent (``transom.agents.intake.report``) and prints, on rank 0,
  ``step 50/300 loss 2.87 tok/s 12345 gen 0`` every ``--log-every`` steps;
- with ``--slowdown-dir D`` (a benchmark hook, off by default): while the file ``D/<node>`` exists
  (node: TRANSOM_NODE, else ``slot<RANK>``) and holds ``f [S]`` (f a fraction in (0, 1)), each step
  spins on the CPU for S seconds, or without S for (1/f - 1) x its compute time: a straggling
  device (bench/goodput.py);
- under Transom it joins an elastic group (:mod:`transom.elastic`, ``--no-elastic`` to opt out): a
  rank failure is healed in the job (the survivors drop the broken group, join the new one the
  controller names and redo the step, keeping their model and optimizer; a warm spare, started with
  ``TRANSOM_SPARE=1``, waits at the join point, then takes the failed rank's place with the state of a
  survivor and its data position from the rank's newest checkpoint);
- with ``--steps-file F``, rank 0 appends ``step generation epoch_seconds`` to F after every step,
  and `` s`` on the line of a step it saved (bench/goodput.py times its runs from such files).

Model size: ``--width`` (d_model, default 64), ``--layers`` (2), ``--heads`` (4); the checkpoint
(model and AdamW's two moments, float32) is about 12 bytes per parameter.

Data: sentences from a small deterministic grammar, one stream per rank (seeded by ``--seed`` and
the rank), read as bytes (vocabulary 256), so the loss falls from about ln 256 = 5.5 to below 2.5
within a few hundred steps.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from transom import log as tlog
from transom.checkpoint import CheckpointEngine, CheckpointError, CorruptCheckpoint, NoCheckpoint
from transom.checkpoint.layout import complete_steps
from transom.checkpoint.planner import CapacityError, check_node, node_need
from transom.elastic import ENV_SPARE, ElasticGroup, Replica, SpareReleased

try:
    from transom.agents.intake import report
except ImportError:  # the agent package is optional for the example: reports are dropped
    def report(**_fields: Any) -> None:
        return None

__all__ = ["main", "LMReplica", "TinyLM", "TemplateText", "ckpt_every", "parse_args", "slowdown", "train_step"]

log = tlog.get("train")

EXIT_RESUME_FAILED = 3
EXIT_NO_CAPACITY = 4

# --------------------------------------------------------------------------- data

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird",
             "the teacher", "our neighbour", "the farmer", "a child"]
_VERBS = ["sees", "likes", "chases", "finds", "builds", "paints", "carries", "watches", "opens", "sells"]
_OBJECTS = ["the ball", "a red box", "the garden", "some bread", "the river", "a green door",
            "the letter", "an apple", "the map", "a blue kite"]
_TAILS = ["", " today", " at night", " again", " in the rain", " with care"]


class TemplateText:
    """An endless stream of grammar sentences as bytes; its position is part of the checkpoint."""

    def __init__(self, seed: int, rank: int) -> None:
        self.rng = random.Random(seed * 1_000_003 + rank)
        self.buffer = b""
        self.consumed = 0

    def _sentence(self) -> str:
        r = self.rng
        if r.random() < 0.15:
            start = r.randrange(1, 6)
            return "count " + " ".join(str(i) for i in range(start, start + 5)) + ". "
        s = f"{r.choice(_SUBJECTS)} {r.choice(_VERBS)} {r.choice(_OBJECTS)}{r.choice(_TAILS)}. "
        return s[0].upper() + s[1:]

    def take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self.buffer += self._sentence().encode()
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        self.consumed += n
        return out

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        rows = [list(self.take(seq_len + 1)) for _ in range(batch_size)]
        return torch.tensor(rows, dtype=torch.long)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "buffer": self.buffer.decode("ascii"), "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.buffer = state["buffer"].encode("ascii")
        self.consumed = state["consumed"]


# --------------------------------------------------------------------------- model

class TinyLM(nn.Module):
    """Byte-level causal transformer: embeddings, pre-norm encoder layers with a causal mask, head."""

    def __init__(self, seq_len: int, vocab: int = 256, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


# --------------------------------------------------------------------------- distributed helpers

def _distributed_env() -> bool:
    return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _all_min(value: int, world: int) -> int:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _load_full(engine: CheckpointEngine, step: int | None = None, into: Any = None) -> tuple[int, Any] | None:
    """This rank's state of ``step`` (default: the newest it can load), with the model and optimizer
    from rank 0's shard when this rank's shard has none (the replicas were saved once). ``into``: the
    built model's and optimizer's state dicts; the restore lays the bytes into their tensors
    (``load(into=)``: no new memory to fault in)."""
    got = engine.load(step, into=into)
    if got is None or "model" in got[1]:
        return got
    s, state = got
    own = dict(engine.last_restore or {})
    _, shared = engine.load(s, rank=0, into=into)
    rep = engine.last_restore or {}
    engine.last_restore = {**own, "seconds": own.get("seconds", 0.0) + rep.get("seconds", 0.0),
                           "replicas_from": f"{rep.get('tier_name')} on {rep.get('node')}"}
    return s, {**state, "model": shared["model"], "optimizer": shared["optimizer"]}


def _newest_agreed(engine: CheckpointEngine, world: int, into: Any = None) -> tuple[int, Any] | None:
    """The newest complete step every rank can load; ranks propose, the minimum wins, repeat."""
    try:
        got = _load_full(engine, into=into)
    except (CorruptCheckpoint, NoCheckpoint) as exc:
        log.warning("rank %d: the newest checkpoint cannot be loaded: %s", engine.rank, exc)
        got = None
    while True:
        mine = got[0] if got else -1
        agreed = _all_min(mine, world)
        if -_all_min(-mine, world) == agreed:       # max == min: every rank proposed the same
            return got if agreed >= 0 else None
        got = None
        for s in reversed(complete_steps(engine.directory)):
            if s <= agreed:
                try:
                    got = _load_full(engine, s, into)
                    break
                except (CorruptCheckpoint, NoCheckpoint) as exc:
                    log.warning("rank %d: skipping checkpoint step %d: %s", engine.rank, s, exc)


def _resume(engine: CheckpointEngine, world: int, into: Any = None) -> tuple[int, Any] | None:
    raw = os.environ.get("TRANSOM_RESUME_STEP")
    if not raw:
        return _newest_agreed(engine, world, into)
    step = int(raw)
    got, err = None, None
    try:
        got = _load_full(engine, step, into)
    except CheckpointError as exc:
        err = exc
    if _all_min(1 if got else 0, world) == 0:
        why = err or "another rank could not load it"
        print(f"train_lm rank {engine.rank}: cannot resume from step {step} (TRANSOM_RESUME_STEP): {why}",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RESUME_FAILED)
    return got


# --------------------------------------------------------------------------- main

def train_step(net: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module,
               data: "TemplateText", step: int, args: argparse.Namespace,
               sync: Any = None) -> torch.Tensor:
    """One optimizer step of step number ``step`` (learning-rate warm-up by step number, so a resumed
    run takes the same steps); returns the loss. ``args``: lr, batch_size, seq_len. ``sync``: called
    with the gradients after the backward pass (the elastic group's all-reduce; None: DDP's, or none)."""
    for group in opt.param_groups:
        group["lr"] = args.lr * min(1.0, (step + 1) / 20)
    batch = data.batch(args.batch_size, args.seq_len)
    logits = net(batch[:, :-1])
    loss = loss_fn(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if sync is not None:
        sync([p.grad for p in model.parameters() if p.grad is not None])
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def slowdown(directory: str, compute_s: float, step: int | None = None) -> float:
    """The benchmarks' straggler hook: busy-wait as a device at fraction f of its speed would; return the wait.

    ``directory/<node>`` (node: TRANSOM_NODE, else ``slot<RANK>``) is read every step and holds
    ``f [S]``: spin S seconds when given (the benchmark passes (1/f - 1) x the normal step time it
    measured, which does not feed back on itself), else (1/f - 1) x ``compute_s``. No file, or an f
    that is not a fraction in (0, 1), means full speed. It spins rather than sleeps: a slow device
    still does the work, and where ranks share CPU cores a sleeping rank would hand its core to the
    others and the job would barely slow down.

    ``directory/pause`` holds an epoch time ``T [STEP]``: until then every rank sleeps after its
    steps (from step STEP on, when given) (the benchmark's evaluation pause: all ranks stop stepping
    together, with no phase marker; the tests hold a job so). The file is read again while it waits.
    """
    paused = 0.0

    def until() -> float:
        try:
            values = open(os.path.join(directory, "pause")).read().split()
            return float(values[0]) if step is None or len(values) < 2 or step >= int(values[1]) else 0.0
        except (OSError, ValueError, IndexError):
            return 0.0

    while (left := until() - time.time()) > 0:
        time.sleep(min(left, 0.2))
        paused += min(left, 0.2)
    node = os.environ.get("TRANSOM_NODE") or f"slot{os.environ.get('RANK', '0')}"
    try:
        values = [float(v) for v in open(os.path.join(directory, node)).read().split()[:2]]
    except (OSError, ValueError):
        return paused
    if not values or not 0.0 < values[0] < 1.0:
        return paused
    pause = values[1] if len(values) > 1 and values[1] >= 0 else compute_s * (1.0 / values[0] - 1.0)
    end = time.perf_counter() + pause
    while time.perf_counter() < end:
        pass
    return paused + pause


def _check_capacity(engine: CheckpointEngine, model: nn.Module) -> None:
    """Stop before training when this node cannot hold the checkpoints (model + AdamW's two moments)."""
    shard = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + (1 << 20)
    cap = engine.capacity()
    try:
        check_node(node_need(shard, 1, cap.get("mem_keep", 1)), shm_free=cap["shm_free"],
                   ram_available=cap["ram_available"], budget=cap.get("budget"), where=cap["shm_path"])
    except CapacityError as exc:
        print(f"train_lm rank {engine.rank}: cannot start: {exc}", file=sys.stderr, flush=True)
        engine.close()
        raise SystemExit(EXIT_NO_CAPACITY) from None


def ckpt_every(value: str) -> int | None:
    """``--ckpt-every``'s argparse type: a number of steps (0: only after the last), or ``auto`` (None: the
    checkpoint engine's cadence)."""
    if value == "auto":
        return None
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r}: expected a number of steps (0: only after the last) or auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m transom.examples.train_lm",
        description="Train a tiny byte-level transformer LM with DDP (gloo, CPU), checkpointing "
                    "through Transom's checkpoint engine and reporting steps to the node agent.")
    p.add_argument("--steps", type=int, default=300, help="train until this many steps are done (default 300)")
    p.add_argument("--ckpt-every", type=ckpt_every, default="auto", metavar="K",
                   help="save a checkpoint every K steps and after the last; 0: only after the last; auto: when "
                        "the checkpoint engine's cadence says (Young's interval from the measured cost of a save "
                        "and TRANSOM_CKPT_MTBF_S, the mean seconds between faults, default 4 h; the share of them "
                        "that relaunch the job is learnt from its heals and relaunches) (default auto)")
    p.add_argument("--mtbf", type=float, default=None, metavar="SECONDS",
                   help="--ckpt-every auto: mean seconds between faults (default: "
                        "TRANSOM_CKPT_MTBF_S, else 4 h)")
    p.add_argument("--ckpt-dir", default=os.environ.get("TRANSOM_CKPT_DIR") or "runs/train_lm",
                   help="checkpoint directory (env TRANSOM_CKPT_DIR; default runs/train_lm)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init and the data (default 0)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate after warm-up (default 3e-3)")
    p.add_argument("--dedup-replicas", action=argparse.BooleanOptionalAction, default=True,
                   help="only rank 0 saves the model and optimizer, which every data-parallel rank holds "
                        "alike; every rank loads them from rank 0's shard (default: on)")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints progress every N steps (default 10)")
    p.add_argument("--width", type=int, default=64, help="model width d_model (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide --width (default 4)")
    p.add_argument("--slowdown-dir", default=None, metavar="D",
                   help="benchmark hook: while D/<node> holds a fraction f, steps take 1/f of their time (default: off)")
    p.add_argument("--steps-file", default=None, metavar="F",
                   help="rank 0 appends 'step generation epoch_seconds' to F after every step (default: none)")
    p.add_argument("--elastic", action=argparse.BooleanOptionalAction, default=True,
                   help="under Transom (TRANSOM_JOB, TRANSOM_BOOTSTRAP set): join an elastic group, so a rank "
                        "failure is healed in the job (survivors keep their state, a warm spare steps in) "
                        "instead of a relaunch (default: on; transom.elastic)")
    p.add_argument("--eval-pause", default=None, metavar="STEP:SECONDS",
                   help="benchmark hook: after step STEP every rank stands still for SECONDS, as an evaluation "
                        "pass without a phase marker would (default: none)")
    args = p.parse_args(argv)
    if args.eval_pause is not None:
        at, _, secs = args.eval_pause.partition(":")
        if not (at.isdigit() and secs.replace(".", "", 1).isdigit()):
            p.error(f"--eval-pause {args.eval_pause!r}: expected STEP:SECONDS, e.g. 200:40")
        args.eval_pause = (int(at), float(secs))
    if args.mtbf is not None and not args.mtbf > 0:
        p.error(f"--mtbf {args.mtbf}: expected seconds > 0")
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        p.error("--steps, --batch-size must be >= 1, --seq-len >= 2")
    if args.width < 1 or args.layers < 1 or args.heads < 1 or args.width % args.heads:
        p.error(f"--width ({args.width}) must be a positive multiple of --heads ({args.heads}); --layers >= 1")
    return args


class LMReplica(Replica):
    """The replica of :mod:`transom.elastic`: model, optimizer and step alike on every rank; the data
    stream and RNG are the rank's own (a spare takes them from the rank's newest checkpoint)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, data: TemplateText, step: int,
                 distributed: bool, engine: CheckpointEngine | None, args: argparse.Namespace, rank: int,
                 elastic: bool = False) -> None:
        super().__init__(model, opt, step)
        self.data, self.distributed, self.engine, self.args, self.rank = data, distributed, engine, args, rank
        self.elastic = elastic          # gradients through the elastic group's all-reduce, not DDP's reducer
        self.net: nn.Module | None = None
        self.rebuild()

    def drop(self) -> None:
        self.net = None                 # DDP's reducer holds the broken group

    def rebuild(self) -> None:
        use_ddp = self.distributed and not self.elastic
        self.net = nn.parallel.DistributedDataParallel(self.model) if use_ddp else self.model

    def position(self) -> Any:
        return self.data.state_dict()

    def rewind(self, position: Any) -> None:
        self.data.load_state_dict(position)

    def adopt(self, step: int) -> None:
        """The rank's data stream and RNG at ``step``: from its newest checkpoint at or before it, then
        the batches since (the stream depends only on the seed, the rank and what was read)."""
        start, t0 = 0, time.perf_counter()
        self.data = TemplateText(self.args.seed, self.rank)
        random.seed(self.args.seed * 7919 + self.rank)
        torch.manual_seed(self.args.seed * 7919 + self.rank)
        for s in reversed(complete_steps(self.engine.directory) if self.engine else []):
            if s > step:
                continue
            try:
                got = self.engine.load(s)
            except CheckpointError as exc:
                log.warning("rank %d: checkpoint step %d unusable for the data position: %s", self.rank, s, exc)
                continue
            if got is not None:
                start, state = got
                self.data.load_state_dict(state["data"])
                torch.set_rng_state(state["rng"]["torch"])
                random.setstate(state["rng"]["python"])
                break
        for _ in range(step - start):
            self.data.batch(self.args.batch_size, self.args.seq_len)
        print(f"rank {self.rank}: data position of step {step} from "
              f"{'checkpoint step %d' % start if start else 'the start'} + {step - start} batches in "
              f"{time.perf_counter() - t0:.3f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tlog.setup()
    torch.set_num_threads(1)
    # denormal floats (weights, gradients and Adam's moments drift into them as training goes) take
    # the CPU's slow path: steps here grew 45 % over the first 150; GPUs flush them, so do we
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)                         # same init on every rank (and a spare, before it has one)
    model = TinyLM(args.seq_len, d_model=args.width, n_heads=args.heads, n_layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    distributed = _distributed_env()
    group = None
    if args.elastic and (distributed or os.environ.get(ENV_SPARE) == "1"):
        group = ElasticGroup.from_env()          # None outside Transom: a plain process group
    if group is not None:
        try:
            group.join()                         # a warm spare waits here for a rank
        except SpareReleased as exc:
            print(f"spare released: {exc}", flush=True)
            return 0
        distributed = True
    elif distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    elif os.environ.get(ENV_SPARE) == "1":
        print("train_lm: started as a spare but no elastic group (TRANSOM_BOOTSTRAP, TRANSOM_JOB): exiting",
              file=sys.stderr, flush=True)
        return 1
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    generation = int(os.environ.get("TRANSOM_GENERATION") or 0)
    spare = group is not None and group.spare

    data = TemplateText(args.seed, rank)
    random.seed(args.seed * 7919 + rank)
    torch.manual_seed(args.seed * 7919 + rank)           # per-rank stream for anything stochastic

    engine = CheckpointEngine.from_env(args.ckpt_dir, rank=rank, world_size=world, keep=args.keep,
                                       **({"mtbf_s": args.mtbf} if args.mtbf else {}))
    _check_capacity(engine, model)
    step = 0
    built = {"model": model.state_dict(), "optimizer": opt.state_dict()}     # restored into, in place
    got = None if spare else _resume(engine, world, built)
    if got is None and engine.into_touched:       # a refused copy laid part of its bytes into the model
        rng = torch.get_rng_state()
        torch.manual_seed(args.seed)
        model.load_state_dict(TinyLM(args.seq_len, d_model=args.width, n_heads=args.heads,
                                     n_layers=args.layers).state_dict())
        torch.set_rng_state(rng)
    if got is not None:
        step, state = got
        mine = model.state_dict()
        if not all(k in state["model"] and state["model"][k].data_ptr() == v.data_ptr() for k, v in mine.items()):
            model.load_state_dict(state["model"])    # some were not laid in place (load(into=))
        opt.load_state_dict(state["optimizer"])
        data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        where = engine.last_restore or {}
        also = f" (model and optimizer: rank 0's shard from {where['replicas_from']})" if "replicas_from" in where else ""
        print(f"rank {rank}: restored step {step} from {where.get('tier_name')} on {where.get('node')} "
              f"in {where.get('seconds', 0.0):.3f}s{also}", flush=True)
        if rank == 0:
            print(f"resumed from step {step} gen {generation}", flush=True)
    elif rank == 0 and not spare:
        print(f"starting from scratch gen {generation}", flush=True)

    replica = LMReplica(model, opt, data, step, distributed, engine, args, rank, elastic=group is not None)
    if spare:
        step = group.sync(replica)                       # model, optimizer, step from a survivor
        replica.rebuild()
    loss_fn = nn.CrossEntropyLoss()
    tokens = args.batch_size * args.seq_len
    recent: list[tuple[float, float]] = []
    last_saved = step if got is not None else None
    steps_out = open(args.steps_file, "a") if args.steps_file and rank == 0 else None
    value = float("nan")
    due = [False]                # the cadence's answer for the step just taken (--ckpt-every auto)

    def one_step() -> torch.Tensor:
        due[0] = False
        loss = train_step(replica.net, model, opt, loss_fn, replica.data, replica.step, args,
                          sync=group.all_reduce_mean_ if group is not None else None)
        if args.ckpt_every is None:      # agreed by every rank inside the step: a peer lost here is healed
            due[0] = engine.due(replica.step + 1, *((group.agree_max, group.epoch) if group is not None else ()))
        return loss

    while replica.step < args.steps:
        t0 = time.perf_counter()
        if group is not None:
            loss = group.step(one_step, replica)
        else:
            loss = one_step()
            replica.step += 1
        step = replica.step
        if args.slowdown_dir:
            slowdown(args.slowdown_dir, time.perf_counter() - t0, step)
        step_time = time.perf_counter() - t0
        if loss is not None:                             # None: a survivor had done this step for us
            value = loss.item()
        saving = due[0] if args.ckpt_every is None else bool(args.ckpt_every and step % args.ckpt_every == 0)
        if saving or step == args.steps:
            state = {"data": replica.data.state_dict(),
                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                     "step": step, "world_size": world}
            if rank == 0 or not args.dedup_replicas:
                state.update(model=model.state_dict(), optimizer=opt.state_dict())
            engine.save(step, state)        # the engine reports the save's stall itself (report_event)
            last_saved = step
            saving = True
        report(step=step, loss=value, tokens_per_s=tokens / step_time, step_time=step_time)
        if args.eval_pause and step == args.eval_pause[0]:
            time.sleep(args.eval_pause[1])       # every rank at the same step: a job-wide pause, no marker
        if steps_out is not None:
            steps_out.write(f"{step} {generation} {time.time():.6f}{' s' if saving else ''}\n")
            steps_out.flush()
        recent = (recent + [(value, step_time)])[-args.log_every:]
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            mean_loss = sum(v for v, _ in recent) / len(recent)
            mean_time = sum(t for _, t in recent) / len(recent)
            print(f"step {step}/{args.steps} loss {mean_loss:.2f} tok/s {world * tokens / mean_time:.0f} "
                  f"gen {generation}", flush=True)

    persisted = 1
    try:
        engine.close()                                   # waits for the last save to persist
    except CheckpointError as exc:
        persisted = 0
        print(f"train_lm rank {rank}: the last checkpoint did not persist: {exc}", file=sys.stderr, flush=True)
    all_persisted = _all_min(persisted, world)           # also keeps ranks together until all are done
    if distributed:
        # DDP's reducer keeps the process group (and gloo's worker threads) alive: drop it first, or the
        # group is torn down during interpreter finalization, which can abort ("terminate called ...")
        replica.drop()
        gc.collect()
        dist.destroy_process_group()
    if group is not None:
        group.close()
    if rank == 0 and all_persisted:
        print(f"done: {step} steps, last checkpoint step {last_saved}", flush=True)
    return 0 if persisted else 1


if __name__ == "__main__":
    sys.exit(main())
