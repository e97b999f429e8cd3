"""A failed test's report carries the warnings and errors of the local clusters alive when it
failed (tests/conftest.py, `LocalCluster.problems`): CI keeps no cluster's log directory."""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import cluster as cluster_mod
from orchestrator.cluster import LocalCluster, Proc
from tests import conftest

LOG = """\
2026-12-05 10:52:53,521 INFO pdorch.worker decode worker ready
2026-12-05 10:52:54,002 WARNING transport.receiver refused a KV transfer from x: stale epoch
Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: boom
2026-12-05 10:52:55,000 INFO pdorch.worker request r1 done
"""


def _cluster(tmp_path: Path) -> LocalCluster:
    c = LocalCluster(model="tiny", workdir=tmp_path)
    log = tmp_path / "decode-0.log"
    log.write_text(LOG)
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    c.procs["decode-0"] = Proc("decode-0", popen, log)
    return c


def test_problems_lists_warnings_errors_and_the_last_lines(tmp_path: Path) -> None:
    text = _cluster(tmp_path).problems()
    assert "refused a KV transfer from x: stale epoch" in text
    assert "Traceback (most recent call last):" in text
    assert "ValueError: boom" in text
    assert "decode worker ready" not in text.split("last lines")[0]  # INFO is not flagged
    assert text.rstrip().endswith("request r1 done")  # the last lines follow


def _report(outcome: str, when: str) -> pytest.TestReport:
    return pytest.TestReport("t.py::t", ("t.py", 0, "t"), {}, outcome, None, when)  # type: ignore[arg-type]


def _run_hook(report: pytest.TestReport, started: float = 0.0) -> pytest.TestReport:
    call = pytest.CallInfo[None](None, None, started, started + 1, 1, "call", _ispytest=True)
    hook = conftest.pytest_runtest_makereport(None, call)  # type: ignore[arg-type]
    next(hook)
    with pytest.raises(StopIteration) as done:
        hook.send(report)
    result: pytest.TestReport = done.value.value
    return result


def test_a_failed_call_carries_the_live_clusters_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_mod, "_LIVE", [_cluster(tmp_path)])
    monkeypatch.setattr(cluster_mod, "_STOPPED", collections.deque(maxlen=4))  # others' tests
    failed = _run_hook(_report("failed", "call"))
    assert [name for name, _ in failed.sections] == ["cluster logs"]
    assert "stale epoch" in failed.sections[0][1]
    assert _run_hook(_report("passed", "call")).sections == []
    assert _run_hook(_report("failed", "setup")).sections == []  # start-up errors say it


def test_a_cluster_stopped_during_the_test_is_reported_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test's own ``with LocalCluster(...)`` block stops it before the report is made."""
    c = _cluster(tmp_path)
    monkeypatch.setattr(cluster_mod, "_LIVE", [c])
    monkeypatch.setattr(cluster_mod, "_STOPPED", collections.deque(maxlen=4))
    started = time.time()
    c.stop()
    assert cluster_mod.clusters_since(started) == [c]
    assert "stale epoch" in _run_hook(_report("failed", "call"), started).sections[0][1]
    assert _run_hook(_report("failed", "call"), time.time() + 60).sections == []  # before it
