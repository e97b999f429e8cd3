"""`pdorch generate` against an orchestrator that refuses with a retry-after (its request
store away — a Redis primary failing over — or load): tried again, the same request, until
it is served; a refusal without one is final. And the orchestrator says retry-after for a
store it cannot reach (`rpc.service._aborted`). A QA pass: 8 `generate`s started as a Redis
Cluster primary was killed all failed in ~2 s, though the store came back in seconds."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator import errors
from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cli import main
from orchestrator.rpc.service import RETRY_AFTER_KEY, _aborted


@pytest.fixture(autouse=True)
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "none.json"))
    for name in ("PDORCH_REDIS_URL", "PDORCH_ORCHESTRATOR", "PDORCH_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)


class _StoreComesBack(orchestrator_pb2_grpc.OrchestratorServicer):
    """Refuses ``refusals`` times (UNAVAILABLE, with or without a retry-after), then serves."""

    def __init__(self, refusals: int, retry_after: str | None) -> None:
        self.refusals = refusals
        self.retry_after = retry_after
        self.ids: list[str] = []

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.ids.append(request.request_id)
        if len(self.ids) <= self.refusals:
            if self.retry_after is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, self.retry_after),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "request store unreachable (create)")
        yield orchestrator_pb2.GenerateChunk(
            request_id=request.request_id, index=0, token_ids=[5], text="served",
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
        )  # fmt: skip


def _generate(servicer: _StoreComesBack, *extra: str) -> int:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        return main(["generate", "hi", "--orchestrator", f"127.0.0.1:{port}", *extra])
    finally:
        server.stop(None)


def test_a_refusal_with_a_retry_after_is_tried_again_as_the_same_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer = _StoreComesBack(2, "0.05")
    assert _generate(servicer) == 0
    out, err = capsys.readouterr()
    assert out == "served"
    assert err.count("UNAVAILABLE: request store unreachable (create); trying again in 0.05 s") == 2
    assert len(servicer.ids) == 3
    assert len(set(servicer.ids)) == 1  # one request, resubmitted
    assert servicer.ids[0]  # named by the client


def test_a_refusal_without_a_retry_after_is_final(capsys: pytest.CaptureFixture[str]) -> None:
    servicer = _StoreComesBack(1, None)
    assert _generate(servicer) == 1
    assert "UNAVAILABLE: request store unreachable (create)" in capsys.readouterr().err
    assert len(servicer.ids) == 1


def test_retries_stop_at_the_tries_or_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    servicer = _StoreComesBack(100, "0.01")
    assert _generate(servicer) == 1
    assert len(servicer.ids) == 5  # `generate.TRIES`
    servicer = _StoreComesBack(100, "5")
    assert _generate(servicer, "--timeout", "2") == 1
    assert len(servicer.ids) == 1  # waiting 5 s would pass the request's 2 s
    capsys.readouterr()


def test_the_orchestrator_asks_a_retry_after_only_when_retrying_can_help() -> None:
    store_away = _aborted(errors.StoreUnavailableError("request store unreachable (create)"))
    assert dict(store_away.trailing)[RETRY_AFTER_KEY] == "1.000"
    assert dict(_aborted(errors.OverloadedError("full", retry_after_s=2.5)).trailing) == {
        RETRY_AFTER_KEY: "2.500"
    }
    assert _aborted(errors.UnavailableError("no workers registered")).trailing == ()
    assert _aborted(errors.InvalidRequestError("prompt", "bad")).trailing == ()
