"""`pdorch bench precision`: its definitions (pure) and a run on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.bench.precision import (
    MAX_DISAGREEMENT_PCT,
    PromptResult,
    prompts_from_text,
    render,
    summarize,
)
from orchestrator.bench.precision_run import GREEDY, default_prompts, generate, run_precision
from orchestrator.workers.model_files import tiny_engine


@pytest.mark.parametrize(
    ("ref", "cand", "div", "matched", "positional"),
    [
        ((1, 2, 3, 4), (1, 2, 3, 4), None, 4, 4),
        ((1, 2, 3, 4), (1, 2, 9, 4), 2, 2, 3),  # a later match does not count
        ((1, 2, 3, 4), (1, 2), 2, 2, 2),  # the candidate stopped early (EOS)
        ((1, 2), (1, 2, 3, 4), 2, 2, 2),
        ((5,), (6,), 0, 0, 0),
    ],
)
def test_first_divergence_and_agreement(
    ref: tuple[int, ...], cand: tuple[int, ...], div: int | None, matched: int, positional: int
) -> None:
    r = PromptResult("p", ref, cand)
    assert r.first_divergence == div
    assert r.matched == matched
    assert r.length == max(len(ref), len(cand))
    assert r.positional_equal == positional


def report(results: list[PromptResult], dtype: str = "fp8") -> object:
    return summarize("m", dtype, 4, results, 0.25)


def test_agreement_is_token_weighted_and_one_percent_is_the_line() -> None:
    same = [PromptResult(f"p{i}", tuple(range(100)), tuple(range(100))) for i in range(9)]
    # 1 token of 1000 lost: 0.1% disagreement -> recommended
    off_by_one = PromptResult("x", tuple(range(100)), (*range(99), 7))
    r = summarize("m", "fp8", 100, [*same, off_by_one], 0.25)
    assert r.disagreement_pct == pytest.approx(0.1)
    assert r.recommended
    assert r.verdict.startswith("recommend fp8")
    # a divergence at 50 of 100 in one prompt of ten: 5% -> refused
    half = PromptResult("y", tuple(range(100)), (*range(50), 7, 7))
    r = summarize("m", "fp8", 100, [*same, half], 0.25)
    assert r.disagreement_pct == pytest.approx(5.0)
    assert not r.recommended
    assert r.verdict.startswith("do NOT use fp8")
    assert r.identical_prompts == 9
    d = r.to_dict()
    assert d["threshold_pct"] == MAX_DISAGREEMENT_PCT
    assert d["per_prompt"][-1]["first_divergence"] == 50
    assert "do NOT use fp8" in render(r)


def test_exactly_one_percent_is_still_recommended() -> None:
    r = summarize("m", "fp8", 100, [PromptResult("p", tuple(range(100)), (*range(99), 7))], 1)
    assert r.disagreement_pct == pytest.approx(1.0)
    assert r.recommended


def test_prompt_files_and_the_default_set() -> None:
    assert prompts_from_text("# comment\n\n a \nb\n") == ["a", "b"]
    prompts = default_prompts()
    assert len(prompts) == 20
    assert len(set(prompts)) == 20


@pytest.mark.slow  # runs the tiny model end to end (make test runs it)
def test_fp16_keeps_the_tiny_models_tokens_and_the_kv_passes_through_the_wire() -> None:
    engine = tiny_engine()
    r = run_precision(engine, "fp16", ["What is the capital of France?", "Hello"], 24)
    assert r.kv_bytes_ratio == 0.5
    assert [len(x.reference) for x in r.results] == [24, 24]
    assert r.agreement_pct == 100.0
    assert r.recommended


@pytest.mark.slow  # runs the tiny model end to end (make test runs it)
def test_the_candidate_really_differs_when_the_kv_is_junk() -> None:
    """The comparison is sensitive: zeroed KV must change the tokens (no vacuous 100%)."""
    engine = tiny_engine()
    ids = engine.chat_tokens([("user", "Tell me a story")])
    result = engine.prefill(ids, GREEDY)
    ref = generate(engine, result.kv, ids, result.first_token, 24)
    zeroed = [(k * 0, v * 0) for k, v in result.kv]
    junk = generate(engine, zeroed, ids, result.first_token, 24)
    assert PromptResult("p", tuple(ref), tuple(junk)).first_divergence is not None


def bench(*args: str, check: bool) -> subprocess.CompletedProcess[str]:
    cmd = ["bench", "precision", "--model", "tiny", "--dtype", "fp8", "--max-tokens", "8"]
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *cmd, "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


@pytest.mark.slow  # runs the tiny model end to end (make test runs it)
def test_cli_json(tmp_path: Path) -> None:
    out = bench("--prompts", "/dev/null", check=False)
    assert out.returncode == 2
    assert "no prompts" in out.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\nWhat is 2+2?\n")
    out = bench("--prompts", str(prompts), check=True)
    d = json.loads(out.stdout)
    assert d["prompts"] == 2
    assert d["dtype"] == "fp8"
    assert d["kv_bytes_ratio"] == pytest.approx(0.25, abs=0.01)
    assert d["recommended"] == (d["disagreement_pct"] <= 1.0)
