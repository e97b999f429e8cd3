"""pdorch's draw inside vLLM: a v1 logits processor, so that seeded sampling on vLLM keeps
pdorch's contract (`orchestrator.core.sampling`): output token *i* of a request is
``sample(logits, params, i)``, whoever computes it.

Why not vLLM's own seeded sampling: vLLM seeds a generator per vLLM request and draws from
it in order, so a request continued in another vLLM request — decode after a prefill on
another worker, a continuation after a failover — restarts the generator and diverges from
the uninterrupted stream. Here the draw is a function of (logits, seed, output index) only.

How: the engine host asks vLLM for **greedy** sampling and puts pdorch's parameters and the
request's output offset (tokens generated before this vLLM request) in
``SamplingParams.extra_args[EXTRA_ARGS_KEY]`` (`extra_args`). `PdorchSampler` — loaded by
vLLM in its worker process from `PROCESSOR` (``logits_processors=`` engine argument; the
model worker is spawned, so it imports this module by name) — keeps per batch row the
parameters, the offset and vLLM's live list of the row's output tokens; every step it draws
``sample(row, params, offset + len(outputs))`` for the rows that carry pdorch's parameters
and sets every other logit of those rows to -inf, so vLLM's argmax returns pdorch's token.
It declares itself not argmax-invariant, which makes vLLM run it before greedy sampling.
Rows without the key — pdorch's greedy requests without a repetition penalty or
``min_tokens`` (`draws`) — are left alone: greedy stays vLLM's argmax as before. The rules
that read the token history (repetition penalty: the prompt and outputs; ``min_tokens``:
the model's EOS ids, carried in the entry) get vLLM's prompt list and live output list.
The index is recomputed from vLLM's output list at every step, so vLLM preempting and
resuming a request, or a chunked prefill's discarded samples, cannot shift it.

Cost per step: one copy of the sampled rows' logits to host memory (a synchronising copy on
a GPU, a gather on CPU) and `sample` per sampled row. Measured on the CPU build (SmolLM2, 49k
vocabulary, 8 sampled rows, a loaded 2-core VM): 2.2 ms a step median, 2.9 ms p90 — 2-3% of
a decode step there. Greedy-only steps cost nothing (no row registered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from orchestrator.core.sampling import SamplingParams, sample

EXTRA_ARGS_KEY = "pdorch_sampling"
"""The key of pdorch's parameters in a vLLM request's ``SamplingParams.extra_args``."""


@dataclass(frozen=True, slots=True)
class _Row:
    params: SamplingParams
    offset: int
    """Output tokens of the pdorch request generated before this vLLM request."""
    outputs: list[int]
    """vLLM's running list of this vLLM request's output tokens (a live reference)."""
    prompt: list[int]
    """This vLLM request's prompt: the pdorch prompt and the outputs before ``offset``."""
    eos: tuple[int, ...] = ()

    @property
    def index(self) -> int:
        return self.offset + len(self.outputs)

    def history(self) -> list[int]:
        """The tokens before the next one (what a repetition penalty reads)."""
        return [*self.prompt, *self.outputs] if self.params.repetition_penalty != 1.0 else []


def draws(params: SamplingParams) -> bool:
    """Whether pdorch's sampler must draw the request's tokens (else vLLM's argmax does)."""
    return not params.greedy or params.processes_logits


def extra_args(params: SamplingParams, offset: int, eos: Sequence[int] = ()) -> dict[str, Any]:
    """``extra_args`` entries that make vLLM draw a request's tokens with pdorch's `sample`,
    the first one at output index ``offset``; ``eos``: the model's end-of-sequence ids (for
    ``min_tokens``). Pass them with ``temperature=0``."""
    return {
        EXTRA_ARGS_KEY: {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "offset": offset,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "min_tokens": params.min_tokens,
            "eos": list(eos),
        }
    }


def parse(extra: dict[str, Any] | None) -> tuple[SamplingParams, int, tuple[int, ...]] | None:
    """pdorch's parameters, offset and EOS ids from a vLLM request's ``extra_args``; None
    when the request carries none. Raises ValueError for a malformed entry."""
    entry = (extra or {}).get(EXTRA_ARGS_KEY)
    if entry is None:
        return None
    try:
        params = SamplingParams(
            temperature=float(entry["temperature"]),
            top_p=float(entry["top_p"]),
            seed=int(entry["seed"]),
            top_k=int(entry.get("top_k", 0)),
            min_p=float(entry.get("min_p", 0.0)),
            repetition_penalty=float(entry.get("repetition_penalty", 1.0)),
            min_tokens=int(entry.get("min_tokens", 0)),
        )
        offset = int(entry["offset"])
        eos = tuple(int(t) for t in entry.get("eos", ()))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed {EXTRA_ARGS_KEY}: {entry!r}") from exc
    problems = [f"{field} {message}" for field, message in params.problems()]
    if not draws(params):
        problems.append(
            "temperature must be > 0 (greedy requests without a penalty or min_tokens "
            "carry no entry)"
        )
    if offset < 0:
        problems.append("offset must be >= 0")
    if problems:
        raise ValueError(f"{EXTRA_ARGS_KEY}: {'; '.join(problems)}")
    return params, offset, eos


class PdorchSampler(LogitsProcessor):  # type: ignore[misc]  # vLLM is untyped to mypy
    """vLLM v1 logits processor drawing pdorch's token for the rows that ask for it."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Called by vLLM's front end for every request: refuse a malformed entry, and one
        that vLLM would not sample greedily (its own draw would override pdorch's)."""
        if parse(sampling_params.extra_args) is not None and sampling_params.temperature != 0:
            raise ValueError(f"{EXTRA_ARGS_KEY} needs vLLM's greedy sampling (temperature=0)")

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token: vLLM must run it before its greedy argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        host = logits[rows].to("cpu", torch.float32).numpy()  # one copy for the batch
        tokens = []
        for j, r in enumerate(rows):
            row = self._rows[r]
            tokens.append(sample(host[j], row.params, row.index, row.history(), row.eos))
        at = torch.tensor(rows, device=logits.device)
        logits[at] = float("-inf")
        logits[at, torch.tensor(tokens, device=logits.device)] = 0.0
        return logits


PROCESSOR = f"{__name__}:{PdorchSampler.__qualname__}"
"""What the engine passes vLLM as ``logits_processors`` (vLLM imports it by name)."""


def _new_row(params: Any, prompt: list[int] | None, outputs: list[int]) -> _Row | None:
    parsed = parse(params.extra_args)
    if parsed is None:
        return None
    sampling, offset, eos = parsed
    return _Row(sampling, offset, outputs, list(prompt or ()), eos)
