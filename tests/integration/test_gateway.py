"""The OpenAI-compatible gateway on a real local cluster (tiny model, real processes), used
through the official `openai` client; and `pdorch demo --serve`."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import openai
import psutil
import pytest
import redis

from orchestrator.cluster import LocalCluster
from orchestrator.store.keys import Keys
from tests.integration.conftest import wait_for
from transport.ucx import ucx_available

KEY = "gateway-test-key"
TRANSPORT = "ucx" if ucx_available() else "tcp"
USER: Any = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="tiny",
        transport=TRANSPORT,
        prefill_workers=1,
        decode_workers=1,
        gateway=True,
        orchestrator_extra=["--api-key", KEY],
    )
    with c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    base = f"{cluster.gateway_urls[0]}/v1"
    with openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def test_models_and_health(cluster: LocalCluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    health = httpx.get(f"{cluster.gateway_urls[0]}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": ["tiny"]}


def test_completion_streamed_equals_whole(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 24,
        "temperature": 0,
    }
    whole = client.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason in {"stop", "length"}
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(b"The quick brown fox")  # byte-level tokenizer
    assert 0 < whole.usage.completion_tokens <= 24
    streamed = [c.choices[0].text for c in client.completions.create(stream=True, **args)]
    assert "".join(streamed) == choice.text
    assert len(choice.text) > 0


def test_chat_streamed_equals_whole(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "tiny",
        "messages": USER,
        "max_completion_tokens": 24,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion"
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        stream=True,
        stream_options={"include_usage": True},
        **args,
    )
    parts, usage = [], None
    for chunk in stream:
        parts += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == text
    assert usage is not None
    assert whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_same_idempotency_key_is_the_same_request(client: openai.OpenAI) -> None:
    key = f"gw-{uuid.uuid4().hex}"
    # Sampled, no seed: the seed comes from the key, so a retry is the same request.
    args: dict[str, Any] = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12}
    headers = {"Idempotency-Key": key}
    raw = client.completions.with_raw_response.create(extra_headers=headers, **args)
    assert raw.headers["x-request-id"] == key
    first = raw.parse()
    again = client.completions.create(extra_headers=headers, **args)
    assert again.id == first.id == f"cmpl-{key}"
    assert again.choices[0].text == first.choices[0].text
    with pytest.raises(openai.ConflictError):  # the same key for another body
        client.completions.create(extra_headers=headers, **(args | {"max_tokens": 5}))


def test_idempotency_keys_naming_another_requests_keys(
    cluster: LocalCluster, client: openai.OpenAI
) -> None:
    """Issue 17: the key ``K:journal`` was request K's journal (503 with Redis's WRONGTYPE
    text). Each key is its own request now, and Redis's words never reach the client."""
    key = f"gw-{uuid.uuid4().hex}"
    args: dict[str, Any] = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8}
    first = client.completions.create(extra_headers={"Idempotency-Key": key}, **args)
    for suffix in (":journal", ":owner", ":client"):
        other = client.completions.create(extra_headers={"Idempotency-Key": key + suffix}, **args)
        assert other.id == f"cmpl-{key}{suffix}"
    again = client.completions.create(extra_headers={"Idempotency-Key": key}, **args)
    assert (again.id, again.choices[0].text) == (first.id, first.choices[0].text)
    poked = f"{key}-poked"  # a record key of the wrong type, written behind the store's back
    with redis.Redis(port=cluster.redis_port) as raw:
        raw.set(Keys().request(poked), "not a record", ex=60)
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(extra_headers={"Idempotency-Key": poked}, **args)
    assert failed.value.status_code == 503
    assert "request store error" in failed.value.message
    assert "WRONGTYPE" not in str(failed.value.body)


def test_client_errors(cluster: LocalCluster, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-5", messages=USER)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=USER, n=2)
    assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    assert too_long.value.param == "max_tokens"
    base = f"{cluster.gateway_urls[0]}/v1"
    with (
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=30) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.completions.create(model="tiny", prompt="hi")


@pytest.mark.failover
def test_all_workers_killed_is_503(cluster: LocalCluster, client: openai.OpenAI) -> None:
    """Runs last in this module: it leaves the cluster without workers."""
    for name in ("prefill-0", "decode-0"):
        cluster.procs[name].signal(signal.SIGKILL)
        cluster.procs[name].popen.wait(10)
    with pytest.raises(openai.InternalServerError) as dead:  # heartbeats not expired yet
        client.completions.create(model="tiny", prompt="anyone?", max_tokens=4)
    assert dead.value.status_code == 503
    wait_for(lambda: sum(cluster.registered().values()) == 0, 15, "heartbeats to expire")
    with pytest.raises(openai.InternalServerError) as gone:
        client.chat.completions.create(model="tiny", messages=USER, stream=True)
    assert gone.value.status_code == 503
    health = httpx.get(f"{cluster.gateway_urls[0]}/health", timeout=10)
    assert health.status_code == 503


# ------------------------------------------------------------------ pdorch demo --serve


def _first_line(stream: IO[str], timeout_s: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no output within {timeout_s}s") from None


@pytest.mark.slow  # a second cluster of five processes
@pytest.mark.timeout(300)  # worker start-up is I/O-bound: a minute or more on a busy machine
def test_demo_serve_keeps_the_cluster_up_until_sigint(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "orchestrator.cli", "demo", "--model", "tiny"]
    argv += ["--transport", TRANSPORT, "--max-tokens", "4", "--serve", "--json"]
    env = os.environ | {"PDORCH_API_KEY": KEY}  # the orchestrator reads it: auth on
    with (tmp_path / "demo.err").open("w") as err:
        # Its own process group: a failed test kills the demo's cluster with it.
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
    try:
        assert proc.stdout is not None
        line = _first_line(proc.stdout, 240)
        if not line.startswith("{"):  # the demo ended (or wrote something else): say why
            proc.wait(30)
            raise AssertionError(
                f"demo printed {line!r}; stderr:\n" + (tmp_path / "demo.err").read_text()[-3000:]
            )
        report = json.loads(line)
        assert report["all_match"] is True
        assert report["model"] == "tiny"
        with openai.OpenAI(base_url=report["gateway"], api_key=KEY, max_retries=0) as client:
            reply = client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=4, temperature=0, timeout=60
            )
        assert reply.usage is not None
        assert 0 < reply.usage.completion_tokens <= 4
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis, orchestrator, 1 prefill + 2 decode workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, (tmp_path / "demo.err").read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing left after a clean exit
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
