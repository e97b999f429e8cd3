"""`pdorch bench transport`'s report and its NIXL reference switch (no transfers run)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from transport import bench, nixl_ref, testing
from transport.ucx import ucx_available


def _result(**gbps: float) -> bench.BenchResult:
    return bench.BenchResult("ucx", 1 << 20, 10, 32, dict(gbps))


def test_the_report_compares_ours_with_the_best_nixl_variant() -> None:
    r = _result(ours=2.0, **{"nixl-write": 1.0, "nixl-read": 4.0, "ucx_perftest": 8.0})
    assert r.best_nixl == 4.0
    assert r.ratio("ours", "ucx_perftest") == 0.25
    line = r.human()
    assert "ours 2.00 GB/s (524 µs)" in line
    assert line.endswith("ours/best NIXL 0.50")
    assert json.loads(r.json())["gbps"]["nixl-read"] == 4.0


def test_a_small_transfers_figure_keeps_its_digits_and_shows_its_latency() -> None:
    gbps = bench.medians({"ours": [0.0041, 0.004567, 0.0049], "nixl-read": [0.2048]})
    assert gbps == {"ours": 0.004567, "nixl-read": 0.2048}
    line = bench.BenchResult("ucx", 4096, 10, 32, gbps).human()
    assert "ours 0.00 GB/s (897 µs)" in line
    assert "nixl-read 0.20 GB/s (20 µs)" in line


def test_without_nixl_the_report_says_nothing_of_it() -> None:
    r = _result(ours=2.0, ucx_perftest=8.0)
    assert r.best_nixl is None
    assert r.ratio("ours", "nixl-read") is None
    assert "NIXL" not in r.human()


def test_asking_for_nixl_where_it_is_missing_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nixl_ref, "nixl_available", lambda: False)
    with pytest.raises(bench.BenchError, match="NIXL is not installed"):
        bench.run("tcp", 1 << 20, 1, nixl=True)


@pytest.mark.slow  # NIXL agents in processes of their own, and ours (make test installs NIXL)
@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason="no ucxx")
@pytest.mark.skipif(not nixl_ref.nixl_available(), reason="NIXL is not installed (make nixl)")
def test_nixl_is_timed_beside_ours_in_the_same_run() -> None:
    """The reference the README's transport table compares with: NIXL's four variants (READ
    and WRITE, one buffer and 32 descriptors) each move the bytes and time them, in the
    run that times ours, and the report puts ours against the best of them."""
    result = bench.run("ucx", 1 << 20, 2, rounds=1, nixl=True, only=["ours", "nixl"])
    variants = ("nixl-write", "nixl-read", "nixl-write-32", "nixl-read-32")
    assert set(result.gbps) == {"ours", *variants}, result.gbps
    assert all(result.gbps[v] > 0 for v in variants), result.gbps
    assert result.best_nixl == max(result.gbps[v] for v in variants)
    assert "ours/best NIXL" in result.human()


def test_bad_counts_are_refused_before_anything_starts() -> None:
    with pytest.raises(bench.BenchError, match="at least 1"):
        bench.run("tcp", 1 << 20, 0, nixl=False)


def test_a_tls_directory_without_certificates_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(bench.BenchError, match=r"ca\.pem is missing"):
        bench.run("tcp", 1 << 20, 1, nixl=False, tls_dir=str(tmp_path))


def test_the_memory_references_copy_and_hash_the_buffer() -> None:
    src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    copy, xxh3 = bench.memory_speeds(src, dst, iters=3)
    assert np.array_equal(dst, src)  # a real copy was timed
    assert copy > 0
    assert xxh3 > 0
    line = _result(ours=2.0, copy=copy, xxh3=xxh3).human()
    assert " copy " in line
    assert " xxh3 " in line


def test_the_memory_references_refuse_unequal_buffers() -> None:
    with pytest.raises(bench.BenchError, match="same, non-zero size"):
        bench.memory_speeds(np.zeros(8, np.uint8), np.zeros(4, np.uint8), iters=1)


def test_only_names_what_exists_and_what_this_run_can_time() -> None:
    with pytest.raises(bench.BenchError, match="choose from ours, ours-tls"):
        bench.run("tcp", 1 << 20, 1, nixl=False, only=["ours", "bogus"])
    with pytest.raises(bench.BenchError, match="needs --tls-dir"):
        bench.run("tcp", 1 << 20, 1, nixl=False, only=["ours-tls"])
    with pytest.raises(bench.BenchError, match="--backend ucx"):
        bench.run("tcp", 1 << 20, 1, nixl=False, only=["ours-read"])
    with pytest.raises(bench.BenchError, match="ours-read-paged: one-sided, --backend ucx"):
        bench.run("tcp", 1 << 20, 1, nixl=False, only=["ours-read-paged"])


def test_a_report_without_ours_has_no_ratio_to_nixl() -> None:
    line = _result(**{"ours-read": 2.0, "nixl-read": 4.0}).human()
    assert "ours-read 2.00 GB/s" in line
    assert "ours/best NIXL" not in line


@pytest.mark.slow  # starts a receiver process and moves KV over tcp (make test runs it)
def test_only_times_just_the_variants_named() -> None:
    result = bench.run("tcp", 64 << 10, 3, layers=4, rounds=1, nixl=False, only=["ours-32"])
    assert list(result.gbps) == ["ours-32"]
    assert result.gbps["ours-32"] > 0


def test_a_paged_kv_is_the_caches_bytes_in_pieces_apart() -> None:
    """`ours-read-paged`'s layout (`transport.testing.paged`): per layer, K's and V's
    pieces concatenate to that tensor's bytes; each piece lies in the pool, none touches
    or overlaps another."""
    cache = testing.synthetic_cache("p", 1, 1 << 20, n_layers=4)
    paged = testing.paged(cache, 32 << 10)
    base = paged.pool.ctypes.data
    spans = []
    for (k, v), (kk, vv) in zip(cache.layers, paged.layers, strict=True):
        for tensor, pieces in ((k, kk), (v, vv)):
            assert b"".join(bytes(p) for p in pieces) == tensor.tobytes()
            assert all(p.nbytes <= 32 << 10 for p in pieces)
            for p in pieces:
                start = np.frombuffer(p, np.uint8).ctypes.data - base
                assert start >= 0
                assert start + p.nbytes <= paged.pool.nbytes
                spans.append((start, start + p.nbytes))
    spans.sort()
    assert all(end < nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


@pytest.mark.slow  # starts a receiver process and moves KV over UCX (make test runs it)
@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason="no ucxx")
def test_the_paged_variant_sends_layer_by_layer_and_lands() -> None:
    """`--only ours-read-paged`: each transfer is confirmed by the receiver (the bench
    raises otherwise), so a layout or send the receiver refuses fails here."""
    result = bench.run("ucx", 256 << 10, 3, rounds=1, nixl=False, only=["ours-read-paged"])
    assert list(result.gbps) == ["ours-read-paged"]
    assert result.gbps["ours-read-paged"] > 0
