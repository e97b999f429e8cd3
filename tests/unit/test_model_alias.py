"""One model id on both engines, and the gateway's aliases for it.

Both engines serve SmolLM2 as ``smollm2-135m-instruct`` (`core.models.SMOLLM2_NAME`); the
gateway also takes ``smollm2`` (what ``--model`` calls it) and answers with the served name,
as vLLM answers a call naming any of its ``--served-model-name``s with the first.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.cli import build_parser
from orchestrator.core.models import SMOLLM2_NAME
from orchestrator.gateway.app import Gateway, served_name
from orchestrator.gateway.settings import GatewaySettings
from orchestrator.workers.model_files import MODEL_NAMES
from tests.unit.gateway_fakes import FakeBackend

SERVED = (SMOLLM2_NAME,)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def call(backend: FakeBackend, method: str, path: str, body: Any = None) -> httpx.Response:
    app = Gateway(backend, GatewaySettings()).app

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await asyncio.wait_for(client.request(method, path, json=body), 10)

    return asyncio.run(main())


def test_the_gateways_default_alias_is_the_name_both_engines_serve() -> None:
    """`GatewaySettings` cannot import the workers (torch): its default is kept equal here."""
    assert GatewaySettings().model_aliases == {"smollm2": SMOLLM2_NAME}
    assert set(GatewaySettings().model_aliases) <= set(MODEL_NAMES)  # `--model` choices


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_naming_the_alias_is_served_as_the_served_model(path: str, stream: bool) -> None:
    backend = FakeBackend(models=SERVED)
    body = CHAT if path.endswith("chat/completions") else {"prompt": "hi", "max_tokens": 3}
    resp = call(backend, "POST", path, body | {"model": "smollm2", "stream": stream})
    assert resp.status_code == 200, resp.text
    assert len(backend.inputs) == 1
    if stream:
        events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        assert {json.loads(e)["model"] for e in events[:-1]} == {SMOLLM2_NAME}
    else:
        assert resp.json()["model"] == SMOLLM2_NAME


def test_models_lists_the_served_names_only_and_finds_an_alias() -> None:
    backend = FakeBackend(models=SERVED)
    listed = call(backend, "GET", "/v1/models").json()
    assert [m["id"] for m in listed["data"]] == [SMOLLM2_NAME]
    assert call(backend, "GET", f"/v1/models/{SMOLLM2_NAME}").json()["id"] == SMOLLM2_NAME
    assert call(backend, "GET", "/v1/models/smollm2").json()["id"] == SMOLLM2_NAME


def test_an_unknown_name_or_an_alias_of_a_model_not_served_is_404() -> None:
    for served, name in [(SERVED, "gpt-5"), (SERVED, "smollm2-135m"), (("tiny",), "smollm2")]:
        backend = FakeBackend(models=served)
        resp = call(backend, "POST", "/v1/chat/completions", CHAT | {"model": name})
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "model_not_found"
        assert call(backend, "GET", f"/v1/models/{name}").status_code == 404
        assert backend.inputs == []


def test_a_served_name_means_itself_even_where_it_is_an_alias_too() -> None:
    aliases = {"smollm2": SMOLLM2_NAME}
    assert served_name("smollm2", ["smollm2"], aliases) == "smollm2"  # a DIR named smollm2
    assert served_name("smollm2", ["smollm2", SMOLLM2_NAME], aliases) == "smollm2"
    assert served_name("smollm2", [SMOLLM2_NAME], aliases) == SMOLLM2_NAME
    assert served_name("smollm2", [SMOLLM2_NAME], {}) is None


def test_vllm_workers_serve_smollm2_under_the_reference_engines_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pdorch worker --engine vllm --model smollm2` publishes `SMOLLM2_NAME`, as the
    reference engine does (`model_files.load_engine`). vLLM stands in here: not installed."""
    from orchestrator.cli import worker  # noqa: PLC0415
    from orchestrator.workers import model_files  # noqa: PLC0415
    from orchestrator.workers.vllm.cpu import reserved_cpus_env  # noqa: PLC0415

    engine = types.ModuleType("orchestrator.workers.vllm.engine")

    class VllmSettings:
        def __init__(self, **kwargs: Any) -> None:
            self.__dict__.update(kwargs)

    def vllm_host(settings: VllmSettings, metrics: object) -> VllmSettings:
        return settings

    engine.VllmSettings = VllmSettings  # type: ignore[attr-defined]
    engine.VllmHost = vllm_host  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, engine.__name__, engine)
    monkeypatch.setattr(model_files, "ensure_smollm2", lambda cache_dir=None: tmp_path)
    for key, value in reserved_cpus_env().items():  # `_vllm_host` sets them: restored after
        monkeypatch.setenv(key, value)
    argv = ["worker", "--role", "decode", "--engine", "vllm", "--model", "smollm2"]
    args = build_parser({}).parse_args(argv)
    settings: Any = worker._vllm_host(args, None, None)  # type: ignore[arg-type]
    assert (settings.name, settings.model_dir) == (SMOLLM2_NAME, tmp_path)
