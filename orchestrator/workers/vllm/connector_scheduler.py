"""The scheduler side of pdorch's connector: which requests push or load KV, and when. No I/O.

Runs in vLLM's engine-core process (`connector.PdorchConnector` forwards to it). It decides:

- **Prefill** (params from `kv.prefill_params`): in the step that computes the last prompt
  token, the worker side is told to push the whole prompt's blocks (earlier chunks of a
  chunked prefill and local prefix-cache hits are in the blocks already), or only those
  after the decode worker's prefix when the params name one (the worker side decides). The
  worker waits for the receiver's verdict before the step ends, so the request never needs
  its blocks after it finishes (``request_finished`` returns ``delay_free=False``), and the
  verdict is written into the finished output's ``kv_transfer_params`` (`kv_params.RESULT`).
- **Decode** (params from `kv.decode_params`): ``num_tokens`` tokens (capped so that vLLM
  computes at least the last prompt token) are loaded asynchronously: the request waits in
  ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated until the worker reports the load
  finished or failed. The load carries the digests of the blocks the local prefix cache gave
  the request, so the worker side can check a suffix-only KV extends exactly those.
  A failed load ends the request with an error (policy "fail"); vLLM frees
  its blocks only once the worker reported it finished, so a late KV never lands in a block
  that was freed. A request that finishes (abort) while loading is *cancelled* on the worker.

The outcome dict of a prefill is handed out in ``request_finished`` and filled when the
worker's metadata for the same step arrives (``update_connector_output``, which vLLM calls
later in the same ``update_from_output``, before the outputs are serialized); an outcome that
arrives first is kept until ``request_finished``. A result never filled reads as a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.core.prefix import block_digests
from orchestrator.workers.vllm import kv_layout, kv_params

log = logging.getLogger(__name__)


BlocksOf = Callable[[str], list[int]]
"""A scheduled request's block ids (from vLLM's KV cache manager)."""


class RequestLike(Protocol):
    """What is read of a ``vllm.v1.request.Request``."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_tokens: int
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Push the first ``num_tokens`` tokens' blocks of vLLM request ``req_id``."""

    req_id: str
    params: kv_params.PrefillParams
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load the KV pushed for ``params`` into the local blocks ``plan.dst``."""

    req_id: str
    params: kv_params.DecodeParams
    plan: kv_layout.LoadPlan
    held: tuple[bytes, ...] = ()
    """The chained digests (`orchestrator.core.prefix`) of the blocks this engine's prefix
    cache gave the request (``plan.src.start`` of them): a KV that extends a prefix (a
    suffix only) loads only if it names one of them."""


@dataclass(slots=True)
class StepPlan:
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request scheduled this step (from vLLM's SchedulerOutput)."""

    req_id: str
    num_computed: int
    num_scheduled: int


class SchedulerSide:
    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._prefills: dict[str, tuple[kv_params.PrefillParams, int]] = {}
        """vLLM request id -> (params, prompt tokens), until pushed or finished."""
        self._loading: set[str] = set()
        """Decode requests whose load the worker has not reported finished yet."""
        self._loaded: set[str] = set()
        """Decode requests whose load is over: if vLLM preempts one later, it recomputes its
        KV locally like any preempted request (the pushed KV was consumed)."""
        self._new_loads: list[LoadSpec] = []
        self._cancels: list[str] = []
        self._results: dict[str, dict[str, Any]] = {}
        """Outcome dicts already handed to vLLM's output, waiting to be filled."""
        self._early: dict[str, dict[str, Any]] = {}
        """Outcomes that arrived before their request finished."""

    @staticmethod
    def params_of(request: RequestLike) -> kv_params.PrefillParams | kv_params.DecodeParams | None:
        try:
            return kv_params.parse(request.kv_transfer_params)
        except kv_params.ParamsError as exc:
            log.error(  # noqa: TRY400 - the message says it all; no traceback wanted
                "request %s: invalid pdorch kv_transfer_params: %s", request.request_id, exc
            )
            return None

    def load_tokens(self, request: RequestLike, params: kv_params.DecodeParams) -> int:
        return min(params.num_tokens, request.num_tokens - 1)

    # ------------------------------------------------------------------ vLLM hooks

    def on_new_request(self, request: RequestLike) -> None:
        params = self.params_of(request)
        if isinstance(params, kv_params.PrefillParams):
            self._prefills[request.request_id] = (params, request.num_prompt_tokens)

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self.params_of(request)
        if isinstance(params, kv_params.PrefillParams):
            self._prefills.setdefault(request.request_id, (params, request.num_prompt_tokens))
            return 0, False
        rid = request.request_id
        if not isinstance(params, kv_params.DecodeParams) or rid in self._loading | self._loaded:
            return 0, False
        count = self.load_tokens(request, params) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = self.params_of(request)
        if not isinstance(params, kv_params.DecodeParams) or num_external_tokens <= 0:
            return
        end = self.load_tokens(request, params)
        computed = end - num_external_tokens
        plan = kv_layout.load_plan(block_ids, computed, end, self._block_size)
        prompt = request.prompt_token_ids or []
        held = block_digests(prompt[:computed], self._block_size) if computed else []
        self._loading.add(request.request_id)
        self._new_loads.append(LoadSpec(request.request_id, params, plan, tuple(held)))

    def build(self, scheduled: list[Scheduled], blocks_of: BlocksOf) -> StepPlan:
        """This step's work for the worker side (resets the pending loads and cancels)."""
        plan = StepPlan(loads=self._new_loads, cancels=self._cancels)
        self._new_loads, self._cancels = [], []
        for s in scheduled:
            entry = self._prefills.get(s.req_id)
            if entry is None:
                continue
            params, prompt = entry
            if s.num_computed + s.num_scheduled < prompt:
                continue  # an earlier chunk of a chunked prefill
            del self._prefills[s.req_id]
            blocks = kv_layout.send_blocks(blocks_of(s.req_id), prompt, self._block_size)
            plan.saves.append(SaveSpec(s.req_id, params, tuple(blocks), prompt))
        return plan

    def request_finished(self, request: RequestLike) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._prefills.pop(rid, None)
        self._loaded.discard(rid)
        if rid in self._loading:
            self._cancels.append(rid)  # vLLM keeps its blocks until the worker reports it
        params = self.params_of(request)
        if not isinstance(params, kv_params.PrefillParams):
            return False, None
        ours: dict[str, Any] = {"request_id": params.request_id, "epoch": params.epoch}
        early = self._early.pop(rid, None)
        if early is not None:
            ours[kv_params.RESULT] = early
        else:
            self._results[rid] = ours
        return False, {kv_params.KEY: ours}

    def on_outcomes(self, outcomes: dict[str, dict[str, Any]]) -> None:
        for rid, outcome in outcomes.items():
            slot = self._results.pop(rid, None)
            if slot is None:
                self._early[rid] = outcome
            else:
                slot[kv_params.RESULT] = outcome

    def on_loads_finished(self, req_ids: set[str]) -> None:
        done = self._loading & req_ids
        self._loading -= done
        self._loaded |= done

    def step_done(self) -> None:
        """End of one ``update_from_output``: a result not filled by now never will be."""
        for rid in list(self._results):
            log.error("request %s finished without a KV transfer outcome", rid)
        self._results.clear()
