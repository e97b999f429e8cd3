"""What pdorch reads off a vLLM engine, as pure bookkeeping (no vLLM import, no I/O).

vLLM's engine core reports, with every step's outputs, a `SchedulerStats`: the step's
duration and how many requests it computed (``iteration_details``, enabled by
``enable_logging_iteration_details``), and the block pool's usage. The pdorch worker turns
these into the figures the orchestrator already understands:

* **cost per request** (`StepLedger`): a step's time is split evenly over the requests in
  it (step time / batch size, as the reference batcher does). The ledger keeps the running
  sum of those shares; a request is charged the growth of that sum between its admission
  and each chunk it streams. This assumes a request is in every step while it is admitted,
  which holds for vLLM's scheduler whenever its running batch has room (``max_num_seqs``,
  128 here, well above a CPU worker's concurrency); a request queued behind a full batch is
  charged for steps it waited through.
  A step's time is the longer of what vLLM measured and the interval since the previous
  step's report while the engine stayed busy: with async scheduling (vLLM's default on
  CUDA) the engine measures only the wait for a step already running, so its figure alone
  reads far too low there (measured on an H200: 0.045 ms against a ~30 ms step); on the CPU
  backend the two agree up to the output handling between steps.
* **KV room** (`BlockPool`): capacity = blocks × block size × bytes per token; used = the
  blocks the pool has handed out (``kv_cache_usage`` × blocks). vLLM counts cached blocks
  nobody references as free (it evicts them on demand), so does pdorch.
* **output chunks** (`ChunkStream`): vLLM's per-step token deltas and finish reasons as the
  worker API's `TokenChunk`s, with the reference engine's conventions: indices count from
  the request's first output token, an end-of-sequence token is not streamed (its index
  carries the final chunk), text deltas never split a character; a token's log-probability
  rides with it, the prompt's on the stream's first chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.api import common_pb2, worker_pb2
from orchestrator.workers.text import TextDeltas


class StepLedger:
    """The running sum of per-request step shares (seconds)."""

    def __init__(self) -> None:
        self.share_s = 0.0
        """Σ over steps of step time / requests in the step."""
        self.steps = 0
        self.busy_s = 0.0
        """Σ step time: the engine's compute, for the worker's metrics."""
        self._last_at: float | None = None
        """When the previous step was reported, if the engine stayed busy after it."""

    def step(
        self,
        elapsed_s: float,
        requests: int,
        *,
        at_s: float | None = None,
        running_after: int = 0,
    ) -> None:
        """One step's report: vLLM's ``elapsed_s`` for a step over ``requests``; ``at_s``
        (a monotonic clock) when it was reported and ``running_after`` how many requests
        were still running after it — a step that follows a busy one lasted at least the
        interval between their reports."""
        last, self._last_at = self._last_at, (at_s if running_after > 0 else None)
        if at_s is not None and last is not None:
            elapsed_s = max(elapsed_s, at_s - last)
        if requests <= 0 or elapsed_s <= 0:
            return
        self.steps += 1
        self.busy_s += elapsed_s
        self.share_s += elapsed_s / requests

    def mark(self) -> float:
        """Where a request's charge starts (read at its admission)."""
        return self.share_s


@dataclass(frozen=True, slots=True)
class BlockPool:
    blocks: int
    block_size: int
    """Tokens per block."""
    bytes_per_token: int
    usage: float = 0.0
    """Fraction of the blocks in use, from the last `SchedulerStats`."""

    @property
    def capacity_bytes(self) -> int:
        return self.blocks * self.block_size * self.bytes_per_token

    @property
    def used_blocks(self) -> int:
        return min(self.blocks, max(0, round(self.usage * self.blocks)))

    @property
    def free_blocks(self) -> int:
        return self.blocks - self.used_blocks

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_size * self.bytes_per_token


_FINISH = {
    "stop": common_pb2.FINISH_REASON_EOS,
    "length": common_pb2.FINISH_REASON_LENGTH,
}


class ChunkStream:
    """Turns vLLM's output deltas for one request into `TokenChunk`s.

    ``first_index``: index of the first output token this stream produces; ``prior``: the
    output tokens generated before it (text deltas continue from them); ``max_tokens``: the
    request's output limit counting those; ``eos``: tokens that end the output unstreamed.
    """

    def __init__(
        self,
        detokenize: Callable[[Sequence[int]], str],
        *,
        first_index: int,
        max_tokens: int,
        eos: Sequence[int],
        prior: Sequence[int] = (),
    ) -> None:
        self.index = first_index
        self._max = max_tokens
        self._eos = frozenset(eos)
        self._text = TextDeltas(detokenize, prior)
        self.finished = False
        self._prompt: list[common_pb2.TokenLogprob] = []

    def push(
        self,
        token_ids: Sequence[int],
        finish: str | None,
        compute_ms: float,
        logprobs: Sequence[common_pb2.TokenLogprob] = (),
        prompt_logprobs: Sequence[common_pb2.TokenLogprob] = (),
    ) -> list[worker_pb2.TokenChunk]:
        """Chunks for one delta; ``compute_ms`` (the engine time since the last delta) rides
        on the first of them. ``finish``: vLLM's finish reason when the request ended.
        ``logprobs``: one per token of ``token_ids`` (or none); ``prompt_logprobs``: ride on
        the first chunk."""
        if self.finished:
            return []
        ids: list[int] = []
        reason = common_pb2.FINISH_REASON_UNSPECIFIED
        for t in token_ids:
            if t in self._eos:
                reason = common_pb2.FINISH_REASON_EOS
                break
            ids.append(int(t))
            if self.index + len(ids) >= self._max:
                reason = common_pb2.FINISH_REASON_LENGTH
                break
        if reason == common_pb2.FINISH_REASON_UNSPECIFIED and finish is not None:
            if finish not in _FINISH:
                raise ValueError(f"vLLM ended the request: {finish}")
            reason = _FINISH[finish]
        out = []
        if ids:
            delta, ends = self._text.push_ends(ids)
            out.append(
                worker_pb2.TokenChunk(
                    index=self.index,
                    token_ids=ids,
                    text=delta,
                    text_ends=ends,
                    compute_ms=compute_ms,
                    logprobs=list(logprobs[: len(ids)]),
                )
            )
            self.index += len(ids)
            compute_ms = 0.0
        if reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished = True
            out.append(
                worker_pb2.TokenChunk(
                    index=self.index,
                    text=self._text.flush(),
                    finish_reason=reason,
                    compute_ms=compute_ms,
                )
            )
        self._prompt.extend(prompt_logprobs)
        if out and self._prompt:  # the first chunk carries them (held until there is one)
            out[0].prompt_logprobs.extend(self._prompt)
            self._prompt = []
        return out
