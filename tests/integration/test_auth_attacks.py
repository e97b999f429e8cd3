"""The attack table (README: Security), tried against a real cluster with a tokens file:
each attempt is refused with a clear error and writes nothing; the log names the peer, never
a credential. Plus Redis without its password, against a real redis-server.

    attempt                                   gRPC                 HTTP gateway
    no credential                             UNAUTHENTICATED      401 invalid_api_key
    wrong token                               UNAUTHENTICATED      401 invalid_api_key
    revoked token (removed from the file)     UNAUTHENTICATED      401 invalid_api_key
    valid token claiming another tenant       PERMISSION_DENIED    403 tenant_not_allowed
    GetRequest / Cancel of another tenant's   NOT_FOUND (as an unknown id)
    another tenant's request id reused        ALREADY_EXISTS (as a different body), no output
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis

from orchestrator.api import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster
from orchestrator.core.auth import token_digest
from orchestrator.rpc.many_client import accepted
from orchestrator.store.keys import Keys
from orchestrator.store.server import RedisServer
from tests.integration.conftest import request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN_A = "attack-table-token-a-7f3c9b1e"  # team-a, may also act for team-a-batch
TOKEN_B = "attack-table-token-b-0d5e2a44"  # team-b
TOKEN_C = "attack-table-token-c-91ab6f08"  # team-c, revoked during the test
WRONG = "attack-table-wrong-5a5a5a5a"
SECRETS = (TOKEN_A, TOKEN_B, TOKEN_C, WRONG)


def tokens_json(*tokens: str) -> str:
    entries = {
        TOKEN_A: {"tenant": "team-a", "tenants": ["team-a-batch"], "name": "alice"},
        TOKEN_B: {"tenant": "team-b", "name": "bob"},
        TOKEN_C: {"tenant": "team-c", "name": "carol"},
    }
    return json.dumps({"tokens": [{"sha256": token_digest(t), **entries[t]} for t in tokens]})


def write_tokens(path: Path, *tokens: str) -> None:
    before = path.stat().st_mtime_ns if path.exists() else 0
    tmp = path.with_suffix(".tmp")
    tmp.write_text(tokens_json(*tokens), encoding="utf-8")
    tmp.replace(path)  # atomic, as an operator's edit (or a Secret's swap) should be
    st = path.stat()
    if st.st_mtime_ns <= before:  # a coarse clock: make the change visible
        os.utime(path, ns=(st.st_atime_ns, before + 1_000_000))


@pytest.fixture(scope="module")
def tokens_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    write_tokens(path, TOKEN_A, TOKEN_B, TOKEN_C)
    return path


@pytest.fixture(scope="module")
def cluster(tokens_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="tiny",
        transport="tcp",
        prefill_workers=1,
        decode_workers=1,
        gateway=True,
        orchestrator_extra=["--tokens-file", str(tokens_path)],
    )
    with c:
        yield c


def address(cluster: LocalCluster) -> str:
    return cluster.orchestrator_addresses[0]


async def generate(
    cluster: LocalCluster,
    req: orchestrator_pb2.GenerateRequest,
    token: str | None,
    tenant: str | None = None,
) -> list[orchestrator_pb2.GenerateChunk]:
    metadata = () if tenant is None else (("x-pdorch-tenant", tenant),)
    async with cluster.channel(address(cluster), token) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        return [c async for c in stub.Generate(req, timeout=60, metadata=metadata)]


async def get(cluster: LocalCluster, rid: str, token: str | None) -> orchestrator_pb2.RequestInfo:
    async with cluster.channel(address(cluster), token) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        info: orchestrator_pb2.RequestInfo = await stub.GetRequest(
            orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10
        )
        return info


async def cancel(cluster: LocalCluster, rid: str, token: str | None) -> str:
    async with cluster.channel(address(cluster), token) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        resp = await stub.Cancel(orchestrator_pb2.CancelRequest(request_id=rid), timeout=10)
        return str(resp.state)


def refused(coro: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(coro)
    return caught.value


def record(cluster: LocalCluster, rid: str) -> dict[str, str]:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        return dict(client.hgetall(Keys().request(rid)))  # type: ignore[arg-type]
    finally:
        client.close()


def orchestrator_log(cluster: LocalCluster) -> str:
    return (cluster.workdir / "orchestrator-0.log").read_text(errors="replace")


def test_no_credential_and_a_wrong_token_are_unauthenticated(cluster: LocalCluster) -> None:
    for token in (None, WRONG):
        err = refused(generate(cluster, request("hi", request_id=f"no-{token}"), token))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert record(cluster, f"no-{token}") == {}  # nothing written
        for call in (get(cluster, "x", token), cancel(cluster, "x", token)):
            assert refused(call).code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no credential" in refused(generate(cluster, request("hi"), None)).details()
    assert "invalid or revoked" in refused(generate(cluster, request("hi"), WRONG)).details()
    log = orchestrator_log(cluster)
    assert "Generate: refused a call from ipv4:127.0.0.1:" in log  # the peer, named


def test_generate_many_authenticates_its_call_and_takes_the_tenant_from_it(
    cluster: LocalCluster,
) -> None:
    """The token goes with the call (`rpc.client` adds it to bidirectional calls too) and
    every request on it is the token's tenant's; no token: the call is refused."""

    async def many(token: str | None, rid: str, tenant: str | None = None) -> list[Any]:
        metadata = () if tenant is None else (("x-pdorch-tenant", tenant),)
        async with cluster.channel(address(cluster), token) as ch:
            call = orchestrator_pb2_grpc.OrchestratorStub(ch).GenerateMany(
                timeout=60, metadata=metadata
            )
            start = request("hi", request_id=rid)
            await call.write(orchestrator_pb2.GenerateCommand(stream=1, start=start))
            events = []
            while not any(e.ended or e.HasField("failure") for e in events):
                events.extend((await call.read()).events)
            call.cancel()
            return events

    async def refused_many(token: str | None, rid: str, tenant: str | None = None) -> Any:
        """The status a refused call ends with. The request is written only once the call
        is accepted (its initial metadata), as `rpc.many_client` does: a write racing the
        refusal makes grpc.aio's client report INTERNAL instead (grpc/grpc#36066)."""
        metadata = () if tenant is None else (("x-pdorch-tenant", tenant),)
        async with cluster.channel(address(cluster), token) as ch:
            call = orchestrator_pb2_grpc.OrchestratorStub(ch).GenerateMany(
                timeout=60, metadata=metadata
            )
            if accepted(await call.initial_metadata()):  # the request goes (to fail below)
                start = request("hi", request_id=rid)
                await call.write(orchestrator_pb2.GenerateCommand(stream=1, start=start))
                await call.done_writing()
            return await call.code()

    assert asyncio.run(refused_many(None, "many-none")) == grpc.StatusCode.UNAUTHENTICATED
    assert record(cluster, "many-none") == {}
    assert "GenerateMany: refused a call from ipv4:127.0.0.1:" in orchestrator_log(cluster)
    denied = asyncio.run(refused_many(TOKEN_B, "many-x", "team-a"))
    assert denied == grpc.StatusCode.PERMISSION_DENIED
    events = asyncio.run(many(TOKEN_B, "many-bob"))
    assert events[-1].ended
    assert events[-1].chunk.finish_reason
    assert record(cluster, "many-bob")["tenant"] == "team-b"


