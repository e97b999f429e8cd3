"""QA of `pdorch bench`: bad arguments end in one line and exit 2, never a traceback or a
cluster started for nothing; figures labelled medians are medians."""

from __future__ import annotations

import argparse

import pytest

from orchestrator.bench import placement
from orchestrator.bench.control_plane import ControlPlaneBench
from orchestrator.cli.app import main
from orchestrator.cli.common import positive_ints
from orchestrator.errors import ConfigError
from transport import bench as transport_bench


@pytest.mark.parametrize(
    "flags",
    [
        ["--target", ""],
        ["--target", "127.0.0.1:1,,127.0.0.1:2"],
        ["--chunk-window-ms", "-1"],
        ["--chunk-window-ms", "5000"],
        ["--ramp-phase", "5"],
        ["--ramp-phase", "-0.5"],
        ["--offset", "-3"],
    ],
)
def test_bench_load_rejects_bad_flags_before_sending(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "load", "--requests", "1", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"argument {flags[0]}" in err


def test_a_negative_control_plane_warmup_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match="warmup"):
        ControlPlaneBench(workers=4, warmup=-5).check()


@pytest.mark.parametrize(
    ("size", "layers", "message"),
    [
        (1 << 10, 100_000, "at most 1024"),
        (1 << 10, 2000, "at most 1024"),
        (3, 4, "under 8 bytes per layer"),
    ],
)
def test_bench_transport_refuses_layers_the_wire_or_the_size_cannot_carry(
    size: int, layers: int, message: str
) -> None:
    with pytest.raises(transport_bench.BenchError, match=message):
        transport_bench.run("tcp", size, 1, layers, 1, nixl=False, only=["memory"])


def test_bench_transport_reports_an_unallocatable_size_as_a_bench_error() -> None:
    with pytest.raises(transport_bench.BenchError, match="cannot allocate"):
        transport_bench.run("tcp", 1 << 50, 1, 32, 1, nixl=False, only=["memory"])


def test_placement_rows_are_the_median_of_their_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([10.0, 20.0, 30.0, 50.0])  # scan, sampled, scan, sampled

    monkeypatch.setattr(placement, "_per_request_us", lambda *a: next(times))
    row = placement.run_bench([4], requests=1, rounds=2)["rows"][0]
    assert (row["us_per_request"], row["us_per_request_sampled"]) == (20.0, 35.0)


def test_a_list_of_counts_with_an_empty_entry_is_refused() -> None:
    assert positive_ints("1, 4,16") == (1, 4, 16)
    for text in ("1,,2", "", "4,", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
            positive_ints(text)
