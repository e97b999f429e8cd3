"""The placement ledger with its breakers (`orchestrator.control.ledger.Ledger`): pure enough
to drive with hand-made heartbeats and a hand-moved clock."""

from __future__ import annotations

from orchestrator.control.ledger import Ledger, breaker_key
from orchestrator.control.settings import ControlSettings
from orchestrator.core.admission import AdmissionPolicy
from orchestrator.core.breaker import BreakerState
from orchestrator.core.scheduler import Mode
from tests.unit.test_scheduler import decode, prefill

SETTINGS = ControlSettings(breaker_cooldown_s=2.0, admission=AdmissionPolicy(aggregate_below=0))


def test_two_probed_decode_workers_do_not_send_requests_to_prefill() -> None:
    """Issue 18, defect 2: both decode workers failed once (healthy, defect 1's collateral),
    then each got a probe; every later request ran "decode pool down: aggregated on prefill"
    until those probe streams ended, although both workers were alive."""
    ledger = Ledger(SETTINGS)
    workers = [prefill("p1"), decode("d1"), decode("d2")]
    for w in workers[1:]:
        ledger.breakers.failure(breaker_key(w), 0.0)
    probes = [ledger.place(workers, need=10, prefill_tokens=5, excluded=set(), now=3.0)]
    probes.append(ledger.place(workers, need=10, prefill_tokens=5, excluded=set(), now=3.0))
    assert {b.placement.decode.worker_id for b in probes} == {"d1", "d2"}
    assert ledger.breakers.blocked(3.0) == {breaker_key(w) for w in workers[1:]}  # probing

    third = ledger.place(workers, need=10, prefill_tokens=5, excluded=set(), now=3.1)
    assert third.placement.mode is Mode.DISAGGREGATED
    assert "pool down" not in third.placement.reason
    assert "half-open, probed again" in third.placement.reason


def test_a_probe_is_over_at_its_first_answer() -> None:
    ledger = Ledger(SETTINGS)
    workers = [prefill("p1"), decode("d1")]
    ledger.breakers.failure(breaker_key(workers[1]), 0.0)
    probe = ledger.place(workers, need=10, prefill_tokens=5, excluded=set(), now=3.0)
    assert ledger.breakers.held_back(3.0) == {breaker_key(workers[1]): BreakerState.HALF_OPEN}
    ledger.answered(probe, "p1")  # the prefill's reply closes only the prefill worker's
    assert ledger.breakers.held_back(3.0) == {breaker_key(workers[1]): BreakerState.HALF_OPEN}
    ledger.succeeded(probe)  # the first token: the stream goes on, the probe is over
    assert ledger.breakers.held_back(3.0) == {}
    nxt = ledger.place(workers, need=10, prefill_tokens=5, excluded=set(), now=3.1)
    assert "half-open" not in nxt.placement.reason
