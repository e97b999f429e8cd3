"""`orchestrator.cluster.spawn`: a cluster process leads its own process group, so killing,
freezing or stopping it reaches what it started (a vLLM worker's engine-core children), while
signals meant for the leader alone (SIGUSR1/2 of the KV fault injector) stay with it.

The "worker" here is a small Python script that starts a child and reports its pid; the vLLM
case proper is `tests/vllm/test_vllm_failover.py`.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from orchestrator.cluster import LocalCluster, Proc, spawn
from orchestrator.demo import serve_until_signalled

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


@pytest.mark.slow
@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "not-reaped"])
def test_stop_stops_the_group_of_a_leader_killed_alone(
    leader: tuple[Proc, int], reaped: bool
) -> None:
    """``kill -9`` on a worker's pid alone (an OOM kill): its children (a vLLM worker's
    engine core and model workers, GBs) live on in its group. `stop` stops them, whether
    the dead leader was reaped already (a ``poll``) or not."""
    proc, child = leader
    os.kill(proc.popen.pid, signal.SIGKILL)
    _wait(proc._exited, "the leader outlived SIGKILL")
    if reaped:
        proc.popen.wait()
    assert _alive(child)
    proc.stop(grace_s=5.0)
    _wait(lambda: not _alive(child), "stop left the killed leader's group running")


@pytest.mark.slow
def test_stop_leaves_alone_a_group_whose_pid_was_reused(tmp_path: Path) -> None:
    """Once the leader is reaped and its group empty, its pid may go to a newcomer leading a
    group of that id: not ours to signal."""
    gone = spawn("decode-0", [sys.executable, "-c", "pass"], tmp_path / "gone.log")
    gone.popen.wait()
    other = spawn("other", [sys.executable, "-c", LEADER], tmp_path / "other.log")
    try:
        _wait(lambda: "child " in _log(other), "the child never started")
        child = int(_log(other).split("child ", 1)[1].split()[0])
        gone.popen.pid = other.popen.pid  # as if the pid had been handed out again
        gone.stop(grace_s=1.0)
        assert other.popen.poll() is None
        assert _alive(child)
    finally:
        other.stop(grace_s=1.0)


def test_cluster_stops_orchestrators_then_workers_then_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrators drain their streams while the workers still serve them (workers
    first gave a client "no workers registered" mid-stream); Redis serves everyone to the
    end."""
    stopped: list[str] = []
    monkeypatch.setattr(Proc, "stop", lambda self, grace_s=5.0: stopped.append(self.name))
    cluster = LocalCluster(workdir=tmp_path)
    for name in ("decode-0", "orchestrator-0", "redis", "prefill-0", "orchestrator-1"):
        cluster.procs[name] = Proc(name, cast("subprocess.Popen[bytes]", None), tmp_path / name)
    cluster.stop()
    assert stopped[:2] == ["orchestrator-0", "orchestrator-1"]
    assert sorted(stopped[2:4]) == ["decode-0", "prefill-0"]
    assert stopped[4:] == ["redis"]


class _Cluster:
    """What `serve_until_signalled` looks at: the processes by name."""

    def __init__(self, procs: dict[str, Proc]) -> None:
        self.procs = procs


class _Stderr(io.StringIO):
    """Captures what is written and wakes a waiter on each line."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Condition()

    def write(self, text: str) -> int:
        with self.wrote:
            n = super().write(text)
            self.wrote.notify_all()
        return n

    def wait_for(self, fragment: str, timeout_s: float) -> bool:
        with self.wrote:
            return self.wrote.wait_for(lambda: fragment in self.getvalue(), timeout_s)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_serving_goes_on_when_a_worker_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed (``kill -9``) is told in one line and the cluster serves on: its
    requests fail over to the workers left. Its orchestrator exiting stops the cluster."""
    script = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = {n: spawn(n, script, tmp_path / f"{n}.log") for n in ("decode-1", "orchestrator-0")}
    err = _Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    outcome: list[str] = []

    def kill_them() -> None:
        os.kill(procs["decode-1"].popen.pid, signal.SIGKILL)
        if err.wait_for("decode-1 exited", 10):
            outcome.append("told")
            os.kill(procs["orchestrator-0"].popen.pid, signal.SIGTERM)

    killer = threading.Thread(target=kill_them, name="kill-them")
    try:
        killer.start()
        served = serve_until_signalled(cast("LocalCluster", _Cluster(procs)), "pdorch up",
                                       "`pdorch down` stops the rest")  # fmt: skip
        killer.join(15)
    finally:
        for proc in procs.values():
            proc.stop(grace_s=1.0)
    lines = err.getvalue().splitlines()
    assert outcome == ["told"]
    assert not served
    assert lines == [
        "pdorch up: decode-1 exited (killed by SIGKILL); the cluster serves on without it "
        "\N{EM DASH} `pdorch down` stops the rest",
        "pdorch up: orchestrator-0 exited (killed by SIGTERM); stopping",
    ]


@pytest.mark.slow
def test_every_process_is_announced_as_it_starts_before_it_is_ready(tmp_path: Path) -> None:
    """`LocalCluster.on_spawn` runs once a process is started and in `procs` — before the
    wait for it to be ready (`pdorch up` lists it in its state file there) — Redis, which
    leads a process group of its own (a terminal's Ctrl-C does not reach it), included."""
    cluster = LocalCluster(workdir=tmp_path)
    seen: list[list[str]] = []
    cluster.on_spawn = lambda: seen.append(sorted(cluster.procs))
    try:
        cluster.start_redis()
        redis = cluster.procs["redis"]
        assert redis.group
        assert os.getpgid(redis.popen.pid) == redis.popen.pid != os.getpgid(0)
        cluster._spawn("orchestrator-0", [sys.executable, "-c", "import time; time.sleep(30)"])
        assert seen == [["redis"], ["orchestrator-0", "redis"]]
    finally:
        cluster.stop()
