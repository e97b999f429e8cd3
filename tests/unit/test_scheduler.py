"""Placement (`orchestrator.core.scheduler.place`) on small, hand-computed worker sets.

KV need is ``total_tokens * kv_bytes_per_token`` of the candidate worker; headroom is
``kv_capacity_bytes - kv_used_bytes`` (never below zero).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from orchestrator.core.admission import Decision
from orchestrator.core.breaker import BreakerState
from orchestrator.core.records import WorkerInfo
from orchestrator.core.scheduler import Mode, place, reaches, with_local_load
from orchestrator.errors import OverloadedError, UnavailableError


def worker(
    worker_id: str,
    role: str,
    *,
    active: int = 0,
    capacity: int = 10_000,
    used: int = 0,
    per_token: int = 10,
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        address=f"{worker_id}:50051",
        kv_address=f"{worker_id}:6000" if role == "decode" else "",
        transport="tcp",
        model="tiny",
        fingerprint="f",
        max_context=4096,
        vocab_size=32_000,
        kv_bytes_per_token=per_token,
        kv_capacity_bytes=capacity,
        kv_used_bytes=used,
        active=active,
    )


def prefill(worker_id: str, active: int = 0) -> WorkerInfo:
    return worker(worker_id, "prefill", active=active)


def decode(
    worker_id: str, *, free: int = 10_000, active: int = 0, per_token: int = 10
) -> WorkerInfo:
    return worker(worker_id, "decode", active=active, capacity=free, per_token=per_token)


# ------------------------------------------------------------------ disaggregated


def test_both_pools_up_is_disaggregated() -> None:
    p, d = prefill("p1"), decode("d1")
    got = place([p, d], 100)
    assert got.mode is Mode.DISAGGREGATED
    assert got.prefill == p
    assert got.decode == d


def test_prefill_goes_to_the_least_loaded() -> None:
    workers = [prefill("p1", active=3), prefill("p2", active=1), prefill("p3", active=2)]
    got = place([*workers, decode("d1")], 10)
    assert got.prefill is not None
    assert got.prefill.worker_id == "p2"


def test_prefill_tie_goes_to_the_smallest_id() -> None:
    got = place([prefill("p-b", active=1), prefill("p-a", active=1), decode("d1")], 10)
    assert got.prefill is not None
    assert got.prefill.worker_id == "p-a"


def test_decode_goes_to_the_most_kv_headroom() -> None:
    decodes = [decode("d1", free=1_000), decode("d2", free=5_000), decode("d3", free=3_000)]
    assert place([prefill("p1"), *decodes], 10).decode.worker_id == "d2"


def test_headroom_counts_used_bytes() -> None:
    # d1: 10 000 - 7 000 = 3 000 free; d2: 6 000 - 2 000 = 4 000 free.
    d1 = worker("d1", "decode", capacity=10_000, used=7_000)
    d2 = worker("d2", "decode", capacity=6_000, used=2_000)
    assert place([prefill("p1"), d1, d2], 10).decode.worker_id == "d2"


def test_overcommitted_worker_has_zero_headroom() -> None:
    # used > capacity clamps to 0 free, so even a 1-token request cannot go there.
    full = worker("d1", "decode", capacity=1_000, used=1_500)
    assert full.kv_free_bytes == 0
    with pytest.raises(OverloadedError):
        place([prefill("p1"), full], 1)


def test_decode_tie_on_headroom_goes_to_fewer_active() -> None:
    decodes = [decode("d1", free=4_000, active=3), decode("d2", free=4_000, active=1)]
    assert place([prefill("p1"), *decodes], 10).decode.worker_id == "d2"


def test_fewer_active_beats_headroom() -> None:
    """A decode step's time grows with the batch: the idle worker keeps every TPOT lower,
    as long as it has room for the request."""
    decodes = [decode("d1", free=9_000, active=10), decode("d2", free=4_000, active=0)]
    assert place([prefill("p1"), *decodes], 10).decode.worker_id == "d2"


def test_prefill_goes_to_the_shortest_queue_in_tokens() -> None:
    workers = [prefill("p1"), prefill("p2"), decode("d1")]
    got = place(workers, 10, queue={"p1": 900, "p2": 100})
    assert got.prefill is not None
    assert got.prefill.worker_id == "p2"


def test_prefill_queue_is_weighed_by_measured_rate() -> None:
    """p1 has more tokens queued but clears them faster (900 / 9000 = 0.1 s < 300 / 1000)."""
    workers = [prefill("p1"), prefill("p2"), decode("d1")]
    got = place(workers, 10, queue={"p1": 900, "p2": 300}, rates={"p1": 9000, "p2": 1000})
    assert got.prefill is not None
    assert got.prefill.worker_id == "p1"


def test_decide_can_keep_a_request_on_the_decode_worker() -> None:
    seen: list[tuple[str, str]] = []

    def decide(p: WorkerInfo, d: WorkerInfo) -> Decision:
        seen.append((p.worker_id, d.worker_id))
        return Decision(True, "short prompt")

    got = place([prefill("p1"), decode("d1")], 10, decide=decide)
    assert (got.mode, got.prefill, got.decode.worker_id, got.reason) == (
        Mode.AGGREGATED, None, "d1", "short prompt"
    )  # fmt: skip
    assert seen == [("p1", "d1")]
    kept = place([prefill("p1"), decode("d1")], 10, decide=lambda p, d: Decision(False, "long"))
    assert (kept.mode, kept.reason) == (Mode.DISAGGREGATED, "long")


def test_kv_need_uses_each_workers_bytes_per_token() -> None:
    # 50 tokens: d1 needs 50 * 200 = 10 000 > 9 000 free (no room, despite most headroom);
    # d2 needs 50 * 100 = 5 000 == 5 000 free (exactly fits); d3 has less headroom.
    decodes = [
        decode("d1", free=9_000, per_token=200),
        decode("d2", free=5_000, per_token=100),
        decode("d3", free=4_000, per_token=1),
    ]
    assert place([prefill("p1"), *decodes], 50).decode.worker_id == "d2"


@pytest.mark.parametrize(("tokens", "fits"), [(100, True), (101, False)])
def test_kv_need_boundary(tokens: int, fits: bool) -> None:
    workers = [prefill("p1"), decode("d1", free=1_000, per_token=10)]
    if fits:
        assert place(workers, tokens).decode.worker_id == "d1"
    else:
        with pytest.raises(OverloadedError):
            place(workers, tokens)


def test_no_decode_worker_with_room_is_overloaded() -> None:
    workers = [prefill("p1"), decode("d1", free=999), decode("d2", free=500)]
    with pytest.raises(OverloadedError) as info:
        place(workers, 100)  # needs 1 000 bytes on either
    assert info.value.retryable
    assert info.value.retry_after_s == 1.0


# ------------------------------------------------------------------ missing pools


def test_prefill_pool_down_runs_aggregated_on_decode() -> None:
    decodes = [decode("d1", free=2_000), decode("d2", free=8_000)]
    got = place(decodes, 100, fallback="local")
    assert got.mode is Mode.AGGREGATED
    assert got.prefill is None
    assert got.decode.worker_id == "d2"


def test_prefill_pool_down_with_fail_fallback_is_unavailable() -> None:
    with pytest.raises(UnavailableError, match="prefill pool"):
        place([decode("d1")], 100, fallback="fail")


def test_decode_pool_down_runs_aggregated_on_least_loaded_prefill() -> None:
    prefills = [prefill("p1", active=4), prefill("p2", active=0), prefill("p3", active=2)]
    got = place(prefills, 100, fallback="local")
    assert got.mode is Mode.AGGREGATED
    assert got.prefill is None
    assert got.decode.worker_id == "p2"


def test_decode_pool_down_with_fail_fallback_is_unavailable() -> None:
    with pytest.raises(UnavailableError, match="decode pool"):
        place([prefill("p1")], 100, fallback="fail")


@pytest.mark.parametrize("fallback", ["local", "fail"])
def test_no_workers_is_unavailable(fallback: str) -> None:
    with pytest.raises(UnavailableError, match="no workers"):
        place([], 100, fallback=fallback)


def test_workers_of_unknown_role_are_not_candidates() -> None:
    with pytest.raises(UnavailableError, match="no workers"):
        place([worker("x1", "router")], 10)


def test_default_fallback_is_local() -> None:
    assert place([decode("d1")], 10).mode is Mode.AGGREGATED


# ------------------------------------------------------------------ exclude


def test_exclude_skips_the_best_decode() -> None:
    decodes = [decode("d1", free=9_000), decode("d2", free=5_000)]
    got = place([prefill("p1"), *decodes], 10, exclude=["d1"])
    assert got.decode.worker_id == "d2"


def test_exclude_skips_the_least_loaded_prefill() -> None:
    workers = [prefill("p1", active=0), prefill("p2", active=5), decode("d1")]
    got = place(workers, 10, exclude={"p1"})
    assert got.prefill is not None
    assert got.prefill.worker_id == "p2"


def test_excluding_every_prefill_falls_back_to_aggregated() -> None:
    workers = [prefill("p1"), prefill("p2"), decode("d1")]
    got = place(workers, 10, exclude=(w for w in ["p1", "p2"]))  # any iterable, even one-shot
    assert got.mode is Mode.AGGREGATED
    assert got.decode.worker_id == "d1"


def test_excluding_every_decode_falls_back_to_aggregated_on_prefill() -> None:
    got = place([prefill("p1"), decode("d1")], 10, exclude=["d1"])
    assert got.mode is Mode.AGGREGATED
    assert got.decode.worker_id == "p1"


def test_excluding_everyone_is_unavailable() -> None:
    with pytest.raises(UnavailableError):
        place([prefill("p1"), decode("d1")], 10, exclude=["p1", "d1"])


def test_excluding_the_only_decode_with_room_is_overloaded() -> None:
    decodes = [decode("d1", free=5_000), decode("d2", free=100)]
    with pytest.raises(OverloadedError):
        place([prefill("p1"), *decodes], 100, exclude=["d1"])  # d2 needs 1 000, has 100


def test_local_load_spreads_a_burst_the_heartbeats_have_not_seen() -> None:
    """Heartbeats lag: two identical decode workers, and this replica already placed a
    request on decode-b. The next goes to decode-a, though heartbeats still show both idle."""
    workers = [prefill("p"), decode("decode-a"), decode("decode-b")]
    first = place(workers, 100)
    assert first.decode.worker_id == "decode-a"  # tie on active and headroom: smaller id
    need = 100 * first.decode.kv_bytes_per_token
    second = place(workers, 100, load={"decode-a": (1, need)})
    assert second.decode.worker_id == "decode-b"


def test_local_load_is_a_lower_bound_not_added_to_heartbeats() -> None:
    """When the heartbeat already shows more than this replica placed, it is used as is."""
    busy = worker("decode-a", "decode", used=5000, active=2)
    assert with_local_load(busy, {"decode-a": (1, 100)}) is busy
    raised = with_local_load(busy, {"decode-a": (3, 9000)})
    assert (raised.active, raised.kv_used_bytes) == (3, 9000)


# ------------------------------------------------------- breakers are advice (issue 18)

HALF, OPEN = BreakerState.HALF_OPEN, BreakerState.OPEN


def test_a_closed_decode_worker_is_preferred_to_a_half_open_one() -> None:
    got = place([prefill("p1"), decode("d1"), decode("d2", active=5)], 10, held_back={"d1": HALF})
    assert got.decode.worker_id == "d2"
    assert got.reason == "both pools up"


def test_decode_workers_all_probing_are_not_a_pool_down() -> None:
    """Issue 18, defect 2: every decode worker half-open with a probe in flight fell back to
    "decode pool down: aggregated on prefill" while both were alive."""
    got = place(
        [prefill("p1"), decode("d1", active=1), decode("d2")],
        10,
        held_back={"d1": HALF, "d2": HALF},
    )
    assert got.mode is Mode.DISAGGREGATED
    assert got.decode.worker_id == "d2"
    assert "pool down" not in got.reason
    assert "decode d2 half-open, probed again" in got.reason


def test_decode_breakers_all_open_aggregate_on_prefill_and_say_so() -> None:
    got = place([prefill("p1"), decode("d1"), decode("d2")], 10, held_back={"d1": OPEN, "d2": OPEN})
    assert (got.mode, got.decode.worker_id) == (Mode.AGGREGATED, "p1")
    assert got.reason == (
        "every decode worker's breaker is open (all just failed): aggregated on prefill"
    )


def test_prefill_breakers_all_open_aggregate_on_decode_and_say_so() -> None:
    got = place([prefill("p1"), decode("d1")], 10, held_back={"p1": OPEN})
    assert (got.mode, got.decode.worker_id) == (Mode.AGGREGATED, "d1")
    assert got.reason.startswith("every prefill worker's breaker is open")


def test_an_open_decode_pool_is_used_when_fallback_is_fail() -> None:
    got = place([prefill("p1"), decode("d1")], 10, fallback="fail", held_back={"d1": OPEN})
    assert got.mode is Mode.DISAGGREGATED
    assert "decode d1's breaker open, placed anyway" in got.reason


def test_both_pools_open_still_disaggregate() -> None:
    got = place([prefill("p1"), decode("d1")], 10, held_back={"p1": OPEN, "d1": OPEN})
    assert got.mode is Mode.DISAGGREGATED
    assert "prefill p1's breaker open" in got.reason
    assert "decode d1's breaker open" in got.reason


def test_pool_down_means_no_live_worker() -> None:
    got = place([prefill("p1")], 10)
    assert got.reason == "decode pool down: no live decode worker: aggregated on prefill"


def test_a_decode_pool_that_failed_this_request_is_named_so() -> None:
    got = place([prefill("p1"), decode("d1"), decode("d2")], 10, exclude={"d1", "d2"})
    assert got.mode is Mode.AGGREGATED
    assert got.reason == (
        "decode pool unusable: its live workers failed this request (d1, d2): aggregated on prefill"
    )


def test_a_half_open_decode_worker_with_room_beats_a_full_closed_one() -> None:
    got = place([prefill("p1"), decode("d1", free=50), decode("d2")], 100, held_back={"d2": HALF})
    assert got.decode.worker_id == "d2"


# ------------------------------------------------------------------ KV transport pairing


def on(w: WorkerInfo, transport: str) -> WorkerInfo:
    return replace(w, transport=transport)


def test_a_decode_worker_no_prefill_worker_reaches_is_left_out() -> None:
    """A tcp decode worker among UCX ones (a misconfigured --transport) gets no P/D request,
    though it is the least loaded: its transfers would all fail and be re-prefilled."""
    p = on(prefill("p1"), "ucx")
    wrong = on(decode("d0", free=50_000), "tcp")
    right = on(decode("d1", active=3), "ucx")
    got = place([p, wrong, right], 100)
    assert got.mode is Mode.DISAGGREGATED
    assert got.decode.worker_id == "d1"


def test_prefill_workers_are_paired_with_a_decode_worker_that_takes_their_kv() -> None:
    """ucx-read and ucx senders both reach a UCX receiver; a tcp sender does not."""
    tcp_p = on(prefill("p0"), "tcp")  # least loaded by id, but it cannot reach d1
    ucx_p = on(prefill("p1", active=2), "ucx")
    d = on(decode("d1"), "ucx")
    got = place([tcp_p, ucx_p, d], 100)
    assert got.mode is Mode.DISAGGREGATED
    assert got.prefill is not None
    assert got.prefill.worker_id == "p1"


@pytest.mark.parametrize("fallback", ["local", "fail"])
def test_no_pair_can_move_kv_runs_aggregated_with_the_reason(fallback: str) -> None:
    p, d = on(prefill("p1"), "tcp"), on(decode("d1"), "ucx")
    if fallback == "fail":
        with pytest.raises(UnavailableError, match="KV transport reaches"):
            place([p, d], 100, fallback=fallback)
        return
    got = place([p, d], 100, fallback=fallback)
    assert got.mode is Mode.AGGREGATED
    assert got.decode.worker_id == "d1"
    assert "no prefill worker's KV transport reaches a decode worker" in got.reason


def test_a_worker_publishing_no_transport_is_assumed_to_match() -> None:
    p, d = on(prefill("p1"), ""), on(decode("d1"), "tcp")
    assert place([p, d], 100).mode is Mode.DISAGGREGATED


def test_pairing_by_transport_is_pairing_worker_by_worker() -> None:
    """Placement asks `reaches` once per transport, not per pair of workers: for every mix
    of transports (published or not), the decode workers it keeps and the prefill workers
    it pairs with the chosen one are exactly those some pair of workers reaches."""
    kinds = ["", "ucx", "ucx-read", "tcp"]
    rng = random.Random(7)
    outcomes = {"placed": 0, "unpaired": 0}
    for _ in range(300):
        prefills = [on(prefill(f"p{i}"), rng.choice(kinds)) for i in range(rng.randint(1, 4))]
        decodes = [
            on(decode(f"d{i}", active=i), rng.choice(kinds)) for i in range(rng.randint(1, 4))
        ]
        paired = [d for d in decodes if any(reaches(p, d) for p in prefills)]
        try:
            got = place([*prefills, *decodes], 100, fallback="fail")
        except UnavailableError:
            assert not paired
            outcomes["unpaired"] += 1
            continue
        outcomes["placed"] += 1
        assert got.mode is Mode.DISAGGREGATED
        assert got.decode.worker_id == min(paired, key=lambda d: d.active).worker_id
        assert got.prefill is not None
        senders = [p for p in prefills if reaches(p, got.decode)]
        assert got.prefill.worker_id == min(p.worker_id for p in senders)
    assert min(outcomes.values()) >= 10, outcomes  # both ways drawn often
