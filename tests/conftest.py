"""Shared by every test module: a failed test's report carries the warnings and errors of
the local clusters (`orchestrator.cluster.LocalCluster`) it ran on — alive when it failed,
or stopped since it began (its own ``with`` block) — their
worker and orchestrator logs live in a temporary directory a CI run does not keep, and a
failure in a cluster test is usually explained there (a refused transfer, a failover)."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator

import pytest

from orchestrator.ports import SLICE_ENV

# Each xdist worker (and every process its tests start) hands out its own slice of the
# ports (`orchestrator.ports.free_port`): two workers never pick the same port, even one
# the other's killed orchestrator is about to be restarted on.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    _COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault(SLICE_ENV, f"{int(_WORKER[2:]) % _COUNT}/{_COUNT}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    cluster = sys.modules.get("orchestrator.cluster")  # loaded only by tests that start one
    if report.failed and report.when == "call" and cluster is not None:
        for used in cluster.clusters_since(call.start):
            report.sections.append(("cluster logs", used.problems()))
    return report
