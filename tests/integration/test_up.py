"""`pdorch up` as a user runs it: a real cluster comes up, publishes its endpoints, and
`status`, `generate` and `cost` find it without flags; `pdorch down` stops it and every
process it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis

from orchestrator.cli import main
from orchestrator.cli.state import read_state
from tests.integration.conftest import outlive_the_workers_listing, wait_for


@pytest.mark.slow  # a cluster of five processes: ~45 s on a busy 2-core machine
@pytest.mark.timeout(300)
def test_up_status_generate_cost_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = dict(os.environ, PDORCH_STATE=str(tmp_path / "up.json"))
    for name in ("PDORCH_ORCHESTRATOR", "PDORCH_REDIS_URL"):
        env.pop(name, None)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDORCH_STATE", env["PDORCH_STATE"])
    argv = ["up", "--model", "tiny", "--transport", "tcp", "--port", "0", "--http-port", "0",
            "--logs", str(tmp_path / "logs"), "--json"]  # fmt: skip
    up = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a failed test kills the whole cluster with it
    )  # fmt: skip
    try:
        wait_for(lambda: read_state(env) is not None or up.poll() is not None, 240, "pdorch up")
        state = read_state(env)
        assert state is not None, up.communicate()[1]
        published = json.loads(up.stdout.readline() if up.stdout else "{}")
        assert published["orchestrator"] == state.orchestrator
        assert set(state.metrics) == {"orchestrator-0", "prefill-0", "decode-0", "decode-1"}
        assert state.http.endswith("/v1")

        assert main(["status", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["health"] == "SERVING"
        assert sorted(w["worker_id"] for w in status["workers"]) == [
            "decode-0", "decode-1", "prefill-0",
        ]  # fmt: skip

        assert main(["generate", "hello", "--max-tokens", "4"]) == 0
        assert "[stopped: --max-tokens reached]" in capsys.readouterr().err
        assert main(["cost", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["default"]["requests"] == 1.0

        # A worker killed alone (kill -9): said in one line, and the cluster serves on.
        os.kill(state.procs["decode-1"][0], signal.SIGKILL)

        def decode_1_gone() -> bool:
            assert main(["status", "--json"]) == 0
            workers = json.loads(capsys.readouterr().out)["workers"]
            return "decode-1" not in {w["worker_id"] for w in workers}

        wait_for(decode_1_gone, 30, "decode-1's heartbeat to expire")
        outlive_the_workers_listing()
        assert main(["generate", "hello again", "--max-tokens", "4"]) == 0
        assert "[stopped: --max-tokens reached]" in capsys.readouterr().err
        assert up.poll() is None  # still up

        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 5  # redis, orchestrator, 1 prefill + 2 decode workers
        assert main(["down"]) == 0
        _out, err = up.communicate(timeout=30)  # closes the pipes too
        assert up.returncode == 0, err
        assert "stopping the cluster: done" not in err  # --json: quiet
        assert (
            "pdorch up: decode-1 exited (killed by SIGKILL); the cluster serves on without it "
            "\N{EM DASH} `pdorch down` stops the rest"
        ) in err
        assert not Path(env["PDORCH_STATE"]).exists()
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive  # every process it started is gone, its Redis too
        client = redis.Redis.from_url(state.redis, socket_connect_timeout=0.5)
        with pytest.raises(redis.ConnectionError):
            client.ping()
        client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)  # nothing left after a clean exit
        up.communicate(timeout=60)


@pytest.mark.slow  # a cluster of five processes: ~45 s on a busy 2-core machine
@pytest.mark.timeout(300)
def test_generate_finds_the_cluster_of_a_killed_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdorch up` SIGKILLed once it serves leaves its cluster running (each process leads
    its own group): `generate` still finds it by the state file — as `down` does — and
    says nothing supervises it; a second `up` refuses to start over it; `down` then stops
    every process it left."""
    env = dict(os.environ, PDORCH_STATE=str(tmp_path / "up.json"))
    for name in ("PDORCH_ORCHESTRATOR", "PDORCH_REDIS_URL", "PDORCH_TLS_DIR"):
        env.pop(name, None)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDORCH_STATE", env["PDORCH_STATE"])
    argv = ["up", "--model", "tiny", "--transport", "tcp", "--prefill", "0", "--decode", "1",
            "--port", "0", "--http-port", "0", "--json"]  # fmt: skip
    up = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *argv],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: read_state(env) is not None or up.poll() is not None, 240, "pdorch up")
        state = read_state(env)
        assert state is not None, up.communicate()[1]
        children = psutil.Process(up.pid).children(recursive=True)
        up.kill()
        up.communicate(timeout=10)
        assert read_state(env) == state  # its orchestrator serves on

        assert main(["generate", "hello", "--max-tokens", "4"]) == 0
        err = capsys.readouterr().err
        assert f"`pdorch up` (pid {up.pid}) is gone" in err
        assert "[stopped: --max-tokens reached]" in err

        # A second `up` would overwrite the state file `down` finds this cluster by.
        assert main(["up", "--model", "tiny", "--port", "0", "--http-port", "0"]) == 1
        err = capsys.readouterr().err
        assert f"killed `pdorch up` (pid {up.pid}) still runs" in err
        assert err.strip().endswith("run `pdorch down` first")
        assert read_state(env) == state

        assert main(["down", "--timeout", "10"]) == 0
        assert "orchestrator-0" in capsys.readouterr().out
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive
        assert not Path(env["PDORCH_STATE"]).exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)
        up.communicate(timeout=60)
        for child in children:  # nothing left, unless the test failed
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _starting_up(env: dict[str, str]) -> subprocess.Popen[str]:
    """`pdorch up` of the tiny model, returned once its workers are loading (each started
    process already in the state file, the cluster not up yet)."""
    argv = ["up", "--model", "tiny", "--transport", "tcp", "--port", "0", "--http-port", "0"]
    up = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *argv],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert up.stderr is not None
        for line in up.stderr:  # the progress lines of a log (not a terminal)
            if "workers loading tiny" in line:
                break
        wait_for(lambda: len(_listed(env)) == 4, 60, "the state file lists every process")
    except BaseException:
        up.terminate()  # while starting: it stops what it started (workers lead own groups)
        with contextlib.suppress(subprocess.TimeoutExpired):
            up.communicate(timeout=60)
        raise
    return up


