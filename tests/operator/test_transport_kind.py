"""``spec.transport.kind``: every `pdorch worker --transport` choice, ``ucx-read`` included,
is accepted by the CRD and the parser and reaches the workers' command lines; junk is
refused by both, naming the field."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from orchestrator.cli import build_parser
from orchestrator.operator.errors import SpecError
from orchestrator.operator.spec import TRANSPORTS, Transport, parse_spec
from tests.operator.conftest import FULL_SPEC, MINIMAL_SPEC, rendered, spec_with
from tests.operator.test_schemas import _crd_schema
from transport.backend_names import BACKENDS

UCX = {"transports": ["rc", "cuda_copy"], "devices": ["mlx5_0:1"]}


def _worker_args(raw: dict[str, Any], role: str) -> Any:
    (container,) = rendered(raw)["Deployment", f"llama-{role}"]["spec"]["template"]["spec"][
        "containers"
    ]
    env = {"$(POD_IP)": "10.1.2.3", "$(POD_NAME)": "pod-0"}
    return build_parser().parse_args([env.get(a, a) for a in container["args"]])


def test_the_choices_are_the_transports_and_the_crd_enum() -> None:
    assert TRANSPORTS == BACKENDS
    assert "ucx-read" in TRANSPORTS
    kind = _crd_schema()["properties"]["spec"]["properties"]["transport"]["properties"]["kind"]
    assert tuple(kind["enum"]) == TRANSPORTS


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_kind_parses_and_reaches_the_workers(kind: str, role: str) -> None:
    raw = spec_with(MINIMAL_SPEC, "transport", {"kind": kind})
    jsonschema.Draft7Validator(_crd_schema()).validate({"spec": raw})
    assert parse_spec(raw).transport == Transport(kind=kind)
    assert _worker_args(raw, role).transport == kind


def test_ucx_read_takes_the_ucx_options() -> None:
    spec = parse_spec(spec_with(FULL_SPEC, "transport", {"kind": "ucx-read", "ucx": UCX}))
    assert spec.transport == Transport("ucx-read", ("rc", "cuda_copy"), ("mlx5_0:1",))
    config = rendered(spec_with(FULL_SPEC, "transport", {"kind": "ucx-read", "ucx": UCX}))[
        "ConfigMap", "llama-config"
    ]["data"]
    assert (config["UCX_TLS"], config["UCX_NET_DEVICES"]) == ("rc,cuda_copy", "mlx5_0:1")


@pytest.mark.parametrize("kind", ["rdma", "UCX-READ", "ucx_read", "ucx-read ", "", 1])
def test_junk_kinds_are_refused_by_parser_and_crd(kind: Any) -> None:
    raw = spec_with(MINIMAL_SPEC, "transport", {"kind": kind})
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    assert info.value.field == "spec.transport.kind"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_crd_schema()).validate({"spec": raw})


def test_ucx_options_with_tcp_are_refused() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(MINIMAL_SPEC, "transport", {"kind": "tcp", "ucx": UCX}))
    assert info.value.field == "spec.transport.ucx"
    assert "ucx or ucx-read" in str(info.value)
