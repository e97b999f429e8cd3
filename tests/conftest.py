"""Shared by every test module: a failed test's report carries the warnings and errors of
the local clusters (`orchestrator.cluster.LocalCluster`) it ran on — alive when it failed,
or stopped since it began (its own ``with`` block) — their
worker and orchestrator logs live in a temporary directory a CI run does not keep, and a
failure in a cluster test is usually explained there (a refused transfer, a failover)."""

from __future__ import annotations

import sys
from collections.abc import Generator

import pytest


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
