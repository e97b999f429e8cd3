"""pdorch's logits processor for vLLM (`orchestrator.workers.vllm.sampler`), driven the way
vLLM's input batch drives it — batch updates, then ``apply`` on a step's logits — without an
engine (fast; in the vLLM environment because it subclasses vLLM's interface)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from vllm import SamplingParams as VllmSampling
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from orchestrator.core.sampling import SamplingParams, sample
from orchestrator.workers.vllm.sampler import EXTRA_ARGS_KEY, PdorchSampler, draws, extra_args

pytestmark = pytest.mark.vllm

VOCAB = 49152  # SmolLM2's


def _vllm(params: SamplingParams, offset: int) -> VllmSampling:
    return VllmSampling(temperature=0.0, extra_args=extra_args(params, offset))


def _update(
    size: int,
    added: Sequence[tuple[int, VllmSampling, list[int]]] = (),
    removed: Sequence[int] = (),
    moved: Sequence[tuple[int, int, MoveDirectionality]] = (),
) -> BatchUpdate:
    return BatchUpdate(size, removed, [(i, p, [1, 2, 3], out) for i, p, out in added], moved)


def _chosen(row: torch.Tensor) -> int:
    """The one token a processed row leaves finite."""
    (finite,) = torch.isfinite(row).nonzero(as_tuple=True)
    assert len(finite) == 1
    return int(finite[0])


def test_sampled_rows_draw_at_their_output_index_and_greedy_rows_are_untouched() -> None:
    """Rows carrying pdorch's parameters keep only ``sample(row, params, offset + generated)``
    (vLLM's live output list counts the generated tokens: appending to it moves the index);
    a greedy row's logits are not touched; removal, moves and swaps carry each row's state
    to its new batch index."""
    proc = PdorchSampler(None, torch.device("cpu"), False)
    a, b = SamplingParams(0.8, 0.95, seed=1), SamplingParams(1.2, 1.0, seed=2)
    out_a: list[int] = []
    out_b = [5, 6]  # a row re-added after vLLM preempted it: two tokens already out
    rows = [
        (0, _vllm(a, 7), out_a),
        (1, VllmSampling(temperature=0.0), []),
        (2, _vllm(b, 0), out_b),
    ]
    proc.update_state(_update(3, rows))
    rng = np.random.default_rng(0)
    for step in range(3):
        logits = torch.from_numpy(rng.standard_normal((3, VOCAB)).astype(np.float32) * 4)
        before = logits.clone()
        got = proc.apply(logits)
        assert _chosen(got[0]) == sample(before[0].numpy(), a, 7 + step)
        assert torch.equal(got[1], before[1])  # greedy: vLLM's own argmax decides
        assert _chosen(got[2]) == sample(before[2].numpy(), b, 2 + step)
        out_a.append(_chosen(got[0]))
        out_b.append(_chosen(got[2]))
        proc.update_state(None)  # a step without batch changes
    proc.update_state(_update(2, removed=[1], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    proc.update_state(_update(2, moved=[(0, 1, MoveDirectionality.SWAP)]))
    logits = torch.from_numpy(rng.standard_normal((2, VOCAB)).astype(np.float32))
    before = logits.clone()
    got = proc.apply(logits)
    assert _chosen(got[0]) == sample(before[0].numpy(), b, 5)
    assert _chosen(got[1]) == sample(before[1].numpy(), a, 10)
    proc.update_state(_update(0, removed=[0, 1]))
    logits = torch.zeros(1, VOCAB)
    assert torch.equal(proc.apply(logits), torch.zeros(1, VOCAB))


def test_a_continuation_draws_what_the_uninterrupted_request_draws() -> None:
    """The same logits at output index 9: one vLLM request that has generated 9 tokens and a
    new one started at offset 9 (after a prefill/decode split or a failover) pick the same
    token."""
    params = SamplingParams(0.9, 0.9, seed=77)
    logits = torch.from_numpy(np.random.default_rng(5).standard_normal((1, VOCAB)) * 3).float()
    tokens = []
    for offset, generated in ((0, list(range(9))), (9, [])):
        proc = PdorchSampler(None, torch.device("cpu"), False)
        proc.update_state(_update(1, [(0, _vllm(params, offset), generated)]))
        tokens.append(_chosen(proc.apply(logits.clone())[0]))
    assert tokens[0] == tokens[1] == sample(logits[0].numpy(), params, 9)


@pytest.mark.parametrize(
    "entry",
    [
        {"temperature": 0.0, "top_p": 1.0, "seed": 1, "offset": 0},  # greedy carries none
        {"temperature": 0.8, "top_p": 1.5, "seed": 1, "offset": 0},
        {"temperature": 0.8, "top_p": 1.0, "seed": 1, "offset": -1},
        {"temperature": 0.8, "top_p": 1.0, "seed": 1},
        {"temperature": "hot", "top_p": 1.0, "seed": 1, "offset": 0},
    ],
)
def test_malformed_entries_are_refused(entry: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=EXTRA_ARGS_KEY):
        PdorchSampler.validate_params(
            VllmSampling(temperature=0.0, extra_args={EXTRA_ARGS_KEY: entry})
        )


def test_vllms_own_sampling_is_refused_with_pdorchs_draw() -> None:
    """vLLM sampling the row itself would override pdorch's draw: the entry demands greedy."""
    sampled = VllmSampling(temperature=0.7, extra_args=extra_args(SamplingParams(0.7), 0))
    with pytest.raises(ValueError, match="greedy"):
        PdorchSampler.validate_params(sampled)
    PdorchSampler.validate_params(_vllm(SamplingParams(0.7), 0))
    PdorchSampler.validate_params(VllmSampling(temperature=0.0))


def test_penalty_top_k_min_p_and_min_tokens_draw_as_pdorch_defines_them() -> None:
    """Issue 17 defect 12 on vLLM: the row's history is vLLM's prompt list plus its live
    outputs (the penalty), its EOS ids ride in the entry (min_tokens); a greedy request with
    either now carries an entry (vLLM's argmax would ignore both)."""
    params = SamplingParams(
        0.8, 0.95, seed=3, top_k=40, min_p=0.01, repetition_penalty=1.4, min_tokens=5
    )
    greedy = SamplingParams(repetition_penalty=1.4)
    assert draws(params)
    assert draws(greedy)
    assert not draws(SamplingParams())
    eos = (7, 9)
    prompt = [1, 2, 3]  # what `_update` gives every added row
    outputs: list[int] = [4]
    greedy_out: list[int] = []
    proc = PdorchSampler(None, torch.device("cpu"), False)
    proc.update_state(
        _update(
            2,
            [
                (0, VllmSampling(temperature=0.0, extra_args=extra_args(params, 2, eos)), outputs),
                (1, VllmSampling(temperature=0.0, extra_args=extra_args(greedy, 0)), greedy_out),
            ],
        )
    )
    rng = np.random.default_rng(2)
    for _ in range(4):
        logits = torch.from_numpy(rng.standard_normal((2, VOCAB)).astype(np.float32) * 4)
        logits[:, 7] = 50.0  # EOS is the argmax: masked while index < 5
        before = logits.clone()
        got = proc.apply(logits)
        index = 2 + len(outputs)
        want = sample(before[0].numpy(), params, index, [*prompt, *outputs], eos)
        assert _chosen(got[0]) == want
        if index < 5:
            assert want not in eos
        want_greedy = sample(before[1].numpy(), greedy, len(greedy_out), [*prompt, *greedy_out])
        assert _chosen(got[1]) == want_greedy
        outputs.append(want)
        greedy_out.append(want_greedy)
        proc.update_state(None)
