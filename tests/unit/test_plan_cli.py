"""`pdorch plan`: input documents (`orchestrator.planning.planconfig`), table, JSON, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.errors import ConfigError
from orchestrator.planning.planconfig import (
    overlay,
    parse_price,
    parse_text,
    plan_request_from_mapping,
)
from orchestrator.planning.traffic import Fixed, LogNormal


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", "--json", *argv]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_json_for_a_low_rate_recommends_one_colocated_h100(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = run_json(
        capsys,
        "--model=llama-3-8b",
        "--rate=1",
        "--prompt-tokens=256",
        "--output-tokens=128",
        "--gpus=H100",
    )
    assert out["recommended"] == "colocated H100"
    assert out["model"]["params"] == 8_029_995_008
    assert out["model"]["kv_bytes_per_token"] == 131_072
    assert out["traffic"]["prompt"] == {"dist": "fixed", "tokens": 256, "mean": 256.0, "p90": 256}
    assert [lay["name"] for lay in out["layouts"]] == ["colocated H100", "H100 -> H100"]
    best = out["layouts"][0]
    assert best["gpus"] == 1
    assert best["pools"][0]["replicas"] == 1
    # $2.50/h carrying 3,600 requests/h -> $0.694444 per 1,000 requests
    assert best["usd_per_1k_requests"] == pytest.approx(0.694444, abs=1e-6)
    assert out["layouts"][1]["usd_per_1k_requests"] == pytest.approx(1.388889, abs=1e-6)
    assert out["gpus"]["H100"]["price_per_hour"] == 2.5


def test_price_flag_and_infeasible_layouts_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--model=llama-3-70b", "--gpus=H100,L4,T4", "--price=H100=2")
    by_name = {lay["name"]: lay for lay in out["layouts"]}
    assert out["gpus"]["H100"]["price_per_hour"] == 2.0
    assert by_name["H100 -> L4"]["feasible"] is False
    assert by_name["H100 -> L4"]["reasons"][0].startswith("memory: 141.1 GB of weights")
    assert by_name["H100 -> T4"]["reasons"][0].startswith("dtype: T4 has no bf16")
    assert "pools" not in by_name["H100 -> T4"]
    assert out["recommended"] in {"colocated H100", "H100 -> H100"}


def test_table_for_people(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpus", "H100,T4", "--allow-fp16"]) == 0
    text = capsys.readouterr().out
    assert "model    llama-3-8b: bf16, 8.03 B params, 16.1 GB weights, 128 KiB KV/token" in text
    assert "SLO      TTFT <= 1000 ms for the p90 prompt (4096 tokens); TPOT <= 50 ms" in text
    assert "layout" in text
    assert "$/1k req" in text
    assert "infeasible:" in text
    assert "colocated T4: memory: 16.1 GB of weights" in text
    assert "recommended: colocated H100" in text
    assert "prices per GPU-hour: H100 $2.50" in text


def test_config_file_with_flags_laid_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "plan.toml"
    config.write_text(
        """
[model]
preset = "smollm2-135m"

[traffic]
rate = 50
prompt = {dist = "fixed", tokens = 512}
output = 64

[slo]
ttft_ms = 500
tpot_ms = 20

[plan]
kinds = ["H100", "L4"]

