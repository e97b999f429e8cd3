"""`pdorch migrate` end to end: the existing service is pdorch's aggregated mode (one decode
worker, no prefill pool, its own OpenAI front) in its own processes; the pdorch path is a
disaggregated local cluster; the migration proxy runs as `pdorch migrate ...` in its own
process; clients use the official `openai` client."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from orchestrator.cluster import LocalCluster, free_port
from orchestrator.migrate import policy
from tests.integration.conftest import wait_for
from transport.ucx import ucx_available

TRANSPORT = "ucx" if ucx_available() else "tcp"
CHAT: Any = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def pdorch() -> Iterator[LocalCluster]:
    with LocalCluster(
        model="tiny", transport=TRANSPORT, prefill_workers=1, decode_workers=1, gateway=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def existing() -> Iterator[LocalCluster]:
    """The "existing service": aggregated on one worker (no prefill pool, --fallback local)."""
    with LocalCluster(
        model="tiny", transport="tcp", prefill_workers=0, decode_workers=1, gateway=True
    ) as c:
        yield c


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def status(pdorch: LocalCluster, name: str) -> dict[str, Any]:
    done = cli("migrate", "status", "--name", name, "--redis", pdorch.redis_url, "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@contextmanager
def proxy(
    mode: str, name: str, pdorch: LocalCluster, existing: LocalCluster, tmp: Path, *flags: str,
    pdorch_url: str = "",
) -> Iterator[str]:  # fmt: skip
    port = free_port()
    log = (tmp / f"proxy-{name}.log").open("wb")
    args = [
        sys.executable, "-m", "orchestrator.cli", "--log-level", "DEBUG", "migrate", mode,
        "--name", name, "--redis", pdorch.redis_url, "--listen", f"127.0.0.1:{port}",
        "--existing", existing.gateway_urls[0] + "/v1",
        "--pdorch", pdorch_url or pdorch.gateway_urls[0], *flags,
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp / f"proxy-{name}.log").read_text()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 30, "the migration proxy")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp / f"proxy-{name}.log").read_text()[-3000:]
        log.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def key() -> str:
    return f"mig-{uuid.uuid4().hex}"


def test_shadow_end_to_end_and_report(
    pdorch: LocalCluster, existing: LocalCluster, tmp_path: Path
) -> None:
    name = f"shadow-{uuid.uuid4().hex[:6]}"
    direct = client(existing.gateway_urls[0])
    with proxy("shadow", name, pdorch, existing, tmp_path, "--sample", "1.0",
               "--existing-usd-per-1k-tokens", "0.5") as url, client(url) as c:  # fmt: skip
        answers = []
        for i in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny", messages=CHAT, max_completion_tokens=16 + i, temperature=0,
                stream=True, extra_headers={"Idempotency-Key": key()},
            )  # fmt: skip
            assert raw.headers["x-pdorch-migrate-path"] == "existing"
            chunks = list(raw.parse())
            # The usage chunk the proxy asked for itself is not passed on.
            assert all(ch.choices for ch in chunks)
            answers.append("".join(ch.choices[0].delta.content or "" for ch in chunks))
        whole = c.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0
        )
        # The client gets the existing service's answer.
        ref = direct.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0
        )
        assert whole.choices[0].text == ref.choices[0].text
        assert whole.usage is not None
        assert "pdorch_cost_usd" in (whole.usage.model_extra or {})  # existing is pdorch too
        ref_chat = direct.chat.completions.create(
            model="tiny", messages=CHAT, max_completion_tokens=16, temperature=0
        )
        assert answers[0] == ref_chat.choices[0].message.content
        wait_for(
            lambda: status(pdorch, name)["counters"].get("requests:pdorch", 0) == 4,
            30, "the shadow calls to be recorded",
        )  # fmt: skip
    snap = status(pdorch, name)
    assert snap["mode"] == "shadow"
    assert snap["counters"] == {"requests:existing": 4, "requests:pdorch": 4}
    assert snap["windows"]["pdorch"]["count"] == 4
    assert snap["windows"]["pdorch"]["ttft_p50_ms"] > 0
    assert snap["samples"] == 8
    assert snap["rollbacks"] == []
    human = cli("migrate", "status", "--name", name, "--redis", pdorch.redis_url)
    assert "mode shadow" in human.stdout
    assert "pdorch   requests 4" in human.stdout

    for out in (tmp_path / "report.md", tmp_path / "report.html"):
        done = cli("migrate", "report", "--name", name, "--redis", pdorch.redis_url,
                   "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        text = out.read_text()
        assert "Output agreement" in text
        assert "Latency" in text
        assert "Rollbacks" in text
        for plot in ("ttft", "tpot", "timeline"):
            png = tmp_path / f"report-{plot}.png"
            assert png.read_bytes()[:4] == b"\x89PNG"
            assert f"report-{plot}.png" in text
    md = (tmp_path / "report.md").read_text()
    # Same tiny model, greedy on both paths: the outputs agree.
    assert "| shadow pairs compared | 4 |" in md
    assert "| exact match | 4 (100.0%) |" in md
    assert "pdorch's own pricing (4 requests)" in md
    assert "$0.5/1k tokens" in md


def test_canary_routes_by_key_and_passes_errors_through(
    pdorch: LocalCluster, existing: LocalCluster, tmp_path: Path
) -> None:
    name = f"canary-{uuid.uuid4().hex[:6]}"
    with proxy("canary", name, pdorch, existing, tmp_path, "--percent", "50",
               "--max-error-rate", "1") as url, client(url) as c:  # fmt: skip
        keys = [key() for _ in range(8)]
        expected = {k: policy.routes_to_pdorch(name, k, 50) for k in keys}
        for i, k in enumerate(keys):
            raw = c.completions.with_raw_response.create(
                model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                stream=i % 2 == 0, extra_headers={"Idempotency-Key": k},
            )  # fmt: skip
            path = raw.headers["x-pdorch-migrate-path"]
            assert path == ("pdorch" if expected[k] else "existing")
            if i % 2 == 0:
                assert "".join(ch.choices[0].text for ch in raw.parse())
        with pytest.raises(openai.NotFoundError) as missing:  # the upstream's 404, as it was
            c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="x", max_tokens=10**7)
        to_pdorch = sum(expected.values())
        wait_for(
            lambda: sum(status(pdorch, name)["counters"].get(f"requests:{p}", 0)
                        for p in ("existing", "pdorch")) == 10,
            15, "samples",
        )  # fmt: skip
    snap = status(pdorch, name)
    counters = snap["counters"]
    assert counters["requests:pdorch"] + counters["requests:existing"] == 10
    assert counters["requests:pdorch"] >= to_pdorch  # the 2 unkeyed ones go by body hash
    assert counters["requests:existing"] >= 8 - to_pdorch
    assert not any(k.startswith("failures:") for k in counters)  # 4xx are the client's
    assert snap["percent"] == 50.0
    assert snap["rollbacks"] == []


def test_slow_pdorch_rolls_back_and_rearms(
    pdorch: LocalCluster, existing: LocalCluster, tmp_path: Path
) -> None:
    """An SLO breach (TTFT p99 over a 1 ms limit) sends the share to 0; `pdorch migrate
    percent` re-arms it."""
    name = f"slow-{uuid.uuid4().hex[:6]}"
    with proxy("canary", name, pdorch, existing, tmp_path, "--percent", "100",
               "--max-ttft-p99-ms", "1", "--window", "5", "--min-samples", "3") as url, \
            client(url) as c:  # fmt: skip
        paths = []
        for _ in range(5):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0,
                stream=True, extra_headers={"Idempotency-Key": key()},
            )  # fmt: skip
            list(raw.parse())
            paths.append(raw.headers["x-pdorch-migrate-path"])
        assert paths == ["pdorch"] * 3 + ["existing"] * 2
        wait_for(lambda: len(status(pdorch, name)["rollbacks"]) == 1, 10, "the rollback")
        snap = status(pdorch, name)
        assert snap["percent"] == 0.0
        (rollback,) = snap["rollbacks"]
        assert rollback["reason"].startswith("TTFT p99")
        assert rollback["percent_before"] == 100.0
        assert rollback["stats"]["count"] == 3
        human = cli("migrate", "status", "--name", name, "--redis", pdorch.redis_url).stdout
        assert "rollbacks: 1" in human
        assert "100% -> 0%: TTFT p99" in human

        done = cli("migrate", "percent", "--name", name, "--redis", pdorch.redis_url,
                   "--percent", "100")  # fmt: skip
        assert done.returncode == 0, done.stderr
        wait_for(lambda: httpx.get(url + "/health").json()["percent"] == 100, 10, "re-arm")
        raw = c.completions.with_raw_response.create(
            model="tiny", prompt="hi", max_tokens=4, extra_headers={"Idempotency-Key": key()}
        )
        assert raw.headers["x-pdorch-migrate-path"] == "pdorch"


def test_cli_errors_are_one_line(pdorch: LocalCluster, existing: LocalCluster) -> None:
    missing = cli("migrate", "status", "--name", "nobody", "--redis", pdorch.redis_url)
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        f"pdorch migrate status: no migration named 'nobody' in {pdorch.redis_url}"
    )
    bad = cli("migrate", "canary", "--name", "x", "--redis", pdorch.redis_url, "--percent", "150",
              "--existing", "http://127.0.0.1:1", "--pdorch", "http://127.0.0.1:1")  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip() == "pdorch migrate canary: --percent: must be in [0, 100], got 150.0"
    down = cli("migrate", "status", "--name", "x", "--redis", "redis://127.0.0.1:1/0")
    assert down.returncode == 1
    assert "Traceback" not in down.stderr


@pytest.mark.failover
def test_failing_pdorch_rolls_back_on_errors(
    pdorch: LocalCluster, existing: LocalCluster, tmp_path: Path
) -> None:
    """Runs last: kills the pdorch cluster's workers. pdorch's 503s reach the client as 503s,
    the error rate breaks the limit, and the share goes to 0: the next requests get 200s
    from the existing service."""
    name = f"fail-{uuid.uuid4().hex[:6]}"
    with proxy("canary", name, pdorch, existing, tmp_path, "--percent", "100",
               "--max-error-rate", "0.25", "--window", "4", "--min-samples", "2") as url, \
            client(url) as c:  # fmt: skip
        ok = c.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                  extra_headers={"Idempotency-Key": key()})  # fmt: skip
        assert ok.choices[0].finish_reason in {"stop", "length"}
        for worker in ("prefill-0", "decode-0"):
            pdorch.procs[worker].signal(signal.SIGKILL)
            pdorch.procs[worker].popen.wait(10)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as failed:
            c.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                 extra_headers={"Idempotency-Key": key()})  # fmt: skip
        assert failed.value.status_code == 503
        assert time.monotonic() - started < 30
        # 1 failure in 2: 50% > 25%, rolled back; the next request is the existing service's.
        raw = c.completions.with_raw_response.create(
            model="tiny", prompt="hi", max_tokens=4, extra_headers={"Idempotency-Key": key()}
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-pdorch-migrate-path"] == "existing"
        wait_for(lambda: len(status(pdorch, name)["rollbacks"]) == 1, 10, "the rollback")
    snap = status(pdorch, name)
    assert snap["percent"] == 0.0
    assert snap["rollbacks"][0]["reason"] == "error rate 50.0% (1/2) > 25.0%"
    assert snap["counters"]["failures:pdorch"] == 1