def _listed(env: dict[str, str]) -> dict[str, list[int]]:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(Path(env["PDORCH_STATE"]).read_text())["procs"])
    return {}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_down_while_starting_stops_what_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdorch down` (SIGTERM) or Ctrl-C while the workers load: the start is abandoned,
    said so (not reported as a failed step), and every process already started is stopped;
    no state file is left. Meanwhile the cluster is not offered to client commands."""
    env = dict(os.environ, PDORCH_STATE=str(tmp_path / "up.json"))
    monkeypatch.setenv("PDORCH_STATE", env["PDORCH_STATE"])
    with _starting_up(env) as up:
        try:
            assert read_state(env) is None  # starting: no endpoints yet
            assert main(["up", "--port", "0", "--http-port", "0"]) == 1  # one at a time
            assert "already running" in capsys.readouterr().err
            children = psutil.Process(up.pid).children(recursive=True)
            assert children  # Redis and the workers, starting
            assert main(["down"]) == 0
            assert "while it was starting" in capsys.readouterr().out
            _, err = up.communicate(timeout=60)
            assert up.returncode != 0  # interrupted, not up
            assert "interrupted in" in err
            assert "FAILED" not in err
            assert "stopping the cluster: done" in err
            _, alive = psutil.wait_procs(children, timeout=15)
            assert not alive
            assert not Path(env["PDORCH_STATE"]).exists()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_down_after_up_was_killed_while_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdorch up` SIGKILLed while its workers load leaves Redis and the workers running
    (each worker leads its own process group): the state file lists them as they start, so
    `pdorch down` stops them."""
    env = dict(os.environ, PDORCH_STATE=str(tmp_path / "up.json"))
    monkeypatch.setenv("PDORCH_STATE", env["PDORCH_STATE"])
    children: list[psutil.Process] = []
    with _starting_up(env) as up:
        try:
            children = psutil.Process(up.pid).children(recursive=True)
            up.kill()
            up.communicate(timeout=10)
            assert any(c.is_running() for c in children)  # left running
            assert main(["down", "--timeout", "10"]) == 0
            out = capsys.readouterr().out
            assert "stopped what it left running: decode-0, decode-1, prefill-0, redis" in out
            _, alive = psutil.wait_procs(children, timeout=15)
            assert not alive
            assert not Path(env["PDORCH_STATE"]).exists()
        finally:
            for child in children:  # nothing left, unless the test failed
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
