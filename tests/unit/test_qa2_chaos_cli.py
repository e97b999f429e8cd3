"""QA pass 2 on `pdorch chaos run`: Ctrl-C reports the phase as interrupted (not failed), a
refusal comes before the run's announcement, and ``--out`` naming a file is a clear error."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path

import pytest

from orchestrator.chaos import runner as runner_mod
from orchestrator.chaos.scenario import load, shipped
from orchestrator.cli import main
from orchestrator.cli.progress import Progress


def test_ctrl_c_during_a_chaos_phase_says_interrupted_and_still_stops_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT under `asyncio.run` (as `pdorch chaos run` runs): asyncio turns it into
    the main task's cancellation, which the phase sees as `CancelledError`."""
    stream = io.StringIO()
    scenario = load(str(shipped()["decode-kill"]))
    r = runner_mod.ChaosRunner(
        scenario, out_dir=tmp_path, pictures=False, steps=Progress(stream=stream).step
    )
    closed: list[bool] = []

    async def start() -> list[str]:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the cluster starts
        await asyncio.sleep(30)  # cancelled by the SIGINT long before
        return []

    async def close() -> None:
        closed.append(True)

    monkeypatch.setattr(r, "_start", start)
    monkeypatch.setattr(r, "_close", close)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(r.run())
    text = stream.getvalue()
    assert "decode-kill: cluster up (starting): interrupted in" in text
    assert "FAILED" not in text
    assert "decode-kill: stopping the cluster: done in" in text
    assert closed == [True]


def test_a_cancelled_step_says_interrupted() -> None:
    out = io.StringIO()
    with pytest.raises(asyncio.CancelledError), Progress(stream=out).step("reference run"):
        raise asyncio.CancelledError
    assert "reference run: interrupted in " in out.getvalue()


ANNOUNCED = "run(s) on a fresh local cluster"


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDORCH_REDIS_URL", "PDORCH_REDIS_URL_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_env")
def test_a_scenario_refusing_redis_is_refused_before_the_run_is_announced(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Nothing is started: the refusal comes from the options alone (no Redis is contacted,
    the URL's port 1 has nothing behind it)."""
    rc = main(["chaos", "run", "redis-restart", "--redis", "redis://127.0.0.1:1/0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "scenario redis-restart faults Redis: not with --redis" in err
    assert ANNOUNCED not in err


@pytest.mark.usefixtures("no_env")
def test_out_naming_a_file_is_refused_as_not_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    rc = main(["chaos", "run", "decode-kill", "--out", str(afile)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"pdorch chaos: --out {afile}: must be a folder, and it is a file" in err
    assert "Errno" not in err
    assert ANNOUNCED not in err
    assert afile.read_text() == ""  # left as it was


@pytest.mark.usefixtures("no_env")
def test_out_under_a_file_is_refused_as_not_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "sub"
    rc = main(["chaos", "run", "decode-kill", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"pdorch chaos: --out {out}: must be a folder, and cannot be created: " in err
    assert ANNOUNCED not in err


@pytest.mark.usefixtures("no_env")
def test_out_is_created_when_missing(tmp_path: Path) -> None:
    """The check's side: a missing folder is made (the runner writes into it)."""
    from orchestrator.cli.chaos import _out_folder  # noqa: PLC0415

    _out_folder(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
