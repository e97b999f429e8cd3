"""Wrong invocations of every command end in a short message naming the problem and a
non-zero exit, before anything starts, and never in a traceback (`orchestrator.cli.app.main`).

Each row: argv, the exit status, a fragment of the message. Usage errors (argparse) exit 2
in two lines; failures found by the command (Redis unreachable, a port in use, nothing to
report) exit 1 in one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api import orchestrator_pb2_grpc
from orchestrator.cli import main
from orchestrator.cli.state import ClusterState, write_state
from orchestrator.procs import alive, started
from orchestrator.store.server import RedisServer

DEAD_REDIS = "redis://127.0.0.1:1/0"
"""Nothing listens on port 1: connection refused at once."""


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No `pdorch up` state and no endpoint variables: the built-in defaults apply."""
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "none.json"))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    for name in ("PDORCH_REDIS_URL", "PDORCH_ORCHESTRATOR", "PDORCH_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)


USAGE = 2
FAILS = 1

CASES = [
    # --- flags checked by the parser, before anything starts
    (["demo", "--max-tokens", "0"], USAGE, "--max-tokens: must be at least 1, got 0"),
    (["bench", "engine", "--concurrency", "abc"], USAGE, "--concurrency: expected an integer"),
    (["bench", "engine", "--concurrency", "4,0"], USAGE, "--concurrency: must be at least 1"),
    (["bench", "engine", "--concurrency", ","], USAGE, "--concurrency: expected comma-sep"),
    (["bench", "engine", "--max-tokens", "5000"], USAGE, "--max-tokens: at most 2048"),
    (["demo", "--http-port", "99999"], USAGE, "--http-port: a port is 0 to 65535, got 99999"),
    (["up", "--http-port", "-1"], USAGE, "--http-port: a port is 0 to 65535, got -1"),
    (["up", "--decode", "0"], USAGE, "--decode: must be at least 1"),
    (["up", "--engine", "vllm", "--model", "tiny"], FAILS, "--engine vllm serves --model"),
    (["up", "--model", "/no/such/dir"], USAGE, "nor a model directory"),
    (["worker", "--role", "decode", "--model", "llama"], USAGE, "nor a model directory"),
    (["up", "--port", "7", "--http-port", "7"], FAILS, "must differ"),
    (["up", "--logs", "/etc/passwd", "--port", "0"], FAILS, "--logs /etc/passwd: not a folder"),
    (["cost", "--redis", "notaurl"], USAGE, "not a Redis URL: 'notaurl'"),
    (["status", "--redis", "http://x"], USAGE, "not a Redis URL"),
    (["--log-level", "bogus", "plan"], USAGE, "unknown log level 'bogus'"),
    (["plan", "--log-level", "bogus"], USAGE, "unknown log level 'bogus'"),
    (["worker", "--role", "decode", "--gpu-kind", "B300"], USAGE, "unknown GPU kind 'B300'"),
    (["worker", "--role", "decode", "--kv-capacity-mib", "-1"], USAGE, "must be 0 or more"),
    (["worker", "--role", "decode", "--sim", "nope"], USAGE, "--sim"),
    (["worker", "--role", "decode", "--count", "2"], FAILS, "--count needs --sim"),
    (["orchestrator", "--max-queue", "0"], USAGE, "--max-queue: must be at least 1"),
    (["orchestrator", "--port", "70000"], USAGE, "a port is 0 to 65535"),
    (["generate", "hi", "--max-tokens", "-3"], USAGE, "--max-tokens: must be at least 1"),
    (["generate", "hi", "--timeout", "0"], USAGE, "--timeout: must be a positive"),
    (["generate", "hi", "--orchestrator", "garbage"], USAGE, "expected HOST:PORT, got 'garbage'"),
    (["status", "--orchestrator", "1.2.3:x"], USAGE, "expected HOST:PORT, got '1.2.3:x'"),
    (["generate", "hi", "--orchestrator", "h:0"], USAGE, "a port is 1 to 65535, got 0"),
    (["generate", "hi", "--seed", "-1"], USAGE, "--seed: must be in [0, 2^63), got -1"),
    (["generate", "hi", "--seed", str(2**63)], USAGE, "--seed: must be in [0, 2^63)"),
    (["generate", "hi", "--temperature", "inf"], USAGE, "--temperature: must be 0 or a positive"),
    (["chaos", "run", "x", "--runs", "0"], USAGE, "--runs: must be at least 1"),
    (["chaos", "run", "x", "--late-bound", "0"], USAGE, "--late-bound: must be a positive"),
    (["chaos", "run", "decode-kill", "--late-bound", "0.001"], USAGE, "--late-bound: at least"),
    # --- found by the command before it starts anything
    (["worker", "--role", "decode", "--redis", DEAD_REDIS], FAILS, "Redis does not answer"),
    (["orchestrator", "--redis", DEAD_REDIS], FAILS, "Redis does not answer"),
    (["cost", "--redis", DEAD_REDIS], FAILS, "Redis does not answer"),
    (["status", "--redis", DEAD_REDIS], FAILS, "Redis does not answer"),
    (["generate", "hi", "--orchestrator", "127.0.0.1:1"], FAILS, "no orchestrator answers"),
    (["down"], FAILS, "no `pdorch up` cluster is running"),
    (["plan", "--gpus", "T4", "--model", "llama-3-70b"], FAILS, "no layout is feasible"),
    (["operator", "--namespace", "x"], FAILS, "no Kubernetes credentials"),
]


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.parametrize(("argv", "code", "message"), CASES, ids=str)
def test_a_wrong_invocation_names_the_problem(
    argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit(argv) == code
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--http-port", "{busy}"],
        ["up", "--port", "{busy}"],
        ["up", "--port", "0", "--http-port", "{busy}"],
        ["orchestrator", "--redis", "{redis}", "--port", "{busy}"],
        ["worker", "--role", "decode", "--redis", "{redis}", "--port", "{busy}"],
    ],
    ids=" ".join,
)
def test_a_port_in_use_is_refused_before_anything_starts(
    argv: list[str], busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RedisServer(tmp_path) as server:
        args = [a.format(busy=busy_port, redis=server.url) for a in argv]
        assert _exit(args) == FAILS
    err = capsys.readouterr().err
    assert f"{busy_port}: cannot listen on 127.0.0.1:{busy_port}" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_second_up_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "up.json"))
    state = ClusterState(pid=os.getpid(), orchestrator="127.0.0.1:7001", redis="redis://x:1/0")
    write_state(os.environ, state)  # this process plays the running `pdorch up`
    assert _exit(["up", "--port", "0", "--http-port", "0"]) == FAILS
    assert "a `pdorch up` cluster is already running" in capsys.readouterr().err


_LEFTOVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_down_stops_what_a_killed_up_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdorch up` SIGKILLed leaves its process groups running (each leads its own): `down`
    stops them from the state file, and removes it."""
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "up.json"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the killed `pdorch up`
    leader = subprocess.Popen(  # a worker: its group's leader, with a process of its own
        [sys.executable, "-c", _LEFTOVER, "orchestrator.cli", "worker"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        grandchild = int(leader.stdout.readline())
        procs = {"decode-0": [leader.pid, started(leader.pid)]}
        state = ClusterState(gone.pid, "127.0.0.1:7001", "redis://x:1/0", procs=procs)
        write_state(os.environ, state)
        # The same pids, started at another time: not ours (a pid reused since) — untouched.
        other = {"decode-0": [leader.pid, started(leader.pid) - 1], "x": [grandchild, 1]}
        write_state(os.environ, replace(state, procs=other))
        assert _exit(["down", "--timeout", "5"]) == FAILS
        assert alive(leader.pid)
        assert alive(grandchild)
        write_state(os.environ, state)
        assert _exit(["down", "--timeout", "5"]) == 0
        assert leader.wait(5) is not None
        for _ in range(100):  # the group's other process: SIGTERM reached it too
            if not alive(grandchild):
                break
            time.sleep(0.05)
        assert not alive(grandchild)
    finally:
        leader.kill()
        leader.wait()
        if leader.stdout is not None:
            leader.stdout.close()
    out = capsys.readouterr().out
    assert f"`pdorch up` (pid {gone.pid}) was gone; stopped what it left running: decode-0" in out
    assert not (tmp_path / "up.json").exists()
    assert _exit(["down"]) == FAILS  # nothing left: as before


@pytest.mark.slow  # starts processes
def test_down_stops_the_group_of_a_worker_killed_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker killed alone (``kill -9 PID``: a vLLM worker's engine core and model workers
    live on in its group), then its `pdorch up`: `down` stops the group the dead leader left
    — its pid is free, and Linux reuses no pid that still names a group — and Redis, which
    runs in `pdorch up`'s own group, alone."""
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "up.json"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the killed `pdorch up`
    leader = subprocess.Popen(  # a worker: its group's leader, with a process of its own
        [sys.executable, "-c", _LEFTOVER], stdout=subprocess.PIPE, start_new_session=True
    )
    redis_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert leader.stdout is not None
        grandchild = int(leader.stdout.readline())
        procs = {
            "decode-0": [leader.pid, started(leader.pid)],
            "redis": [redis_like.pid, started(redis_like.pid)],
        }
        leader.kill()  # the worker alone
        leader.wait()  # reaped: its pid stays free while its group has a member
        assert alive(grandchild)
        state = ClusterState(gone.pid, "127.0.0.1:7001", "redis://x:1/0", procs=procs)
        write_state(os.environ, state)
        assert _exit(["down", "--timeout", "5"]) == 0
        assert redis_like.wait(5) is not None
        for _ in range(100):
            if not alive(grandchild):
                break
            time.sleep(0.05)  # polling another process's exit (not our child)
        assert not alive(grandchild)
    finally:
        for proc in (leader, redis_like):
            proc.kill()
            proc.wait()
        if leader.stdout is not None:
            leader.stdout.close()
    out = capsys.readouterr().out
    assert "stopped what it left running: decode-0, redis" in out


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--engine", "vllm", "--model", "smollm2", "--port", "0", "--http-port", "0"],
        ["demo", "--engine", "vllm", "--model", "smollm2"],
        ["worker", "--role", "decode", "--engine", "vllm", "--model", "smollm2"],
    ],
    ids=" ".join,
)
def test_engine_vllm_without_vllm_is_refused_at_once(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every worker runs on this interpreter: without vLLM here they would fail one by one
    after starting (`ModuleNotFoundError`); refused in one line instead, saying where to run
    it."""
    import importlib.util  # noqa: PLC0415

    find_spec = importlib.util.find_spec

    def without_vllm(name: str, *args: Any) -> Any:
        return None if name == "vllm" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_vllm)
    assert _exit(argv) == FAILS
    err = capsys.readouterr().err
    assert "--engine vllm: vLLM is not installed in this environment" in err
    assert "`make venv-vllm`, then `.venv-vllm/bin/pdorch`" in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.usefixtures("no_cluster")
def test_cost_against_a_redis_without_costs_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RedisServer(tmp_path) as server:
        assert main(["cost", "--redis", server.url]) == FAILS
    err = capsys.readouterr().err
    assert f"no costs in the Redis at {server.url}" in err


def test_debug_shows_the_traceback() -> None:
    """``--debug`` re-raises, so the traceback a bug report needs is there."""
    from orchestrator.cli.common import CommandError  # noqa: PLC0415

    with pytest.raises(CommandError, match="Redis does not answer"):
        main(["--debug", "orchestrator", "--redis", DEAD_REDIS])


def test_a_real_process_prints_one_line_and_no_traceback() -> None:
    """As a user sees it: `python -m orchestrator.cli` (the `pdorch` script)."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "worker", "--role", "decode",
         "--redis", DEAD_REDIS],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == FAILS
    assert done.stderr.startswith(f"pdorch worker: --redis {DEAD_REDIS}: Redis does not answer")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _exit(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse exits."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--port", "0", "--http-port", "0"],
        ["demo"],
        ["worker", "--role", "decode", "--redis", DEAD_REDIS],
    ],
    ids=" ".join,
)
def test_ucx_without_ucxx_is_refused_before_anything_starts(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A machine without the ucx extra (UCXX is installed here: its absence is simulated)."""
    import importlib.util  # noqa: PLC0415

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a)
    )
    assert _exit([*argv, "--transport", "ucx"]) == FAILS
    assert "--transport ucx: UCXX is not installed" in capsys.readouterr().err


@pytest.mark.usefixtures("no_cluster")
def test_a_load_bench_where_nothing_completes_fails(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "load", "--target", "127.0.0.1:1", "--requests", "2", "--concurrency", "1"]
    assert _exit(argv) == FAILS
    assert "no request completed: does an orchestrator answer at 127.0.0.1:1?" in (
        capsys.readouterr().err
    )


class _NoWorkers(orchestrator_pb2_grpc.OrchestratorServicer):
    """An orchestrator that answers every request UNAVAILABLE, as one with no workers does."""

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAVAILABLE, "no workers registered")


@pytest.mark.usefixtures("no_cluster")
def test_an_orchestrator_that_answers_unavailable_is_quoted_not_called_absent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(_NoWorkers(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert _exit(["generate", "hi", "--orchestrator", f"127.0.0.1:{port}"]) == FAILS
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert "UNAVAILABLE: no workers registered" in err, err
    assert "no orchestrator answers" not in err
    assert "Traceback" not in err
