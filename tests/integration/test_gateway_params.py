"""Issue 17 defects 12 and 13 through the gateway on a real local cluster (tiny model, one
prefill and one decode worker, real processes): sampling parameters benchmark clients send
are honoured, not ignored; log probabilities and ``echo`` answer what lm-evaluation-harness's
``local-completions`` model reads (its requests are made here the way it makes them:
token-id prompts, ``echo``, ``logprobs=1``, ``max_tokens=1``)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from orchestrator.api import orchestrator_pb2
from orchestrator.cluster import LocalCluster
from orchestrator.workers.model_files import load_engine, tiny_tokenizer
from tests.integration.conftest import collect, request, run
from transport.ucx import ucx_available

TRANSPORT = "ucx" if ucx_available() else "tcp"
PROMPT = "Name three colours."
EARLY_EOS_SEED = 42
"""With this seed, temperature 1 and PROMPT the tiny model samples an end-of-sequence token
within 32 tokens (asserted below, so the test cannot pass vacuously)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="tiny", transport=TRANSPORT, prefill_workers=1, decode_workers=1, gateway=True
    )
    with c:
        yield c


@pytest.fixture(scope="module")
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{cluster.gateway_urls[0]}/v1", timeout=120) as c:
        yield c


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = http.post(path, json={"model": "tiny"} | body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": "tiny", "stream": True} | body) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# ------------------------------------------------------------------ defect 12


def test_ignore_eos_and_min_tokens_give_every_token_asked_for(http: httpx.Client) -> None:
    """Benchmark clients send ignore_eos to get exactly max_tokens: 32 asked, 2-25 came back
    (the EOS ended them), with a 200."""
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 1.0, "seed": EARLY_EOS_SEED}
    plain = _post(http, "/completions", body)
    assert plain["usage"]["completion_tokens"] < 32  # this seed samples EOS early
    assert plain["choices"][0]["finish_reason"] == "stop"
    for extra in ({"ignore_eos": True}, {"min_tokens": 32}):
        got = _post(http, "/completions", body | extra)
        assert got["usage"]["completion_tokens"] == 32, extra
        assert got["choices"][0]["finish_reason"] == "length"
        if "ignore_eos" in extra:  # the same draws (min_tokens masks EOS: other draws)
            assert got["choices"][0]["text"].startswith(plain["choices"][0]["text"])


def test_top_k_min_p_and_repetition_penalty_change_the_draw(http: httpx.Client) -> None:
    """top_k 1 and min_p 1 leave one candidate: the greedy answer, at temperature 1; a
    repetition penalty changes a greedy answer that repeats itself."""
    greedy = _post(http, "/completions", {"prompt": "a", "max_tokens": 12, "temperature": 0})
    text = greedy["choices"][0]["text"]
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        body = {"prompt": "a", "max_tokens": 12, "temperature": 1.0, "seed": 3} | extra
        assert _post(http, "/completions", body)["choices"][0]["text"] == text, extra
    penalised = _post(
        http,
        "/completions",
        {"prompt": "a", "max_tokens": 12, "temperature": 0, "repetition_penalty": 3.0},
    )
    assert penalised["choices"][0]["text"] != text


