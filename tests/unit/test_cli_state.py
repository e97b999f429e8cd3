"""How the client commands find a cluster (`orchestrator.cli.state`): flag, environment,
the state file of a running `pdorch up`, built-in default; and the text `status` and
`generate` print (`orchestrator.cli.status`, `orchestrator.cli.generate`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import build_parser, main
from orchestrator.cli.common import DEFAULT_ORCHESTRATOR
from orchestrator.cli.generate import finish_line, no_answer, orphan_note
from orchestrator.cli.state import ClusterState, read_state, remove_state, write_state
from orchestrator.cli.status import Snapshot, WorkerRow, format_status, pools
from orchestrator.procs import started
from orchestrator.store.settings import StoreSettings

BUILTIN_REDIS = StoreSettings().url


def _state(pid: int) -> ClusterState:
    return ClusterState(pid=pid, orchestrator="127.0.0.1:7001", redis="redis://127.0.0.1:7002/0")


def _endpoints(env: dict[str, str], *argv: str) -> tuple[str, str]:
    args = build_parser(env).parse_args(["status", *argv])
    return args.orchestrator, args.redis


def test_endpoints_come_from_flag_env_state_then_default(tmp_path: Path) -> None:
    env = {"PDORCH_STATE": str(tmp_path / "up.json")}
    assert _endpoints(env) == (DEFAULT_ORCHESTRATOR, BUILTIN_REDIS)
    write_state(env, _state(os.getpid()))  # a live `pdorch up`: this process
    assert _endpoints(env) == ("127.0.0.1:7001", "redis://127.0.0.1:7002/0")
    env |= {"PDORCH_ORCHESTRATOR": "h:1", "PDORCH_REDIS_URL": "redis://h:2/0"}
    assert _endpoints(env) == ("h:1", "redis://h:2/0")
    flags = ("--orchestrator", "f:1", "--redis", "redis://f:2/0")
    assert _endpoints(env, *flags) == ("f:1", "redis://f:2/0")


def test_the_state_of_a_dead_pdorch_up_is_ignored(tmp_path: Path) -> None:
    env = {"PDORCH_STATE": str(tmp_path / "up.json")}
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_state(env, _state(gone.pid))
    assert read_state(env) is None
    assert _endpoints(env) == (DEFAULT_ORCHESTRATOR, BUILTIN_REDIS)


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.mark.parametrize("ready", [True, False])
def test_a_killed_pdorch_ups_cluster_is_found_while_its_orchestrator_serves(
    tmp_path: Path, ready: bool
) -> None:
    """`pdorch up` SIGKILLed once its cluster served leaves the orchestrator running (its
    own process group): the client commands find it, as `pdorch down` does, and
    `generate` says that nothing supervises it and what stops it. Killed while starting
    (``ready`` False), there is no endpoint to offer."""
    env = {"PDORCH_STATE": str(tmp_path / "up.json")}
    me = os.getpid()  # stands for the orchestrator it started, still running
    state = ClusterState(
        pid=_dead_pid(), orchestrator="127.0.0.1:7001", redis="redis://127.0.0.1:7002/0",
        procs={"orchestrator-0": [me, started(me)], "redis": [me, started(me)]}, ready=ready,
    )  # fmt: skip
    write_state(env, state)
    if not ready:
        assert read_state(env) is None
        assert _endpoints(env) == (DEFAULT_ORCHESTRATOR, BUILTIN_REDIS)
        return
    assert read_state(env) == state
    assert _endpoints(env) == ("127.0.0.1:7001", "redis://127.0.0.1:7002/0")
    note = orphan_note(env, "127.0.0.1:7001")
    assert note is not None
    assert f"`pdorch up` (pid {state.pid}) is gone" in note
    assert "`pdorch down` stops it" in note
    assert orphan_note(env, "127.0.0.1:9") is None  # another orchestrator: nothing to say


def test_up_refuses_while_a_killed_pdorch_ups_cluster_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second `pdorch up` must not overwrite the state file of the cluster a killed one
    left serving: `pdorch down` finds that cluster by it alone. One line naming it and
    `pdorch down`, exit 1, nothing started, the file as it was."""
    import orchestrator.cluster  # noqa: PLC0415

    def started_a_cluster(*args: object, **kwargs: object) -> None:
        raise AssertionError("pdorch up started a cluster")

    monkeypatch.setattr(orchestrator.cluster, "LocalCluster", started_a_cluster)
    path = tmp_path / "up.json"
    monkeypatch.setenv("PDORCH_STATE", str(path))
    for name in ("PDORCH_REDIS_URL", "PDORCH_ORCHESTRATOR"):
        monkeypatch.delenv(name, raising=False)
    me = os.getpid()  # stands for the orchestrator it started, still running
    state = ClusterState(
        pid=_dead_pid(), orchestrator="127.0.0.1:7001", redis="redis://127.0.0.1:7002/0",
        procs={"orchestrator-0": [me, started(me)]},
    )  # fmt: skip
    write_state({"PDORCH_STATE": str(path)}, state)
    written = path.read_text(encoding="utf-8")
    assert main(["up", "--port", "0", "--http-port", "0", "--insecure"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"killed `pdorch up` (pid {state.pid})" in err
    assert f"orchestrator 127.0.0.1:7001, pid {me}" in err
    assert err.endswith("run `pdorch down` first")
    assert path.read_text(encoding="utf-8") == written


def test_up_refuses_while_a_pdorch_up_killed_while_starting_left_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed before it served (not ``ready``), its Redis and a worker still running: the
    state file lists them for `pdorch down`, so a new `pdorch up` refuses, naming them."""
    import orchestrator.cluster  # noqa: PLC0415

    def started_a_cluster(*args: object, **kwargs: object) -> None:
        raise AssertionError("pdorch up started a cluster")

    monkeypatch.setattr(orchestrator.cluster, "LocalCluster", started_a_cluster)
    path = tmp_path / "up.json"
    monkeypatch.setenv("PDORCH_STATE", str(path))
    for name in ("PDORCH_REDIS_URL", "PDORCH_ORCHESTRATOR"):
        monkeypatch.delenv(name, raising=False)
    me = os.getpid()  # stands for the processes it started, still running
    state = ClusterState(
        pid=_dead_pid(), orchestrator="127.0.0.1:7001", redis="redis://127.0.0.1:7002/0",
        procs={"redis": [me, started(me)], "decode-0": [me, started(me)],
               "orchestrator-0": [_dead_pid(), 1]},
        ready=False,
    )  # fmt: skip
    write_state({"PDORCH_STATE": str(path)}, state)
    written = path.read_text(encoding="utf-8")
    assert main(["up", "--port", "0", "--http-port", "0", "--insecure"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"killed `pdorch up` (pid {state.pid}) still runs (decode-0, redis)" in err
    assert err.endswith("run `pdorch down` first")
    assert path.read_text(encoding="utf-8") == written


def test_a_killed_pdorch_up_whose_orchestrator_is_gone_too_points_at_down(
    tmp_path: Path,
) -> None:
    """Its orchestrator exited, or its pid now names another process (a later start): no
    endpoint is offered, and `generate` failing to connect says what to run."""
    env = {"PDORCH_STATE": str(tmp_path / "up.json")}
    me = os.getpid()
    for orchestrator in ([_dead_pid(), 1], [me, started(me) + 1]):
        state = ClusterState(
            pid=_dead_pid(), orchestrator="127.0.0.1:7001", redis="redis://127.0.0.1:7002/0",
            procs={"orchestrator-0": orchestrator},
        )  # fmt: skip
        write_state(env, state)
        assert read_state(env) is None
        assert _endpoints(env) == (DEFAULT_ORCHESTRATOR, BUILTIN_REDIS)
        assert orphan_note(env, "127.0.0.1:7001") is None
        text = no_answer(env, DEFAULT_ORCHESTRATOR, "")
        assert f"(pid {state.pid}) is gone (killed)" in text
        assert "`pdorch down` stops what it left running" in text
    Path(env["PDORCH_STATE"]).unlink()
    assert "is `pdorch up` running?" in no_answer(env, DEFAULT_ORCHESTRATOR, "")


def test_the_state_file_round_trips_and_is_removed_only_by_its_owner(tmp_path: Path) -> None:
    env = {"PDORCH_STATE": str(tmp_path / "sub" / "up.json")}
    state = ClusterState(
        pid=os.getpid(), orchestrator="a:1", redis="redis://b:2/0", http="http://c:3/v1",
        metrics={"decode-0": "http://d:4/metrics"}, model="m", logs="/l",
    )  # fmt: skip
    write_state(env, state)
    assert read_state(env) == state
    remove_state(env, os.getpid() + 1)  # another `pdorch up`'s: kept
    assert read_state(env) == state
    remove_state(env, os.getpid())
    assert not Path(env["PDORCH_STATE"]).exists()


def _row(wid: str, role: str, active: int, used: int) -> WorkerRow:
    return WorkerRow(wid, role, f"127.0.0.1:{len(wid)}", "tiny", "cpu", active, used, 64 << 20)


def test_status_sums_each_pool_and_flags_an_empty_one() -> None:
    rows = (_row("decode-0", "decode", 2, 1 << 20), _row("decode-1", "decode", 1, 3 << 20))
    assert pools(rows) == {"decode": (2, 3, 4 << 20, 128 << 20)}
    snap = Snapshot("127.0.0.1:1", "SERVING", "redis://x:1/0", rows, in_flight=3)
    text = format_status(snap)
    assert "requests in flight: 3" in text
    assert "decode           2       3          4.0     128.0" in text
    assert "prefill          0       0          0.0       0.0   <- no worker alive" in text
    assert snap.healthy


@pytest.mark.parametrize(
    ("health", "rows", "healthy"),
    [("SERVING", (), False), ("UNREACHABLE", (_row("d", "decode", 0, 0),), False)],
)
def test_status_is_unhealthy_without_workers_or_a_serving_orchestrator(
    health: str, rows: tuple[WorkerRow, ...], healthy: bool
) -> None:
    assert Snapshot("a:1", health, "redis://x:1/0", rows, 0).healthy is healthy


def test_generate_prints_a_readable_finish_reason() -> None:
    line = finish_line("FINISH_REASON_EOS", 81.6, 3.94, 11264, "prefill-0 -> decode-0")
    assert line == (
        "[finished: end of sequence] ttft 82 ms, tpot 3.9 ms, kv 11,264 bytes, "
        "prefill-0 -> decode-0"
    )
    assert finish_line("FINISH_REASON_LENGTH", 1, 1, 0, "r").startswith(
        "[stopped: --max-tokens reached]"
    )


def test_a_start_failure_is_one_line_ending_in_the_log_folder() -> None:
    from orchestrator.cli.up import start_failure  # noqa: PLC0415

    tail = "Traceback (most recent call last):\n  File x\nOSError: [Errno 98] Address in use\n"
    line = start_failure(f"decode-1 exited with 1: {tail}", Path("/tmp/logs"))
    assert line == (
        "decode-1 exited with 1: OSError: [Errno 98] Address in use "
        "(every process's log: /tmp/logs)"
    )
    timeout = start_failure("timed out after 120.0s waiting for workers", Path("/l"))
    assert timeout == "timed out after 120.0s waiting for workers (every process's log: /l)"
