"""`orchestrator.cluster.spawn`: a cluster process leads its own process group, so killing,
freezing or stopping it reaches what it started (a vLLM worker's engine-core children), while
signals meant for the leader alone (SIGUSR1/2 of the KV fault injector) stay with it.

The "worker" here is a small Python script that starts a child and reports its pid; the vLLM
case proper is `tests/vllm/test_vllm_failover.py`.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cluster import Proc, spawn

LEADER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGUSR1, lambda *_: print("usr1", flush=True))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exits, leaving its child behind
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("child", child.pid, flush=True)
while True:
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(predicate: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polling a condition with a deadline


def _log(proc: Proc) -> str:
    return proc.log_path.read_text()


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[tuple[Proc, int]]:
    proc = spawn("worker", [sys.executable, "-c", LEADER], tmp_path / "worker.log")
    try:
        _wait(lambda: "child " in _log(proc), "the child never started")
        child = int(_log(proc).split("child ", 1)[1].split()[0])
        yield proc, child
    finally:
        proc.stop(grace_s=1.0)


def test_a_killed_process_takes_its_children_with_it(leader: tuple[Proc, int]) -> None:
    proc, child = leader
    assert _alive(child)
    proc.signal(signal.SIGKILL)
    proc.popen.wait(10)
    _wait(lambda: not _alive(child), "the child outlived its killed parent")


def test_stop_leaves_nothing_of_the_group_running(leader: tuple[Proc, int]) -> None:
    proc, child = leader
    proc.stop(grace_s=5.0)
    assert proc.popen.returncode == 0  # it drained on SIGTERM (and left its child)
    _wait(lambda: not _alive(child), "stop left the leader's child running")


def test_a_frozen_process_is_frozen_with_its_children(leader: tuple[Proc, int]) -> None:
    proc, child = leader

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    proc.signal(signal.SIGSTOP)
    _wait(lambda: state(child) == "T" and state(proc.popen.pid) == "T", "not stopped")
    proc.signal(signal.SIGCONT)
    _wait(lambda: state(child) != "T" and state(proc.popen.pid) != "T", "not continued")


def test_leader_only_signals_stay_with_the_leader(leader: tuple[Proc, int]) -> None:
    proc, child = leader
    proc.signal(signal.SIGUSR1)  # would kill the child (default action) if it reached it
    _wait(lambda: "usr1" in _log(proc), "the leader never saw SIGUSR1")
    assert _alive(child)
    assert proc.popen.poll() is None