def test_a_stop_string_counts_the_tokens_up_to_the_one_completing_it(http: httpx.Client) -> None:
    """A non-streamed answer comes in chunks of many tokens (its window is a second): the
    tokens the worker produced after the one completing the stop string are not the
    client's — not counted in the usage — as one vLLM stopping itself would count them."""
    base = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    full = _post(http, "/completions", base | {"max_tokens": 24})["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3, full
    assert full.find(stop) > 0, full
    needed = next(
        k
        for k in range(1, 25)
        if stop in _post(http, "/completions", base | {"max_tokens": k})["choices"][0]["text"]
    )
    assert needed < 24  # else nothing after it to leave out
    got = _post(http, "/completions", base | {"max_tokens": 24, "stop": [stop]})
    assert got["choices"][0]["text"] == full[: full.find(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == needed


def test_continuous_usage_stats_in_every_chunk(http: httpx.Client) -> None:
    events = _events(
        http,
        "/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    usages = [e["usage"] for e in events]
    assert len(usages) == len(events) > 2
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts)
    assert counts[0] == 0
    assert counts[-1] == 6
    assert len({u["prompt_tokens"] for u in usages}) == 1
    assert usages[0]["prompt_tokens"] > 0


def test_out_of_range_values_are_400s_naming_the_parameter(http: httpx.Client) -> None:
    for body, param in [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ]:
        resp = http.post("/completions", json={"model": "tiny", "prompt": "x"} | body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param


# ------------------------------------------------------------------ defect 13


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(http: httpx.Client) -> None:
    """lm-eval local-completions' log-likelihood request: the context and continuation as
    token ids, echo, logprobs=1, max_tokens=1; it sums token_logprobs[ctxlen:-1] and checks
    each continuation token is the top one. The numbers equal the reference engine's."""
    context, continuation = list(b"The sky is"), list(b" blue")
    ids = context + continuation
    body = {
        "prompt": [ids],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
    }
    out = _post(http, "/completions", body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the generated token
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    assert choice["text"].startswith("The sky is blue")
    assert lp["tokens"][: len(ids)] == [bytes([b]).decode("latin-1") for b in ids]
    ctxlen = len(context)
    scored = lp["token_logprobs"][ctxlen:-1]
    expected = _reference_logprobs(ids)[ctxlen - 1 :]
    np.testing.assert_allclose(scored, expected, rtol=1e-4, atol=1e-4)
    for tok, top in zip(scored, lp["top_logprobs"][ctxlen:-1], strict=True):
        assert tok <= max(top.values()) + 1e-9  # lm-eval's is_greedy test reads these
    # The generated token's log probability is the greedy one (the top alternative).
    last_top = lp["top_logprobs"][-1]
    assert lp["token_logprobs"][-1] == pytest.approx(max(last_top.values()))
    streamed = _events(http, "/completions", body)
    tokens = [t for e in streamed if e["choices"][0]["logprobs"] for t in _tokens(e)]
    assert tokens == lp["tokens"]
    first = streamed[0]["choices"][0]
    assert first["text"].startswith("The sky is blue")


def _tokens(event: dict[str, Any]) -> list[str]:
    tokens: list[str] = event["choices"][0]["logprobs"]["tokens"]
    return tokens


def _reference_logprobs(ids: list[int]) -> list[float]:
    """Token j's log probability after tokens 0..j-1, straight from transformers (j >= 1)."""
    model = load_engine("tiny").model
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_chat_logprobs_whole_and_streamed_agree(http: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "temperature": 0.8,
        "seed": 5,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = _post(http, "/chat/completions", body)
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 8
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert entry["logprob"] <= tops[0] + 1e-9
    streamed = [
        item
        for e in _events(http, "/chat/completions", body)
        if e["choices"] and e["choices"][0]["logprobs"]
        for item in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content  # the same request id is not reused: same seed, same draw


# ------------------------------------------------- lm-evaluation-harness's log-likelihood

TASK_DIR = Path(__file__).resolve().parents[2] / "evals" / "lm_eval"


def _loglikelihood(http: httpx.Client, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval's ``local-completions`` computes for one (context, continuation): it
    tokenizes both (the tiny model's tokenizer is bytes), sends the token ids with echo,
    logprobs=1, max_tokens=1, and reads token_logprobs[ctxlen:-1] and top_logprobs."""
    ctx = list(context.encode())
    whole = list((context + continuation).encode())
    payload = {
        "prompt": [whole],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    choice = _post(http, "/completions", payload)["choices"][0]
    lps = choice["logprobs"]["token_logprobs"][len(ctx) : -1]
    tops = choice["logprobs"]["top_logprobs"][len(ctx) : -1]
    assert len(lps) == len(whole) - len(ctx)
    greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))
    return float(sum(lps)), greedy


def test_the_shipped_multiple_choice_task_scores_as_lm_eval_scores_it(
    http: httpx.Client,
) -> None:
    """evals/lm_eval/pdorch_mc: every choice's log-likelihood through the gateway equals
    the reference computation; accuracy is the share of questions whose answer scores
    highest (the tiny model's weights are random: the number is not the point)."""
    docs = [json.loads(line) for line in (TASK_DIR / "pdorch_mc.jsonl").read_text().splitlines()]
    assert len(docs) == 8
    correct = 0
    for doc in docs:
        scores = []
        for choice in doc["choices"]:
            score, _greedy = _loglikelihood(http, doc["question"], choice)
            ids = list((doc["question"] + choice).encode())
            ctxlen = len(doc["question"].encode())
            expected = sum(_reference_logprobs(ids)[ctxlen - 1 :])
            assert score == pytest.approx(expected, abs=1e-3)
            scores.append(score)
        correct += int(np.argmax(scores)) == doc["answer"]
    assert 0 <= correct <= len(docs)


def _lm_eval() -> str | None:
    """An lm-eval command to run: ``$PDORCH_LM_EVAL``, or ``lm_eval`` on the PATH, or this
    Python's module when the ``lmeval`` extra is installed."""
    if os.environ.get("PDORCH_LM_EVAL"):
        return os.environ["PDORCH_LM_EVAL"]
    if shutil.which("lm_eval"):
        return "lm_eval"
    if importlib.util.find_spec("lm_eval") is not None:
        return f"{sys.executable} -m lm_eval"
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(_lm_eval() is None, reason="lm-eval not installed (the lmeval extra)")
def test_lm_eval_local_completions_runs_the_shipped_task(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """lm-evaluation-harness itself, its ``local-completions`` model against the gateway."""
    command = _lm_eval()
    assert command is not None
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    args = [
        "--model",
        "local-completions",
        "--model_args",
        f"model=tiny,base_url={cluster.gateway_urls[0]}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={tmp_path / 'tokenizer'},"
        "num_concurrent=1,max_retries=1,tokenized_requests=True",
        "--include_path",
        str(TASK_DIR),
        "--tasks",
        "pdorch_mc",
        "--output_path",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(
        [*shlex.split(command), *args],
        cwd=TASK_DIR.parents[1],
        env=os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout[-2000:])  # lm-eval's results table (pytest -s shows it)
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())
    acc = results["results"]["pdorch_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0


# ------------------------------------------------------- gRPC: resumed from the journal


def test_a_resumed_grpc_stream_returns_the_same_logprobs(cluster: LocalCluster) -> None:
    """Log probabilities ride with their tokens in the journal: a client resuming a stream
    (or attaching again with the same id) gets exactly what the first stream carried —
    nothing is recomputed."""
    req = request(PROMPT, max_tokens=12, request_id="lp-resume", temperature=0.9, seed=8)
    req.sampling.ignore_eos = True
    req.sampling.logprobs = 2
    req.sampling.prompt_logprobs = 1
    address = cluster.orchestrator_addresses[0]
    _, _, first = run(collect(address, req))  # type: ignore[misc]
    lps = [lp for c in first for lp in c.logprobs]
    assert len(lps) == 12
    assert [lp.token_id for lp in lps] == [t for c in first for t in c.token_ids]
    prompt = [lp for c in first for lp in c.prompt_logprobs]
    assert len(prompt) == len(PROMPT.encode())
    assert not prompt[0].HasField("logprob")
    again = orchestrator_pb2.GenerateRequest()
    again.CopyFrom(req)
    _, _, replay = run(collect(address, again))  # type: ignore[misc]
    assert [lp for c in replay for lp in c.logprobs] == lps
    assert [lp for c in replay for lp in c.prompt_logprobs] == prompt
    again.resume_from_index = 5
    _, _, resumed = run(collect(address, again))  # type: ignore[misc]
    assert [lp for c in resumed for lp in c.logprobs] == lps[5:]
    assert [lp for c in resumed for lp in c.prompt_logprobs] == []
