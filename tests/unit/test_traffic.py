"""Traffic profiles and SLOs (`orchestrator.planning.traffic`): deterministic distributions."""

from __future__ import annotations

import math

import pytest

from orchestrator.errors import ConfigError
from orchestrator.planning.traffic import (
    Fixed,
    LogNormal,
    Slo,
    Traffic,
    Uniform,
    parse_length,
    quantile_grid,
    tokens_at,
)


@pytest.mark.parametrize(
    ("spec", "dist"),
    [
        (512, Fixed(512)),
        ("512", Fixed(512)),
        ("fixed:512", Fixed(512)),
        ("uniform:128:2048", Uniform(128, 2048)),
        ("LogNormal:1024:4096", LogNormal(1024, 4096)),
        ({"dist": "uniform", "low": 1, "high": 3}, Uniform(1, 3)),
        ({"dist": "lognormal", "median": 100, "p90": 400}, LogNormal(100, 400)),
    ],
)
def test_parse_length(spec: object, dist: object) -> None:
    assert parse_length(spec, "traffic.prompt") == dist


def test_uniform_mean_quantiles_and_grid() -> None:
    u = Uniform(100, 200)
    assert u.mean() == 150
    assert tokens_at(u, 0.9) == 190
    # four equally likely points at the quantiles 1/8, 3/8, 5/8, 7/8
    assert quantile_grid(u, 4) == [112, 138, 162, 188]


def test_lognormal_from_median_and_p90() -> None:
    d = LogNormal(1024, 4096)
    # sigma = ln(4096 / 1024) / z(0.9) = 1.386294 / 1.281552 = 1.081731
    assert d.sigma == pytest.approx(1.081731, rel=1e-6)
    # mean = median * exp(sigma^2 / 2) = 1024 * exp(0.585071) = 1838.2
    assert d.mean() == pytest.approx(1024 * math.exp(1.081731**2 / 2), rel=1e-6)
    assert round(d.mean()) == 1838
    assert tokens_at(d, 0.5) == 1024
    assert tokens_at(d, 0.9) == 4096
    grid = quantile_grid(d, 32)
    assert grid == sorted(grid)
    assert grid[15] < 1024 < grid[16]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lognormal:1024", "lognormal takes 2 number"),
        ("uniform:300:200", r"high \(200\) is below low \(300\)"),
        ("lognormal:1024:512", r"p90 \(512\) is below median \(1024\)"),
        ("zipf:1:2", "unknown distribution 'zipf'"),
        ("0", "must be a whole number of tokens >= 1"),
        ("abc", "must be a whole number of tokens"),
        (12.5, "must be a length spec"),
        ({"dist": "fixed"}, r"traffic\.prompt\.tokens: required for fixed"),
        ({"dist": "fixed", "tokens": 3, "low": 1}, r"traffic\.prompt\.low: unknown key"),
        ({"dist": "gamma"}, r"traffic\.prompt\.dist: must be one of"),
    ],
)
def test_bad_length_specs(spec: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_length(spec, "traffic.prompt")


def test_traffic_and_slo_validation() -> None:
    with pytest.raises(ConfigError, match=r"traffic\.rate: must be > 0"):
        Traffic(0.0, Fixed(10), Fixed(10))
    with pytest.raises(ConfigError, match=r"traffic\.output: must average at least 2"):
        Traffic(1.0, Fixed(10), Fixed(1))
    with pytest.raises(ConfigError, match=r"slo\.tpot_s: must be > 0"):
        Slo(1.0, -0.05)
    with pytest.raises(ConfigError, match=r"slo\.percentile: must be in \(0, 1\)"):
        Slo(1.0, 0.05, percentile=1.0)
