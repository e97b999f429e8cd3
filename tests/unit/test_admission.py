"""Admission (early rejection, bounded queues, SLO estimate) and conditional disaggregation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.core.admission import (
    AUTO_CAP_TOKENS,
    AdmissionPolicy,
    PrefillQueue,
    admit,
    disaggregate_or_not,
    parse_aggregate_below,
    parse_tenant_limits,
)
from orchestrator.core.rates import TransferModel
from orchestrator.errors import ConfigError, OverloadedError


def q(wid: str, requests: int = 0, tokens: int = 0, rate: float | None = 1000.0) -> PrefillQueue:
    return PrefillQueue(wid, requests, tokens, rate)


def test_within_the_slo_is_admitted_with_its_estimate() -> None:
    got = admit(100, [q("p1", 1, 400)], 0.05, AdmissionPolicy(ttft_slo_s=1.0), inflight=0)
    assert got.ttft_estimate_s == pytest.approx(0.4 + 0.1 + 0.05)


def test_the_best_worker_sets_the_estimate() -> None:
    queues = [q("p1", 3, 3000), q("p2", 1, 200, rate=2000.0)]
    got = admit(200, queues, 0.0, AdmissionPolicy(ttft_slo_s=1.0), inflight=0)
    assert got.ttft_estimate_s == pytest.approx(0.2)  # p2: (200 + 200) / 2000


def test_a_missed_slo_is_refused_with_a_retry_after() -> None:
    policy = AdmissionPolicy(ttft_slo_s=0.5)
    with pytest.raises(OverloadedError, match="exceeds the SLO") as exc:
        admit(100, [q("p1", 4, 900)], 0.0, policy, inflight=0)  # 0.9 + 0.1 = 1.0 s
    assert exc.value.retry_after_s == pytest.approx(0.5)  # 1.0 - 0.5: the queue must drain


def test_a_prompt_too_long_for_the_slo_on_an_empty_queue_is_still_admitted() -> None:
    got = admit(5000, [q("p1")], 0.0, AdmissionPolicy(ttft_slo_s=1.0), inflight=0)
    assert got.ttft_estimate_s == pytest.approx(5.0)
    assert "best-effort" in got.reason


def test_no_slo_means_no_estimate_based_refusal() -> None:
    got = admit(100, [q("p1", 100, 10**6)], 0.0, AdmissionPolicy(), inflight=0)
    assert got.ttft_estimate_s is not None
    assert got.ttft_estimate_s > 100


def test_unmeasured_rates_admit_without_an_estimate() -> None:
    got = admit(100, [q("p1", 5, 5000, rate=None)], 0.0, AdmissionPolicy(ttft_slo_s=0.1), 0)
    assert got.ttft_estimate_s is None


def test_full_queues_are_refused_until_one_drains() -> None:
    policy = AdmissionPolicy(max_queue=2)
    with pytest.raises(OverloadedError, match="queue is full") as exc:
        admit(10, [q("p1", 2, 500), q("p2", 3, 2000)], 0.0, policy, inflight=0)
    assert exc.value.retry_after_s == pytest.approx(0.5)  # p1's 500 tokens at 1000 tok/s
    assert admit(10, [q("p1", 2, 500), q("p2", 1, 10)], 0.0, policy, 0).ttft_estimate_s


def test_full_queues_are_refused_even_before_rates_are_measured() -> None:
    with pytest.raises(OverloadedError) as exc:
        admit(10, [q("p1", 1, rate=None)], 0.0, AdmissionPolicy(max_queue=1), inflight=0)
    assert exc.value.retry_after_s == 1.0


def test_the_inflight_bound() -> None:
    policy = AdmissionPolicy(max_inflight=3)
    admit(10, [], 0.0, policy, inflight=2)
    with pytest.raises(OverloadedError, match="drives 3"):
        admit(10, [], 0.0, policy, inflight=3)


def test_no_prefill_pool_admits_without_an_estimate() -> None:
    assert admit(10, [], 0.0, AdmissionPolicy(ttft_slo_s=0.001), 0).ttft_estimate_s is None


@given(
    prompt=st.integers(1, 10_000),
    queues=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 100_000), st.floats(1.0, 1e6)),
        min_size=1, max_size=5,
    ),
    slo=st.floats(0.01, 10.0),
)  # fmt: skip
def test_refusals_always_carry_a_positive_retry_after(
    prompt: int, queues: list[tuple[int, int, float]], slo: float
) -> None:
    views = [q(f"p{i}", r, t, rate) for i, (r, t, rate) in enumerate(queues)]
    policy = AdmissionPolicy(ttft_slo_s=slo, max_queue=40)
    refused: OverloadedError | None = None
    try:
        got = admit(prompt, views, 0.0, policy, inflight=0)
    except OverloadedError as exc:
        refused = exc
    if refused is not None:
        assert refused.retry_after_s > 0
    else:
        assert got.ttft_estimate_s is not None
        assert got.ttft_estimate_s <= slo or "best-effort" in got.reason


def test_policy_validation_and_tenant_limits() -> None:
    with pytest.raises(ConfigError):
        AdmissionPolicy(max_queue=0)
    with pytest.raises(ConfigError):
        AdmissionPolicy(tenant_limits={"a": 0})
    p = AdmissionPolicy(tenant_limits={"acme": 4}, default_tenant_limit=2)
    assert (p.tenant_limit("acme"), p.tenant_limit("other")) == (4, 2)
    assert parse_tenant_limits(["acme=8", " beta =2"]) == {"acme": 8, "beta": 2}
    for bad in ("acme", "=3", "acme=x", "acme=0"):
        with pytest.raises(ConfigError):
            parse_tenant_limits([bad])
    assert parse_aggregate_below("auto") is None
    assert parse_aggregate_below("64") == 64
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError):
            parse_aggregate_below(bad)


LINK = TransferModel(fixed_s=0.004, per_byte_s=1e-9)  # 4 ms + 1 GB/s


def decide(n: int, threshold: int | None = None, active: int = 1, **kw: object) -> bool:
    args: dict[str, object] = {
        "transfer": LINK, "kv_bytes_per_token": 40_000, "prefill_rate": 10_000.0,
        "local_speedup": 1.0, "decode_active": active,
    }  # fmt: skip
    args.update(kw)
    return disaggregate_or_not(n, threshold, **args).aggregate  # type: ignore[arg-type]


def test_a_fixed_threshold() -> None:
    assert decide(63, threshold=64)
    assert not decide(64, threshold=64)
    assert not decide(1, threshold=0)  # off


def test_auto_keeps_short_prompts_local_and_sends_long_ones() -> None:
    """Same GPU kind, one stream decoding: local costs 2n/r, remote n/r + 4 ms + n*b/BW.
    2n/10 000 <= n/10 000 + 0.004 + n*4e-5  <=>  n * (1e-4 - 4e-5) <= 0.004  <=>  n <= 66."""
    assert decide(66)
    assert not decide(67)


def test_auto_weighs_the_streams_a_local_prefill_stalls() -> None:
    assert decide(40, active=1)
    assert not decide(40, active=4)  # 5 * 40 / 10 000 = 20 ms > 4 + 4 + 1.6 ms


def test_auto_on_an_idle_decode_worker_of_the_same_kind_prefers_local() -> None:
    """Nothing to stall and no transfer to pay: local is faster up to the cap."""
    assert decide(AUTO_CAP_TOKENS, active=0)
    assert not decide(AUTO_CAP_TOKENS + 1, active=0)


def test_auto_accounts_for_a_slower_decode_gpu() -> None:
    assert decide(40, active=0, local_speedup=1.0)
    # local: 400 / (10 000 * 0.1) = 0.4 s; remote: 0.04 + 0.004 + 0.016 = 0.06 s
    assert not decide(400, active=0, local_speedup=0.1)


def test_auto_before_measurements_disaggregates() -> None:
    assert not decide(5, transfer=None)
    assert not decide(5, prefill_rate=None)
    d = disaggregate_or_not(5, None, transfer=None, kv_bytes_per_token=1, prefill_rate=None,
                            local_speedup=1.0, decode_active=0)  # fmt: skip
    assert "not measured" in d.reason
