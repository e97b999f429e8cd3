"""`pdorch migrate`'s pure parts: settings, routing, sampling, windows, the rollback rule,
agreement, reading answers and the report."""

from __future__ import annotations

import json

import pytest

from orchestrator.errors import ConfigError
from orchestrator.migrate import agreement, policy, report, sse
from orchestrator.migrate.policy import Sample
from orchestrator.migrate.settings import Limits, MigrationSettings, Upstreams, parse_listen

UP = Upstreams("http://a:1/v1/", "http://b:2")


def sample(path: str = "pdorch", **kw: object) -> Sample:
    base: dict[str, object] = {
        "ts": 1000.0,
        "request_id": "r",
        "path": path,
        "role": "answer",
        "stream": True,
        "status": 200,
        "failed": False,
        "ttft_ms": 100.0,
        "tpot_ms": 10.0,
        "total_ms": 500.0,
    }
    return Sample(**(base | kw))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ settings


def test_upstream_urls_are_normalised() -> None:
    assert (UP.existing, UP.pdorch) == ("http://a:1", "http://b:2")


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"percent": 101.0}, "--percent"),
        ({"sample": 1.5}, "--sample"),
        ({"name": "a:b"}, "--name"),
        ({"mode": "blue-green"}, "mode"),
        ({"limits": None}, "--min-samples"),
    ],
)
def test_bad_settings_name_the_flag(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {"name": "m", "mode": "canary", "upstreams": UP}

    def build() -> object:
        if kwargs.get("limits", 0) is None:
            return Limits(window=5, min_samples=6)
        return MigrationSettings(**(args | kwargs))  # type: ignore[arg-type]

    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.field == flag


def test_bad_url_and_listen() -> None:
    with pytest.raises(ConfigError, match="--existing"):
        Upstreams("ftp://x", "http://b")
    assert parse_listen("127.0.0.1:8090") == ("127.0.0.1", 8090)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ConfigError, match="--listen"):
        parse_listen("8090")


# ------------------------------------------------------------------- routing, sampling


def test_routing_is_deterministic_and_proportional() -> None:
    keys = [f"req-{i}" for i in range(4000)]
    at_10 = {k for k in keys if policy.routes_to_pdorch("m", k, 10)}
    assert at_10 == {k for k in keys if policy.routes_to_pdorch("m", k, 10)}
    assert 300 < len(at_10) < 500
    at_30 = {k for k in keys if policy.routes_to_pdorch("m", k, 30)}
    assert at_10 <= at_30  # raising the share only adds requests
    assert not any(policy.routes_to_pdorch("m", k, 0) for k in keys)
    assert all(policy.routes_to_pdorch("m", k, 100) for k in keys)
    assert all(policy.sampled("m", k, 1.0) for k in keys)
    assert 300 < sum(policy.sampled("m", k, 0.1) for k in keys) < 500


def test_failure_classification() -> None:
    assert policy.counts_as_failure(503, "")
    assert policy.counts_as_failure(429, "")
    assert policy.counts_as_failure(0, "refused")
    assert policy.counts_as_failure(200, "stream broke")
    assert not policy.counts_as_failure(400, "bad request")  # the client's fault
    assert not policy.counts_as_failure(200, "")


# ---------------------------------------------------------------- windows, rollbacks


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert policy.percentile(values, 50) == 50
    assert policy.percentile(values, 99) == 99
    assert policy.percentile([7.0], 99) == 7
    assert policy.percentile([], 50) is None


def test_window_keeps_the_last_n() -> None:
    w = policy.Window(3)
    for i in range(5):
        stats = w.add(sample(ttft_ms=float(i), failed=i == 0))
    assert stats.count == 3
    assert stats.failures == 0
    assert stats.ttft_p99_ms == 4


def test_rollback_rule() -> None:
    limits = Limits(max_error_rate=0.2, max_ttft_p99_ms=500, max_tpot_p99_ms=50,
                    window=10, min_samples=5)  # fmt: skip
    healthy = [sample() for _ in range(10)]
    assert policy.breach(policy.window_stats(healthy), limits) is None
    few_bad = [sample(status=503, failed=True) for _ in range(4)]
    assert policy.breach(policy.window_stats(few_bad), limits) is None  # below min samples
    errs = healthy[:7] + [sample(status=503, failed=True)] * 3
    reason = policy.breach(policy.window_stats(errs), limits)
    assert reason is not None
    assert reason.startswith("error rate 30.0% (3/10)")
    slow = [*healthy[:9], sample(ttft_ms=900.0)]
    assert policy.breach(policy.window_stats(slow), limits) == "TTFT p99 900 ms > 500 ms"
    sluggish = [*healthy[:9], sample(tpot_ms=80.0)]
    assert "TPOT p99" in (policy.breach(policy.window_stats(sluggish), limits) or "")
    off = Limits(max_error_rate=1.0, window=10, min_samples=5)
    assert policy.breach(policy.window_stats(slow), off) is None  # 0 = no latency limit


def test_sample_round_trips_through_json() -> None:
    s = sample(match=True, char_similarity=1.0, cost_usd=0.01)
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())) | {"future": 1})
    assert back == s


# ------------------------------------------------------------------------- agreement


