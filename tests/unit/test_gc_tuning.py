"""The orchestrator's collector tuning (`cli.gc_tuning`): start-up's objects frozen out of
the collector's sight, young collections rarer; 0 leaves CPython's collector alone."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from orchestrator.cli import gc_tuning
from orchestrator.cli.app import build_parser


@pytest.fixture
def restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored")
def test_tune_freezes_start_up_and_raises_the_young_threshold() -> None:
    gc.unfreeze()
    _, older, oldest = gc.get_threshold()
    gc_tuning.tune(12_345)
    assert gc.get_threshold() == (12_345, older, oldest)
    assert gc.get_freeze_count() > 1000  # every module, class and function loaded so far
    assert gc.isenabled()  # cycles are still collected


@pytest.mark.usefixtures("restored")
def test_zero_leaves_the_collector_as_it_is() -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    gc_tuning.tune(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_the_orchestrator_flag_defaults_to_the_tuned_threshold() -> None:
    parser = build_parser()
    args = parser.parse_args(["orchestrator", "--redis", "redis://127.0.0.1:1/0"])
    assert args.gc_threshold == gc_tuning.DEFAULT_THRESHOLD
    args = parser.parse_args(
        ["orchestrator", "--redis", "redis://127.0.0.1:1/0", "--gc-threshold", "0"]
    )
    assert args.gc_threshold == 0
