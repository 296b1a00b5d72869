"""Where jobs run: one abstract :class:`Backend`, and a registry of them by name.

A backend carries out the controller's actions and reports what it sees; it makes no decision.
Every method is idempotent for the same job and generation, so a controller that restarts after a
crash can repeat the action it had recorded without doing it twice.
"""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .rankwrap import write_atomic

__all__ = ["Backend", "RankStatus", "LaunchRecord", "Cordons", "CordonedNodes", "register_backend", "create_backend",
           "BACKENDS"]


@dataclass(frozen=True)
class RankStatus:
    rank: int
    running: bool
    exit_code: int | None      # None while running; negative: killed by that signal
    node: str | None = None    # where the rank ran, when the platform chose (Slurm); None: the launch's nodes[rank]


class LaunchRecord:
    """``RUN_DIR/JOB/gen-G/launch.json``: what one generation's launch started, written once its ranks run.

    A backend that finds the record when asked to launch again adopts what it describes instead of
    starting a second set of ranks (a controller that crashed after launching repeats the action).
    """

    def __init__(self, run_dir: Path, job: str, generation: int) -> None:
        self.job, self.generation = job, generation
        self.dir = Path(run_dir) / job / f"gen-{generation}"
        self.path = self.dir / "launch.json"

    def read(self) -> dict[str, Any] | None:
        return json.loads(self.path.read_text()) if self.path.exists() else None

    def adopt(self, log: logging.Logger) -> dict[str, Any] | None:
        """The handle of an earlier launch of this generation, or None after creating its directory."""
        handle = self.read()
        if handle is not None:
            log.info("job %s generation %d was already launched: adopting it", self.job, self.generation)
            return handle
        self.dir.mkdir(parents=True, exist_ok=True)
        return None

    def write(self, handle: Mapping[str, Any]) -> None:
        write_atomic(str(self.path), json.dumps(dict(handle)))


class Cordons:
    """``RUN_DIR/cordoned.json``: nodes kept out of launches (node -> reason), for backends that keep their own."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "cordoned.json"

    def read(self) -> dict[str, str]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def add(self, node: str, reason: str) -> bool:
        """Cordon ``node``; False if it already was."""
        cordoned = self.read()
        if node in cordoned:
            return False
        cordoned[node] = reason
        write_atomic(str(self.path), json.dumps(cordoned, indent=1))
        return True

    def remove(self, node: str) -> bool:
        """Uncordon ``node``; False if it was not cordoned."""
        cordoned = self.read()
        if cordoned.pop(node, None) is None:
            return False
        write_atomic(str(self.path), json.dumps(cordoned, indent=1))
        return True


class CordonedNodes:
    """The cordon methods of a backend that keeps its own :class:`Cordons` (``self.cordons``) and logs to ``log``."""

    cordons: Cordons
    log: logging.Logger

    def cordon(self, node: str, reason: str) -> None:
        if self.cordons.add(node, reason):
            self.log.info("cordoned %s: %s", node, reason)

    def cordoned(self) -> dict[str, str]:
        return self.cordons.read()

    def uncordon(self, node: str, reason: str) -> None:
        if self.cordons.remove(node):
            self.log.info("uncordoned %s: %s", node, reason)


class Backend(abc.ABC):
    """Launch, stop and watch one job's ranks on a set of nodes; cordon nodes; report node health."""

    name: str = ""

    @abc.abstractmethod
    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None, *, workdir: str | None = None,
               env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        """Start ``generation`` of ``job``, rank r on ``nodes[r]``; adopt it if already started.

        ``workdir``: the ranks' working directory (the submitter's; None: the backend's own); ``env``:
        variables set for the ranks over the backend's own environment (the submitter's, filtered);
        the launcher's variables (RANK, MASTER_ADDR, TRANSOM_*) win over both.
        Returns a JSON-able handle that is recorded in the lifecycle event.
        """

    @abc.abstractmethod
    def stop(self, job: str, generation: int, timeout: float = 10.0) -> None:
        """Stop every rank of ``generation`` (no error if none runs)."""

    @abc.abstractmethod
    def status(self, job: str, generation: int) -> list[RankStatus]:
        """The state of every rank of ``generation``; empty if it was never launched."""

    @abc.abstractmethod
    def cordon(self, node: str, reason: str) -> None:
        """Keep ``node`` out of future launches."""

    @abc.abstractmethod
    def nodes(self) -> list[str]:
        """Nodes this backend can run ranks on (cordoned ones excluded)."""

    @abc.abstractmethod
    def health(self, nodes: Sequence[str]) -> dict[str, str]:
        """What the platform says is wrong with each of ``nodes`` (node -> reason); healthy ones absent."""

    def cordoned(self) -> dict[str, str]:
        """Nodes kept out of launches -> the reason (for `transom nodes`)."""
        return {}

    def uncordon(self, node: str, reason: str) -> None:
        """Let ``node`` run ranks again (an operator's decision, with ``reason``)."""
        raise NotImplementedError(f"the {self.name} backend cannot uncordon nodes from Transom; "
                                  "use the platform's own tools")

    def collective_test(self, job: str, generation: int, nodes: Sequence[str], timeout: float) -> dict[str, str] | None:
        """Run a tiny all-reduce across ``nodes``; node -> reason for those that failed.

        None means this backend cannot run one (the pre-check then rests on health alone).
        """
        return None

    #: True when :meth:`start_spare` and :meth:`heal` work (the in-job path); else every fault relaunches.
    warm_spares: bool = False

    def start_spare(self, job: str, generation: int, node: str, command: tuple[str, ...], *,
                    workdir: str | None = None, env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        """Start a warm spare rank of ``generation`` on ``node``: the job's command with ``TRANSOM_SPARE=1`` and no
        RANK, so it waits at the elastic API's join point (:mod:`transom.elastic`) until it is assigned one."""
        raise NotImplementedError(f"the {self.name} backend keeps no warm spares")

    def heal(self, job: str, generation: int, rank: int, node: str, nodes: Sequence[str]) -> str:
        """Kill rank ``rank`` of ``generation`` if it still runs; make the warm spare on ``node`` that rank (its
        status, stop and logs from now on); return the new group's rendezvous ``HOST:PORT`` on ``nodes[0]``,
        an address every node of the job reaches."""
        raise NotImplementedError(f"the {self.name} backend cannot heal a job in place")

    def close(self) -> None:
        """Release what the backend holds (helper processes, connections); the jobs keep running."""

    def rank_log(self, job: str, generation: int, rank: int, lines: int = 10) -> dict[str, Any]:
        """Where rank ``rank``'s output is and its last ``lines`` lines: ``{"log": path, "tail": [...]}``
        ({} when unknown). Default: ``RUN_DIR/JOB/gen-G/rank-R.log`` of backends with a ``run_dir``."""
        run_dir = getattr(self, "run_dir", None)
        if run_dir is None:
            return {}
        path = Path(run_dir) / job / f"gen-{generation}" / f"rank-{rank}.log"
        try:
            with open(path, "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(fh.tell() - 8192, 0))
                text = fh.read().decode(errors="replace")
        except OSError:
            return {}
        tail = [line[-300:] for line in text.splitlines()[-lines:] if line.strip()]
        return {"log": str(path.resolve()), "tail": tail}


BACKENDS: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    if name in BACKENDS:
        raise ValueError(f"backend '{name}' is already registered")
    BACKENDS[name] = factory


def create_backend(name: str, **params: Any) -> Backend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend '{name}'; valid: {', '.join(sorted(BACKENDS))}") from None
    return factory(**params)