def test_health_checks_stay_open(cluster: LocalCluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    async def check() -> health_pb2.HealthCheckResponse:
        async with cluster.channel(address(cluster)) as ch:  # a client certificate, no token
            reply: health_pb2.HealthCheckResponse = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            return reply

    reply = asyncio.run(check())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_revoked_token_is_refused_without_a_restart(
    cluster: LocalCluster, tokens_path: Path
) -> None:
    chunks = asyncio.run(generate(cluster, request("hi", request_id="carol-1"), TOKEN_C))
    assert chunks[-1].finish_reason
    assert record(cluster, "carol-1")["tenant"] == "team-c"
    write_tokens(tokens_path, TOKEN_A, TOKEN_B)  # carol's token revoked
    try:
        err = refused(generate(cluster, request("hi", request_id="carol-2"), TOKEN_C))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert record(cluster, "carol-2") == {}
        with httpx.Client(base_url=cluster.gateway_urls[0], timeout=30) as http:
            r = http.get("/v1/models", headers={"authorization": f"Bearer {TOKEN_C}"})
        assert r.status_code == 401
    finally:
        write_tokens(tokens_path, TOKEN_A, TOKEN_B, TOKEN_C)
    assert "reloaded: 2 token(s)" in orchestrator_log(cluster)


def test_a_valid_token_claiming_another_tenant_is_refused(cluster: LocalCluster) -> None:
    err = refused(generate(cluster, request("hi", request_id="claim-1"), TOKEN_A, "team-b"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'team-b'" in err.details()
    assert record(cluster, "claim-1") == {}
    # narrowing within what the token allows is fine, and is what gets billed
    asyncio.run(generate(cluster, request("hi", request_id="claim-2"), TOKEN_A, "team-a-batch"))
    assert record(cluster, "claim-2")["tenant"] == "team-a-batch"
    asyncio.run(generate(cluster, request("hi", request_id="claim-3"), TOKEN_A))
    assert record(cluster, "claim-3")["tenant"] == "team-a"
    assert "refused a call from ipv4:127.0.0.1:" in orchestrator_log(cluster)


def test_another_tenants_request_is_not_found_and_its_id_not_reusable(
    cluster: LocalCluster,
) -> None:
    req = request("the quick brown fox", request_id="alice-private", max_tokens=8)
    mine = asyncio.run(generate(cluster, req, TOKEN_A))
    assert asyncio.run(get(cluster, "alice-private", TOKEN_A)).state == "done"
    unknown = refused(get(cluster, "no-such-request", TOKEN_B))
    for call in (get(cluster, "alice-private", TOKEN_B), cancel(cluster, "alice-private", TOKEN_B)):
        err = refused(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND
        # answered exactly as an unknown id is: existence is not told
        assert err.details() == unknown.details().replace("no-such-request", "alice-private")
    reuse = refused(generate(cluster, req, TOKEN_B))  # same id, same body, another tenant
    assert reuse.code() == grpc.StatusCode.ALREADY_EXISTS
    assert mine[-1].finish_reason  # alice's request is untouched
    assert record(cluster, "alice-private")["tenant"] == "team-a"


def test_the_gateway_takes_the_same_tokens(cluster: LocalCluster) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    with httpx.Client(base_url=cluster.gateway_urls[0], timeout=60) as http:
        models = http.get("/v1/models").json()
        assert models["error"]["code"] == "invalid_api_key"
        served = http.get("/v1/models", headers={"authorization": f"Bearer {TOKEN_A}"})
        assert served.status_code == 200
        model = served.json()["data"][0]["id"]
        body["model"] = model
        cases = [
            ({}, 401, "invalid_api_key"),
            ({"authorization": f"Bearer {WRONG}"}, 401, "invalid_api_key"),
            ({"authorization": "Basic abc"}, 401, "invalid_api_key"),
            (
                {"authorization": f"Bearer {TOKEN_A}", "x-pdorch-tenant": "team-b"},
                403,
                "tenant_not_allowed",
            ),
        ]
        for headers, status, code in cases:
            r = http.post("/v1/completions", json=body, headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code)
        r = http.post(
            "/v1/completions",
            json={**body, "user": "team-b"},
            headers={"authorization": f"Bearer {TOKEN_A}"},
        )
        assert r.status_code == 403
        ok = http.post(
            "/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {TOKEN_B}", "x-request-id": "bob-http-1"},
        )
        assert ok.status_code == 200, ok.text
    assert record(cluster, "bob-http-1")["tenant"] == "team-b"
    assert "'/v1/completions': refused a call from 127.0.0.1:" in orchestrator_log(cluster)


def test_no_token_reaches_a_log_or_the_store(cluster: LocalCluster) -> None:
    text = "".join(p.read_text(errors="replace") for p in cluster.workdir.glob("*.log"))
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        stored = json.dumps([client.hgetall(k) for k in client.keys("pdorch:req:*")
                             if client.type(k) == "hash"])  # fmt: skip
    finally:
        client.close()
    for secret in SECRETS:
        assert secret not in text
        assert secret not in stored
    assert "NO AUTHENTICATION" not in text  # the tokens file is in force


def test_a_missing_tokens_file_stops_the_orchestrator(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        out = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "orchestrator", "--redis", server.url,
             "--port", "0", "--tokens-file", str(tmp_path / "missing.json")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert out.returncode == 1
    assert "missing.json" in out.stderr


# --------------------------------------------------------------------- Redis's password

PASSWORD = "redis-attack-table-pw-3e1d"


def pdorch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_redis_without_its_password_is_refused_and_no_password_is_shown(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, config=[f"requirepass {PASSWORD}"], password=PASSWORD)
    with server:
        url = f"redis://127.0.0.1:{server.port}/0"
        for command in (["status", "--orchestrator", "127.0.0.1:1"], ["orchestrator"],
                        ["worker", "--role", "decode", "--model", "tiny"]):  # fmt: skip
            bare = pdorch(*command, "--redis", url)
            assert bare.returncode == 1, command
            assert "Redis refused the credentials (sent no password" in bare.stderr, command
        wrong = pdorch(
            "status", "--orchestrator", "127.0.0.1:1",
            env={"PDORCH_REDIS_URL": f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0"},
        )  # fmt: skip
        assert wrong.returncode == 1
        assert PASSWORD not in wrong.stderr + wrong.stdout
        assert ":***@" in wrong.stderr
        assert "Redis refused the credentials (sent a password" in wrong.stderr
        secret = tmp_path / "redis-password"
        secret.write_text(PASSWORD + "\n", encoding="utf-8")
        ok = pdorch(
            "status", "--json", "--redis", url, "--redis-password-file", str(secret),
            "--orchestrator", "127.0.0.1:1",
        )  # fmt: skip
        assert PASSWORD not in ok.stdout + ok.stderr
        snap = json.loads(ok.stdout)  # Redis answered; the orchestrator at :1 does not
        assert snap["redis"] == f"redis://:***@127.0.0.1:{server.port}/0"
        via_env = pdorch(
            "status", "--json", "--orchestrator", "127.0.0.1:1",
            env={"PDORCH_REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"},
        )  # fmt: skip
        assert PASSWORD not in via_env.stdout + via_env.stderr
        assert json.loads(via_env.stdout)["redis"] == f"redis://:***@127.0.0.1:{server.port}/0"
        argv = pdorch(
            "status", "--json", "--orchestrator", "127.0.0.1:1",
            "--redis", f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0",
        )  # fmt: skip
        assert "visible to every user" in argv.stderr


def test_without_a_tokens_file_the_orchestrator_warns_loudly(tmp_path: Path) -> None:
    lines: list[str] = []
    with RedisServer(tmp_path) as server, subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "orchestrator", "--redis", server.url,
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # bounded by the test's timeout
                lines.append(line)
                if " ready on " in line:
                    break
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert any("WARNING" in ln and "NO AUTHENTICATION" in ln for ln in lines), lines
    # and without --tls-dir, that it serves plaintext
    assert any("WARNING" in ln and "NO TLS: no --tls-dir" in ln for ln in lines), lines


def test_an_undecodable_request_without_a_token_is_unauthenticated(cluster: LocalCluster) -> None:
    """Authentication comes first: a caller without a token learns nothing of the API, not
    even how it parses (a string field that is not UTF-8 would answer INVALID_ARGUMENT)."""
    junk = b"\x0a\x02\xff\xfe"  # GenerateRequest.request_id (field 1) = two bytes, not UTF-8

    async def call(token: str | None) -> grpc.StatusCode:
        async with cluster.channel(address(cluster), token) as ch:
            method = ch.unary_stream(
                "/pdorch.v1.Orchestrator/Generate",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in method(junk, timeout=10):
                    pass
            return caught.value.code()

    assert asyncio.run(call(None)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call(TOKEN_B)) == grpc.StatusCode.INVALID_ARGUMENT
