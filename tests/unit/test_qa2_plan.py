"""QA pass 2 on `pdorch plan`: a price for an unknown GPU kind is the price's error, and the
explanation counts GPUs in good English."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.errors import ConfigError
from orchestrator.planning.planconfig import plan_request_from_mapping
from orchestrator.planning.planner import plan


def test_a_price_for_an_unknown_kind_is_labelled_price(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--price", "FOO=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdorch plan: price: unknown GPU kind 'FOO' (known: H100, ")
    assert "gpus:" not in err


def test_a_price_in_the_document_for_an_unknown_kind_is_labelled_price() -> None:
    with pytest.raises(ConfigError, match=r"^price: unknown GPU kind 'FOO'") as info:
        plan_request_from_mapping({"prices": {"FOO": 1.0}})
    assert info.value.field == "price"


def test_a_price_matches_its_kind_case_insensitively() -> None:
    request = plan_request_from_mapping({"prices": {"h100": 1.5}})
    assert request.gpus["H100"].price_per_hour == 1.5


def test_one_gpu_is_one_gpu_in_the_explanation() -> None:
    # 1 req/s of short prompts: one colocated H100 carries it (test_planner's low-rate case)
    request = plan_request_from_mapping(
        {"traffic": {"rate": 1.0, "prompt": 256, "output": 128}, "plan": {"kinds": ["H100"]}}
    )
    p = plan(request)
    assert p.recommended is not None
    assert p.recommended.estimate is not None
    assert p.recommended.estimate.gpus == 1
    assert "on 1 GPU (" in p.reason
    assert "1 GPUs" not in p.reason
