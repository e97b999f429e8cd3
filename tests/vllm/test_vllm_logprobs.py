"""Log probabilities from vLLM workers (issue 17 defect 13): a request split across a vLLM
prefill worker and a vLLM decode worker returns the prompt's and every output token's
log-probabilities — the prefill's response carries the prompt's and the first token's, the
decode stream the rest — equal to the log-softmax of transformers' raw logits on the same
model, although pdorch's seeded draw picks the tokens inside vLLM. `test_vllm_worker`
checks the aggregated path; `test_logprob_conversion` vLLM's mapping → pdorch's ranking."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.cluster import LocalCluster
from tests.vllm.conftest import logprob_errors, prompt_ids, scored_stream

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def pd_cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="smollm2", engine="vllm", transport="tcp", prefill_workers=1, decode_workers=1,
        ready_timeout_s=900,
    )  # fmt: skip
    with c:
        yield c


def test_pd_log_probabilities_equal_transformers(pd_cluster: LocalCluster) -> None:
    """Split in two (prefill on one vLLM engine, decode on the other), seeded: the prompt's
    log-probabilities (first token unscored) and each output token's, with 5 alternatives,
    are transformers' within 1e-3."""
    prompt = prompt_ids("The capital of France is")
    chunks = scored_stream(pd_cluster, prompt, "lp")
    assert (chunks[-1].prefill_worker, chunks[-1].decode_worker) == ("prefill-0", "decode-0")
    assert logprob_errors(prompt, chunks) == []
