"""Helpers for tests: read a topic until a condition holds, with a deadline."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from transom import contracts
from transom.kafka import read_topic


def topic_values(bootstrap: str, topic: str, *, raw: bool = False, valid_only: bool = False) -> list[Any]:
    """Every value on ``topic``, decoded (``raw``: as bytes). ``valid_only``: skip values that do not
    decode, e.g. the malformed input another test sent on purpose to a shared broker."""
    out = []
    for _key, value, _p, _o in read_topic(bootstrap, topic):
        if raw:
            out.append(value)
            continue
        try:
            out.append(contracts.decode(topic, value))
        except contracts.ContractError:
            if not valid_only:
                raise
    return out


def wait_until(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Call ``fn`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = fn()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def until_alive(proc, fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """:func:`wait_until` that fails at once when ``proc`` (a controller under test) has exited."""
    def check():
        got = fn()
        if not got and proc.poll() is not None:
            raise AssertionError(f"the controller exited ({proc.returncode}) while waiting for {what}")
        return got
    return wait_until(check, timeout, what)


def require_bed() -> None:
    """Skip the calling test, with the one-line reason, where the test bed cannot run (no namespaces)."""
    import pytest

    from transom import testbed

    ok, reason = testbed.available()
    if not ok:
        pytest.skip(f"test bed unavailable: {reason}")


@contextlib.contextmanager
def bed_stack(root: Path, nodes: int) -> Iterator[Any]:
    """A LocalStack of ``nodes`` hosts on the test bed (the test skips when the bed cannot run here);
    stopped at the end, and no namespace of its bed may be left behind."""
    from transom.stack import LocalStack

    require_bed()
    s = LocalStack(root, nodes=nodes, hosts=True)
    index = s.bed.index
    try:
        yield s
    finally:
        s.stop()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"tb{index}-" not in left, f"namespaces of bed {index} left behind:\n{left}"
