"""A new user's mistakes, each answered with one clear line in bounded time (issue 15).

The bound is the subprocess timeout (never a timing assertion: the machine is shared); the
commands themselves give up on an unreachable broker after 4 s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from transom.broker import free_port

TRANSOM = [sys.executable, "-m", "transom.cli"]


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 40) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k != "TRANSOM_BOOTSTRAP"}
    return subprocess.run(TRANSOM + args, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def _one_line(proc: subprocess.CompletedProcess, command: str, *needles: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"transom {command}: error: ") and all(n in lines[0] for n in needles), lines[0]


def test_a_wrong_bootstrap_is_one_line_not_a_wall_of_librdkafka():
    nobody = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "TRANSOM_BOOTSTRAP"}
    commands = [["jobs"], ["report", "some-job"], ["run", "--nodes", "1", "--bootstrap", nobody, "--", "python", "x.py"]]
    procs = [subprocess.Popen(TRANSOM + c + (["--bootstrap", nobody] if c[0] != "run" else []), text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for c in commands]                                   # at once: each waits 4 s for the broker
    try:
        for command, proc in zip(commands, procs):
            out, err = proc.communicate(timeout=40)
            _one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), command[0],
                      f"no Kafka broker answered at {nobody} within 4s", "--bootstrap")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("command", [["agent", "--node", "n0", "--gpu-source", "simulated"], ["tee"],
                                     ["controller", "--node", "n0=127.0.0.1:1"], ["jobs"]])
def test_a_forgotten_bootstrap_never_starts_a_private_broker(command):
    proc = _run(command)
    _one_line(proc, command[0], "no broker given: set TRANSOM_BOOTSTRAP", "--embedded-broker")