def test_agreement() -> None:
    same = agreement.compare("the cat sat", "the cat sat")
    assert same == agreement.Agreement(True, 1.0, 1.0)
    near = agreement.compare("the cat sat on the mat", "the cat sat on a mat")
    assert not near.exact
    assert 0.8 < near.char_similarity < 1.0
    assert near.token_similarity == pytest.approx(2 * 5 / 12)
    assert agreement.compare("abc", "xyz").char_similarity == 0.0


# ----------------------------------------------------------------------------- sse


def _chunk(text: str) -> bytes:
    return (
        b"data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()
        + b"\n\n"
    )


USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,'
    b'"pdorch_cost_usd":0.5}}\n\n'
)


def test_stream_reader_times_text_and_strips_our_usage_chunk() -> None:
    reader = sse.StreamReader(strip_usage=True)
    wire = (
        _chunk("He") + _chunk("llo") + _chunk(", ") + _chunk("world") + USAGE + b"data: [DONE]\n\n"
    )
    first = len(_chunk("He"))
    out = reader.feed(wire[:7], at=1.0)  # half an event: nothing passed on yet
    assert out == b""
    out += reader.feed(wire[7 : first + 3], at=1.1)  # the first event ends here
    out += reader.feed(wire[first + 3 :], at=1.4)
    assert reader.close() == b""
    r = reader.reading
    assert r.text == "Hello, world"
    assert (r.prompt_tokens, r.completion_tokens, r.cost_usd, r.done) == (3, 4, 0.5, True)
    assert USAGE not in out
    assert out == wire.replace(USAGE, b"")
    ttft, tpot = r.timings(started=0.9)
    assert ttft == pytest.approx(200.0)
    assert tpot == pytest.approx((1.4 - 1.1) * 1000 / 3)


def test_stream_reader_keeps_usage_the_client_asked_for_and_sees_errors() -> None:
    reader = sse.StreamReader(strip_usage=False)
    err = b'data: {"error":{"message":"worker gone","type":"server_error"}}\n\n'
    out = reader.feed(_chunk("a") + USAGE + err, at=1.0)
    assert USAGE in out
    assert err in out
    assert reader.reading.error == "worker gone"
    truncated = sse.StreamReader(strip_usage=False)
    truncated.feed(_chunk("a"), at=1.0)
    truncated.close()
    assert truncated.reading.error == "the stream ended without [DONE]"


def test_read_whole_answers() -> None:
    body = {"choices": [{"message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1}}  # fmt: skip
    r = sse.read_whole(json.dumps(body).encode(), sse.Reading(), at=2.0)
    assert (r.text, r.completion_tokens, r.error) == ("hi", 1, "")
    bad = sse.read_whole(b'{"error":{"message":"nope","code":"x"}}', sse.Reading(), at=2.0)
    assert bad.error == "nope"
    assert sse.read_whole(b"<html>", sse.Reading(), at=2.0).error == "the answer is not JSON"


# --------------------------------------------------------------------------- report


def test_report_summary_and_rendering() -> None:
    samples = [
        sample("existing", ts=1000.0 + i, prompt_tokens=10, completion_tokens=10,
               ttft_ms=50.0 + i) for i in range(10)
    ] + [
        sample("pdorch", ts=1000.0 + i, role="shadow", cost_usd=0.002, match=i < 8,
               char_similarity=1.0 if i < 8 else 0.5, token_similarity=1.0 if i < 8 else 0.0)
        for i in range(10)
    ] + [sample("pdorch", ts=1010.0, status=503, failed=True, error="HTTP 503")]  # fmt: skip
    rollbacks = [{"ts": 1005.0, "reason": "error rate 50% > 5%", "percent_before": 20.0}]
    config = {"mode": "canary", "percent": 0.0,
              "pricing": {"usd_per_1k_tokens": 0.5, "usd_per_hour": 0.0}}  # fmt: skip
    s = report.summarize("m", config, samples, rollbacks, now=2000.0)
    existing, pdorch = s.paths
    assert (existing.requests, existing.failures) == (10, 0)
    assert existing.cost_per_request_usd == pytest.approx(0.5 * 20 / 1000)
    assert (pdorch.requests, pdorch.shadow, pdorch.failures) == (11, 10, 1)
    assert pdorch.error_rate == pytest.approx(1 / 11)
    assert pdorch.cost_per_request_usd == pytest.approx(0.002)
    assert existing.ttft_ms[0] == 54.0
    assert (s.agreement.pairs, s.agreement.exact) == (10, 8)
    assert s.agreement.char_similarity == pytest.approx(0.9)
    assert s.errors == (("pdorch", "HTTP 503", 1),)
    plots = [("TTFT distribution", "r-ttft.png")]
    md = report.markdown(s, plots)
    for section in ("## Traffic, errors and cost", "## Latency", "## Output agreement",
                    "## Rollbacks", "error rate 50% > 5%", "![TTFT distribution](r-ttft.png)",
                    "| exact match | 8 (80.0%) |"):  # fmt: skip
        assert section in md
    page = report.html_page(s, plots)
    assert "<img src='r-ttft.png'" in page
    assert "error rate 50% &gt; 5%" in page


def test_existing_priced_by_the_hour() -> None:
    samples = [sample("existing", ts=float(t)) for t in (0, 1800, 3600)]
    config = {"pricing": {"usd_per_1k_tokens": 0.0, "usd_per_hour": 3.0}}
    existing, _ = report.summarize("m", config, samples, []).paths
    assert existing.cost_per_request_usd == pytest.approx(1.0)  # $3 over 1 h, 3 requests
