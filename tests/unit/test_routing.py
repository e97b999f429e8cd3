"""KV-cache-aware routing (`orchestrator.core.routing`) and its hook in `place`."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.control.ledger import Ledger
from orchestrator.control.settings import ControlSettings
from orchestrator.core.admission import Decision
from orchestrator.core.breaker import BreakerState
from orchestrator.core.prefix import block_keys, encode_keys
from orchestrator.core.records import WorkerInfo
from orchestrator.core.routing import (
    Hint,
    RoutingPolicy,
    pick_decode,
    pick_prefill,
    prefill_seconds,
)
from orchestrator.core.scheduler import Mode, place
from orchestrator.errors import OverloadedError, UnavailableError
from tests.unit.test_scheduler import decode, prefill

B = 4


def test_reused_never_covers_the_last_prompt_token() -> None:
    hint = Hint(100, {"a": 100, "b": 64, "c": 500})
    assert hint.reused("a") == 99
    assert hint.reused("b") == 64
    assert hint.reused("c") == 99
    assert hint.reused("nobody") == 0


def test_prefill_seconds_uses_the_rate_when_known() -> None:
    assert prefill_seconds(100, 300, 200.0) == 2.0
    assert prefill_seconds(100, 300, None) == 400.0


def test_prefill_goes_where_cached_tokens_outweigh_the_queue() -> None:
    p1, p2 = prefill("p1"), prefill("p2")
    hint = Hint(1000, {"p2": 800})
    # p2 has 500 queued but would compute only 200: 700 < 1000 + 0 on p1
    w, note = pick_prefill([(p1, 0), (p2, 0)], {"p2": 500}, {}, hint)
    assert w == p2
    assert note == "prefill reuses 800/1000 cached tokens"
    # with 900 queued it no longer pays
    w, note = pick_prefill([(p1, 0), (p2, 0)], {"p2": 900}, {}, hint)
    assert w == p1
    assert note == ""


def test_prefill_weighs_measured_rates() -> None:
    p1, p2 = prefill("p1"), prefill("p2")
    hint = Hint(1000, {"p2": 500})
    # p1 is 4x faster: 1000/400 = 2.5 s < 500/100 = 5 s
    w, _ = pick_prefill([(p1, 0), (p2, 0)], {}, {"p1": 400.0, "p2": 100.0}, hint)
    assert w == p1


def _fitting(*ws: tuple[str, int]) -> list[tuple[int, int, str, object]]:
    return [(active, -10_000, wid, decode(wid, active=active)) for wid, active in ws]


def test_decode_prefers_the_holder_within_the_slack() -> None:
    fitting = _fitting(("d1", 0), ("d2", 3))
    w, note = pick_decode(fitting, Hint(500, {"d2": 320}, decode_slack=4))  # type: ignore[arg-type]
    assert w.worker_id == "d2"
    assert note == "decode holds 320/500 prompt tokens"


def test_decode_holder_beyond_the_slack_loses_to_the_least_loaded() -> None:
    fitting = _fitting(("d1", 0), ("d2", 5))
    w, note = pick_decode(fitting, Hint(500, {"d2": 320}, decode_slack=4))  # type: ignore[arg-type]
    assert w.worker_id == "d1"
    assert note == ""


def test_decode_longest_holder_wins() -> None:
    fitting = _fitting(("d1", 0), ("d2", 1), ("d3", 1))
    w, _ = pick_decode(fitting, Hint(500, {"d2": 100, "d3": 300}))  # type: ignore[arg-type]
    assert w.worker_id == "d3"


# ----------------------------------------------------------------- the hook in place


def test_place_without_a_hint_is_unchanged() -> None:
    got = place([prefill("p1"), decode("d1"), decode("d2", active=1)], 100)
    assert got.decode.worker_id == "d1"
    assert got.reason == "both pools up"


def test_place_routes_and_explains() -> None:
    ws = [prefill("p1"), prefill("p2"), decode("d1"), decode("d2", active=1)]
    got = place(ws, 100, hint=Hint(64, {"p2": 48, "d2": 32}))
    assert got.mode is Mode.DISAGGREGATED
    assert got.prefill is not None
    assert got.prefill.worker_id == "p2"
    assert got.decode.worker_id == "d2"
    assert got.reason == (
        "both pools up; prefill reuses 48/64 cached tokens; decode holds 32/64 prompt tokens"
    )


def test_place_aggregated_by_choice_names_only_the_decode_reuse() -> None:
    ws = [prefill("p1"), decode("d1")]
    got = place(
        ws, 100, hint=Hint(64, {"p1": 48, "d1": 32}),
        decide=lambda p, d: Decision(True, "short prompt"),
    )  # fmt: skip
    assert got.mode is Mode.AGGREGATED
    assert got.reason == "short prompt; decode holds 32/64 prompt tokens"


def test_a_decode_holder_without_kv_room_is_never_chosen() -> None:
    ws = [prefill("p1"), decode("d1"), decode("d2", free=500)]  # d2: 500 < 100 * 10
    got = place(ws, 100, hint=Hint(64, {"d2": 60}))
    assert got.decode.worker_id == "d1"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10), st.integers(0, 2000)), min_size=1, max_size=5),
    st.integers(1, 2000),
)
def test_empty_hint_places_exactly_as_no_hint(decodes: list[tuple[int, int]], p: int) -> None:
    """Routing on with nothing reported (reference engines) changes no placement."""
    ws = [prefill("p1"), prefill("p2", active=1)]
    ws += [decode(f"d{i}", active=a, free=f * 10) for i, (a, f) in enumerate(decodes)]
    outcomes = []
    for hint in (None, Hint(p, {})):
        try:
            got = place(ws, 10, queue={"p1": p}, hint=hint)
            outcomes.append((got.mode, got.prefill, got.decode.worker_id, got.reason))
        except (OverloadedError, UnavailableError) as exc:
            outcomes.append((type(exc).__name__, None, "", ""))
    assert outcomes[0] == outcomes[1]


# ------------------------------------------------------- the ledger: heartbeats in


def _reporting(w: WorkerInfo, tokens: list[int]) -> WorkerInfo:
    return replace(w, kv_block_size=B, kv_prefix=encode_keys(block_keys(tokens, B)))


def test_ledger_routes_turn_two_to_the_worker_holding_turn_one() -> None:
    turn1 = list(range(100, 164))  # 16 blocks of 4
    turn2 = [*turn1, *range(300, 320)]
    ws = [
        prefill("p1"),
        _reporting(prefill("p2"), turn1),
        decode("d1"),
        _reporting(decode("d2", active=2), turn1),
    ]
    booking = Ledger(ControlSettings()).place(
        ws, need=200, prefill_tokens=len(turn2), excluded=set(), now=0.0, tokens=turn2
    )
    placement = booking.placement
    assert placement.prefill is not None
    assert (placement.prefill.worker_id, placement.decode.worker_id) == ("p2", "d2")
    assert placement.reason.endswith(
        "; prefill reuses 64/84 cached tokens; decode holds 64/84 prompt tokens"
    )


def test_ledger_with_routing_off_ignores_reports() -> None:
    turn1 = list(range(100, 164))
    ws = [prefill("p1"), _reporting(prefill("p2"), turn1), decode("d1")]
    off = ControlSettings(routing=RoutingPolicy(enabled=False))
    booking = Ledger(off).place(
        ws, need=200, prefill_tokens=70, excluded=set(), now=0.0, tokens=[*turn1, 1, 2, 3]
    )
    assert booking.placement.prefill is not None
    assert booking.placement.prefill.worker_id == "p1"
    assert "cached" not in booking.placement.reason


def test_ledger_forgets_a_worker_whose_heartbeat_is_gone() -> None:
    turn1 = list(range(100, 164))
    ledger = Ledger(ControlSettings())
    holder = _reporting(prefill("p2"), turn1)
    ledger.place([prefill("p1"), holder, decode("d1")], need=200, prefill_tokens=70,
                 excluded=set(), now=0.0, tokens=[*turn1, 1])  # fmt: skip
    assert ledger.prefixes.workers() == {"p2"}
    ledger.place([prefill("p1"), decode("d1")], need=200, prefill_tokens=70,
                 excluded=set(), now=0.0, tokens=[*turn1, 1])  # fmt: skip
    assert ledger.prefixes.workers() == set()
    assert len(ledger.prefixes) == 0


def test_the_prefill_queue_counts_only_uncached_tokens() -> None:
    """p2 holds 64 of 65 tokens: it queues 1 token of work, not 65 (what admission and
    the next placements weigh)."""
    turn1 = list(range(100, 164))
    ws = [prefill("p1"), _reporting(prefill("p2"), turn1), decode("d1")]
    booking = Ledger(ControlSettings()).place(
        ws, need=200, prefill_tokens=65, excluded=set(), now=0.0, tokens=[*turn1, 1]
    )
    assert booking.queued == ("p2", 1)


def test_a_prefix_never_outranks_a_breaker() -> None:
    """Routing orders workers within a breaker tier: a half-open holder of the prefix loses
    to a closed worker that holds nothing; among closed ones the holder wins."""
    ws = [prefill("p1"), prefill("p2"), decode("d1"), decode("d2")]
    hint = Hint(64, {"p2": 48, "d2": 32})
    held = {"p2": BreakerState.HALF_OPEN, "d2": BreakerState.HALF_OPEN}
    got = place(ws, 100, hint=hint, held_back=held)
    assert (got.prefill.worker_id if got.prefill else None, got.decode.worker_id) == ("p1", "d1")
    assert "reuses" not in got.reason
    assert "holds" not in got.reason
    got = place(ws, 100, hint=hint, held_back={"p1": BreakerState.HALF_OPEN})
    assert (got.prefill.worker_id if got.prefill else None, got.decode.worker_id) == ("p2", "d2")
