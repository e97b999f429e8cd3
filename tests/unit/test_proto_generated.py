"""The committed gRPC code in orchestrator/api/ is what proto/generate.py makes today.

Regenerates into a temporary directory (the real generator, as `make proto` runs it) and
compares byte for byte; then a smoke test that the committed modules import, round-trip
messages and expose the stubs the servers and clients use.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import grpc
import pytest

from orchestrator.api import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "orchestrator" / "api"
GENERATOR = ROOT / "proto" / "generate.py"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
HINT = (
    "run `make proto` (regenerated here with grpcio-tools {tools} and mypy-protobuf {mypy}; "
    "other versions give other output)"
)


def _generated(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.name.endswith(GENERATED_SUFFIXES)
    }


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("proto")
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return _generated(out)


def _hint() -> str:
    return HINT.format(
        tools=metadata.version("grpcio-tools"), mypy=metadata.version("mypy-protobuf")
    )


def test_every_proto_file_generates_modules(regenerated: dict[str, bytes]) -> None:
    stems = {p.stem for p in (ROOT / "proto" / "pdorch" / "v1").glob("*.proto")}
    assert stems, "no .proto files found"
    assert {f"{stem}_pb2.py" for stem in stems} <= regenerated.keys()


def test_committed_files_are_the_generated_ones(regenerated: dict[str, bytes]) -> None:
    committed = _generated(API_DIR)
    missing = sorted(regenerated.keys() - committed.keys())
    extra = sorted(committed.keys() - regenerated.keys())
    assert not missing, f"not committed: {', '.join(missing)}; {_hint()}"
    assert not extra, f"no longer generated: {', '.join(extra)}; {_hint()}"
    stale = [name for name in sorted(regenerated) if committed[name] != regenerated[name]]
    assert not stale, f"out of date: {', '.join(stale)}; {_hint()}"


def test_generate_request_round_trips() -> None:
    request = orchestrator_pb2.GenerateRequest(
        request_id="req-1",
        chat=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="hello")],
        ),
        max_tokens=16,
        sampling=common_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=2**63 - 1),
        stop=["\n\n"],
        resume_from_index=3,
    )
    decoded = orchestrator_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.WhichOneof("prompt") == "chat"
    assert decoded.chat.messages[0].content == "hello"
    assert decoded.sampling.HasField("top_p")


def test_unset_top_p_is_distinguishable_from_zero() -> None:
    unset = common_pb2.SamplingParams.FromString(common_pb2.SamplingParams().SerializeToString())
    zero = common_pb2.SamplingParams.FromString(
        common_pb2.SamplingParams(top_p=0.0).SerializeToString()
    )
    assert not unset.HasField("top_p")
    assert zero.HasField("top_p")


def test_worker_messages_round_trip() -> None:
    decode = worker_pb2.DecodeRequest(
        request_id="req-1",
        epoch=2**64 - 1,
        token_ids=[1, 2, 2**32 - 1],
        last_token=7,
        generated=1,
        max_tokens=8,
        kv_timeout_s=2.5,
        prompt_tokens=3,
    )
    assert worker_pb2.DecodeRequest.FromString(decode.SerializeToString()) == decode
    chunk = worker_pb2.TokenChunk(
        index=4, token_ids=[9], text="x", finish_reason=common_pb2.FINISH_REASON_EOS
    )
    assert worker_pb2.TokenChunk.FromString(chunk.SerializeToString()) == chunk
    tokenize = worker_pb2.TokenizeRequest(text="hi")
    assert worker_pb2.TokenizeRequest.FromString(tokenize.SerializeToString()) == tokenize


def test_modules_live_in_orchestrator_api_but_wire_names_are_pdorch_v1() -> None:
    assert orchestrator_pb2.GenerateRequest.__module__ == "orchestrator.api.orchestrator_pb2"
    assert orchestrator_pb2.GenerateRequest.DESCRIPTOR.full_name == "pdorch.v1.GenerateRequest"
    service = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"]
    assert service.full_name == "pdorch.v1.Orchestrator"
    assert {m.name for m in service.methods} == {"Generate", "GenerateMany", "Cancel", "GetRequest"}
    assert set(worker_pb2.DESCRIPTOR.services_by_name) == {
        "PrefillService",
        "DecodeService",
        "WorkerService",
    }


def test_stubs_and_servicers_exist() -> None:
    channel = grpc.insecure_channel("localhost:1")  # lazy: connects on first call only
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        assert callable(stub.Generate)
        assert callable(stub.Cancel)
        assert callable(stub.GetRequest)
    finally:
        channel.close()
    for name in ("PrefillService", "DecodeService", "WorkerService"):
        assert hasattr(worker_pb2_grpc, f"{name}Stub")
        assert hasattr(worker_pb2_grpc, f"{name}Servicer")
        assert hasattr(worker_pb2_grpc, f"add_{name}Servicer_to_server")
    assert hasattr(orchestrator_pb2_grpc, "add_OrchestratorServicer_to_server")