[gpus.L4]
price_per_hour = 0.5
""",
        encoding="utf-8",
    )
    out = run_json(capsys, "--config", str(config), "--rate", "80")
    assert out["model"]["name"] == "smollm2-135m"
    assert out["traffic"]["rate_rps"] == 80.0  # the flag wins over the file
    assert out["slo"] == {"ttft_ms": 500.0, "tpot_ms": 20.0, "percentile": 0.9}
    assert out["gpus"]["L4"]["price_per_hour"] == 0.5
    assert {lay["name"] for lay in out["layouts"]} == {
        "colocated H100",
        "colocated L4",
        "H100 -> H100",
        "H100 -> L4",
    }


def test_gpu_file_in_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps({"T4": {"price_per_hour": 0.2, "bf16_tflops": 65}}))
    out = run_json(capsys, "--gpu-file", str(gpus), "--gpus", "T4", "--model", "smollm2-135m")
    assert out["gpus"]["T4"]["bf16_tflops"] == 65.0  # pretend bf16: no longer refused
    assert out["layouts"][0]["feasible"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "-1"], "traffic.rate: must be > 0 requests/s, got -1.0"),
        (["--prompt-tokens", "lognormal:1024"], "traffic.prompt: lognormal takes 2 number(s)"),
        (["--gpus", "H100,B300"], "unknown GPU kind 'B300'"),
        (["--price", "H100=cheap"], "price: expected KIND=USD_PER_HOUR"),
        (["--price", "Z1=1"], "unknown GPU kind 'Z1'"),
        (["--model", "gpt-9"], "model.preset: unknown preset 'gpt-9'"),
        (["--tpot-ms", "0"], "slo.tpot_s: must be > 0 seconds"),
        (["--config", "/nonexistent/plan.toml"], "No such file or directory"),
    ],
)
def test_bad_inputs_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pdorch plan: ")
    assert message in captured.err


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("[traffic]\nrte = 5\n", "traffic.rte: unknown key (known: rate, prompt, output)"),
        ("[trafic]\nrate = 5\n", "trafic: unknown section"),
        ("[model]\nlayers = 2\n", "model.hidden: required without a preset"),
        ("[model]\npreset = 'llama-3-8b'\nlayers = 0\n", "model.layers: must be an integer >= 1"),
        ("[plan]\nmax_batch = 1.5\n", "plan.max_batch: must be an integer"),
        ("[plan]\nallow_fp16 = 'yes'\n", "plan.allow_fp16: must be true or false"),
        ("[plan]\nkinds = []\n", "plan.kinds: needs at least one GPU kind"),
        ("[slo]\nttft_ms = 'fast'\n", "slo.ttft_ms: must be a number"),
        ("[efficiency]\ncompute = 2\n", "efficiency.compute: must be in (0, 1]"),
        ("[gpus.H100]\nbandwidth = 1\n", "gpus.H100.bandwidth: unknown field"),
        ("[prices]\nH100 = -1\n", "price.H100.price_per_hour: must be >= 0"),
        ("traffic = 3\n", "traffic: must be a table"),
    ],
)
def test_bad_documents(doc: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_request_from_mapping(parse_text(doc, "toml"))
    assert message in str(info.value)


def test_documents_parse_and_overlay() -> None:
    with pytest.raises(ConfigError, match="config: not valid TOML"):
        parse_text("[model\n", "toml")
    with pytest.raises(ConfigError, match="config: must be a JSON object"):
        parse_text("[1, 2]", "json")
    data = overlay({"gpus": {"H100": {"price_per_hour": 2}}}, {"gpus.H100": {"max_tp": 4}})
    assert data == {"gpus": {"H100": {"price_per_hour": 2, "max_tp": 4}}}
    assert parse_price(" L4 = 0.5") == ("L4", 0.5)


def test_explicit_model_and_defaults() -> None:
    req = plan_request_from_mapping(
        {
            "model": {
                "layers": 2,
                "hidden": 1024,
                "heads": 8,
                "kv_heads": 2,
                "intermediate": 4096,
                "vocab": 1000,
                "dtype": "fp16",
            }
        }
    )
    assert (req.model.name, req.model.layers, req.model.dtype) == ("custom", 2, "fp16")
    assert req.traffic.rate == 20.0
    assert req.traffic.prompt == LogNormal(1024, 4096)
    assert req.traffic.output == Fixed(256)
    assert (req.slo.ttft_s, req.slo.tpot_s, req.slo.percentile) == (1.0, 0.05, 0.9)
    assert req.kinds == ("H100", "A100", "L40S", "L4", "T4")
    assert req.prefill_kinds == ("H100",)
