"""vLLM behind the worker API: `VllmHost` hosts vLLM's ``AsyncLLM`` in the worker process.

``AsyncLLM`` runs vLLM's engine core in a child process (started with ``spawn``) and
schedules continuous batches itself: every request admitted decodes in the same step as the
others. The host turns the worker API's three calls into vLLM requests:

* **Generate** (aggregated): the prompt (+ tokens already generated, after a failover) as
  a token prompt; vLLM's per-step deltas become `TokenChunk`s (`accounting.ChunkStream`).
* **Prefill**: the same with ``max_tokens=1`` and pdorch's connector parameters
  (`kv.prefill_params`): vLLM's worker process pushes the prompt's KV blocks to the decode
  worker through pdorch's transport (only those after the decode worker's prefix when the
  request names one, the whole KV if the decode side refuses it); the call returns when the
  connector reports the transfer's end, success or failure (`kv.prefill_result`).
* **Decode**: the prompt + the tokens sent so far + the last sampled token, with
  `kv.decode_params`: vLLM loads the pushed KV for all but the last token into its own
  blocks, computes the last one and continues decoding.

The connector code (inside vLLM's processes) and the decode side's receiver are
`orchestrator.workers.vllm.kv`'s; this module only uses its interface. Cost per request and
the KV room for heartbeats come from vLLM's per-step scheduler statistics, read by a stat
logger (`accounting`). Sampling follows pdorch's contract (`orchestrator.core.sampling`):
greedy is vLLM's argmax, as in the reference engine; a sampled request's output token *i* is
``core.sampling.sample(logits, params, i)``, drawn inside vLLM by pdorch's logits processor
(`sampler`) with vLLM itself asked for greedy sampling. Every vLLM request tells the
processor its output offset (Generate: ``first_index``; Prefill: ``first_index``; Decode:
``generated``), so a request split into prefill and decode, or continued after a failover in
a new vLLM request, draws exactly what one uninterrupted request would.

Log probabilities (``sampling.logprobs``/``prompt_logprobs``) are vLLM's, asked in its
``raw_logprobs`` mode: the log-softmax of the raw logits, before pdorch's logits processor,
as the reference engine computes them (`orchestrator.workers.vllm.logprobs`). A token's
rides in its chunk; the prompt's are asked only for a request's first attempt
(``first_index`` 0) — by Generate, or by Prefill, whose response carries them and the first
token's as the reference prefill's does; Decode never computes the prompt.

Imports vLLM at module level: only the composition root imports this module, and only for
``--engine vllm`` (the ``vllm`` extra's environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import xxhash
from vllm import SamplingParams as VllmSampling
from vllm import TokensPrompt
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from orchestrator.api import common_pb2, convert, worker_pb2
from orchestrator.api.protocol import BLAME_KEY, BLAME_KV_TARGET, REFUSABLE_FIELDS, refusal
from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.prefix import DEFAULT_REPORT_BLOCKS
from orchestrator.workers.engine import ModelInfo
from orchestrator.workers.host import Context, EngineHost
from orchestrator.workers.metrics import WorkerMetrics
from orchestrator.workers.vllm import kv, kv_events, sampler
from orchestrator.workers.vllm import logprobs as vllm_logprobs
from orchestrator.workers.vllm.accounting import BlockPool, ChunkStream, StepLedger
from orchestrator.workers.vllm.kv_params import DTYPES as KV_DTYPES
from transport.wire import DType

log = logging.getLogger(__name__)

_DTYPES = {"float32": DType.FLOAT32, "float16": DType.FLOAT16, "bfloat16": DType.BFLOAT16}
_WEIGHTS_GLOB = "*.safetensors"


@dataclass(frozen=True, slots=True)
class VllmSettings:
    model_dir: Path
    """A local Hugging Face-format directory (config, tokenizer, safetensors)."""
    name: str = "smollm2"
    """The model name workers publish."""
    role: str = "decode"
    """prefill, decode (both serve aggregated Generate too)."""
    dtype: str = "float32"
    """Weights and KV dtype; the CPU backend computes in float32 here."""
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    """vLLM's KV block pool (the CPU backend's ``VLLM_CPU_KVCACHE_SPACE``)."""
    max_num_seqs: int = 128
    """Requests one step may batch."""
    enforce_eager: bool = True
    """No graph capture: the CPU backend's compile step costs more than it saves here."""
    transport: str = "tcp"
    """pdorch's KV transport backend for the connector: tcp, ucx, or ucx-read (one-sided:
    the decode reads the prefill's blocks out of vLLM's cache, no gather)."""
    kv_hold_s: float = 30.0
    """Decode side: free a pushed KV nobody claims after this long."""
    kv_timeout_s: float = 30.0
    """How long either side waits on a transfer before failing it."""
    tls_dir: str = ""
    """The worker's TLS directory (``--tls-dir``): the connector's KV link runs mutual TLS
    as ``tls_identity`` (`transport.security.load_dir`); empty: plaintext."""
    tls_identity: str = ""
    kv_report_blocks: int = DEFAULT_REPORT_BLOCKS
    """The most prefix-cache blocks one heartbeat reports (the newest stored), from vLLM's
    KV cache events (`kv_events`); 0: report none (no KV-aware routing to this worker)."""


class _StepStats(StatLoggerBase):  # type: ignore[misc]  # vLLM is untyped to mypy
    """vLLM's stat-logger hook, called in the output handler once per engine step."""

    def __init__(self, ledger: StepLedger, host: VllmHost) -> None:
        self._ledger = ledger
        self._host = host

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        details = scheduler_stats.iteration_details
        if details is not None and not details.is_dummy:
            self._ledger.step(
                details.elapsed_ms / 1000,
                details.num_ctx_requests + details.num_generation_requests,
                at_s=time.monotonic(),
                running_after=int(scheduler_stats.num_running_reqs),
            )
        self._host.kv_usage = float(scheduler_stats.kv_cache_usage)

    def log_engine_initialized(self) -> None:
        pass


class VllmHost(EngineHost):
    def __init__(self, settings: VllmSettings, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.transport = ""
        self.kv_usage = 0.0
        """Fraction of vLLM's blocks in use, from the last step's statistics."""
        self._ledger = StepLedger()
        self._llm: Any = None
        self._tokenizer: Any = None
        self._blocks = 0
        self._block_size = 0
        self._active = 0
        self._ids = itertools.count()
        self._connector = False
        """pdorch's KV connector is loaded (prefill and decode roles)."""
        self._control: kv.DecodeKvControl | None = None
        self._events: kv_events.KvEventFeed | None = None
        """vLLM's KV cache events: what its prefix cache holds (`kv_prefix`)."""
        self.info = model_info(settings)  # fingerprint filled in by start()

    # ------------------------------------------------------------------------ lifecycle

    async def start(self, host: str, kv_port: int) -> str:
        s = self.settings
        fingerprint = await asyncio.to_thread(_fingerprint, s)
        self.info = model_info(s, fingerprint)
        kv_address = ""
        transfer: dict[str, Any] | None = None
        events = kv_events.endpoint() if s.kv_report_blocks > 0 else ""
        if s.role in ("prefill", "decode"):
            self._connector = True
            self.transport = s.transport  # a decode worker's: its connector's, once it says
            if s.role == "decode":  # the connector's receiver reports to us over this socket
                self._control = kv.DecodeKvControl()
            transfer = kv.connector_config(
                s.role,
                backend=s.transport,
                kv_address=f"{host}:{kv_port}" if s.role == "decode" else None,
                fingerprint=fingerprint,
                hold_s=s.kv_hold_s,
                timeout_s=s.kv_timeout_s,
                control_path=self._control.control_path if self._control else None,
                events_endpoint=events if s.role == "decode" else "",
                tls_dir=s.tls_dir,
                tls_identity=s.tls_identity,
            )
        args = AsyncEngineArgs(
            model=str(s.model_dir),
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            enforce_eager=s.enforce_eager,
            kv_cache_memory_bytes=s.kv_cache_bytes,
            max_num_seqs=s.max_num_seqs,
            disable_log_stats=True,  # no vLLM stat printing; our own logger still records
            enable_logging_iteration_details=True,  # step time and batch size, for cost
            kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
            logits_processors=[sampler.PROCESSOR],  # pdorch's seeded draw (`sampler`)
            logprobs_mode="raw_logprobs",  # before that processor: the model's own
            kv_events_config=kv_events.events_config(events) if events else None,
            prefix_caching_hash_algo="sha256_cbor",  # vLLM's hashes are then pdorch's too
        )
        started = time.perf_counter()
        self._llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[lambda _config, _index: _StepStats(self._ledger, self)]
        )
        cache = self._llm.vllm_config.cache_config
        self._blocks = int(cache.num_gpu_blocks or 0)
        self._block_size = int(cache.block_size)
        self._tokenizer = self._llm.get_tokenizer()
        if events:  # subscribed before any request: the first stores are not missed
            self._events = kv_events.KvEventFeed(events, self._block_size)
            self._events.start()
        if self._control is not None:  # the connector inside vLLM listens by now
            kv_address = await self._control.start(s.kv_timeout_s)
            self.transport = self._control.backend or s.transport
        log.info(
            "vLLM engine up in %.1f s: %d blocks of %d tokens (%d MiB of KV)",
            time.perf_counter() - started,
            self._blocks,
            self._block_size,
            self.pool().capacity_bytes >> 20,
        )
        return kv_address

    async def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._control is not None:
            await self._control.close()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            started = time.perf_counter()
            await _stop_output_handler(llm)
            await asyncio.to_thread(llm.shutdown)
            log.info("vLLM engine shut down in %.1f s", time.perf_counter() - started)

    def pool(self) -> BlockPool:
        return BlockPool(
            self._blocks, self._block_size, self.info.kv_bytes_per_token(), self.kv_usage
        )

    def active(self) -> int:
        return self._active

    def kv_used(self) -> int:
        held = int(self._control.held_bytes()) if self._control is not None else 0
        return self.pool().used_bytes + held

    def kv_capacity(self) -> int:
        return self.pool().capacity_bytes

    def kv_blocks(self) -> tuple[int, int]:
        pool = self.pool()
        return pool.blocks, pool.free_blocks

    def kv_prefix(self) -> tuple[int, str]:
        if self._events is None:
            return 0, ""
        return self._events.block_size, self._events.report(self.settings.kv_report_blocks)

    def engine_busy_s(self) -> float:
        """vLLM's step time so far (all requests together)."""
        return self._ledger.busy_s

    # ------------------------------------------------------------------------ tokenizer

    async def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    async def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        conversation = [{"role": role, "content": content} for role, content in messages]
        text = self._tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        return await self.tokenize(str(text))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(
            self._tokenizer.decode(
                list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    # ----------------------------------------------------------------------------- RPCs

    def _sampling(
        self,
        msg: Any,
        max_tokens: int,
        offset: int,
        kv_transfer_params: dict[str, Any] | None = None,
        *,
        prompt_scored: bool = False,
    ) -> Any:
        """vLLM's parameters for a request whose first output is pdorch's output token
        ``offset``. vLLM always samples greedily: a sampled request's tokens are drawn by
        pdorch's `sampler.PdorchSampler` at their own output index. ``prompt_scored``: ask
        the prompt's log-probabilities too (when the request asks them)."""
        p = convert.sampling_from_pb(msg)
        eos = self.info.eos_token_ids
        extra = sampler.extra_args(p, offset, eos) if sampler.draws(p) else {}
        if kv_transfer_params:
            extra["kv_transfer_params"] = kv_transfer_params
        return VllmSampling(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=p.ignore_eos,
            stop_token_ids=[] if p.ignore_eos else list(eos),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # text deltas are ours (`accounting.ChunkStream`)
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs if prompt_scored else None,
            extra_args=extra or None,
        )

    async def _outputs(
        self, request_id: str, epoch: int, prompt: list[int], sampling: Any, context: Context
    ) -> AsyncGenerator[tuple[Any, float], None]:
        """vLLM's outputs for one request, each with the engine time charged to it since
        the previous one (ms). Closing the iterator aborts the request in vLLM."""
        vllm_id = f"{request_id}@{epoch}#{next(self._ids)}"  # unique even for a retry
        mark = self._ledger.mark()
        self._active += 1
        try:
            gen = self._llm.generate(TokensPrompt(prompt_token_ids=prompt), sampling, vllm_id)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    now = self._ledger.mark()
                    yield out, (now - mark) * 1000
                    mark = now
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM engine died: {exc}")
        except (ValueError, VLLMValidationError) as exc:
            # vLLM refusing the request (its admission checks; a logits processor's
            # validate_params). VLLMValidationError is no ValueError since vLLM 0.32: the
            # client's error, answered as one — never a worker failure, nor a traceback.
            log.info("%s: vLLM refused the request: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refused(exc))
        finally:
            self._active -= 1

    def _named(self, lp: TokenLogprob) -> common_pb2.TokenLogprob:
        """A log-probability with its tokens' texts, for the wire."""
        return convert.logprob_to_pb(lp.named(lambda t: self.detokenize([t])))

    def _scores(
        self, out: Any, sampling: Any, prompt: list[int]
    ) -> tuple[list[common_pb2.TokenLogprob], list[common_pb2.TokenLogprob]]:
        """One vLLM output's log-probabilities as the wire's: its new tokens' (when asked)
        and the prompt's (when asked, in the output that carries them)."""
        completion = out.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        scored: list[TokenLogprob] = []
        if sampling.logprobs is not None and tokens:
            scored = vllm_logprobs.output_logprobs(tokens, completion.logprobs, sampling.logprobs)
        prompt_scored: list[TokenLogprob] = []
        if sampling.prompt_logprobs is not None and out.prompt_logprobs:
            prompt_scored = vllm_logprobs.prompt_logprobs(
                prompt, out.prompt_logprobs, sampling.prompt_logprobs
            )
        return [self._named(lp) for lp in scored], [self._named(lp) for lp in prompt_scored]

    async def _stream(
        self,
        request_id: str,
        epoch: int,
        prompt: list[int],
        sampling: Any,
        stream: ChunkStream,
        context: Context,
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        outputs = self._outputs(request_id, epoch, prompt, sampling, context)
        async with contextlib.aclosing(outputs):
            async for out, spent_ms in outputs:
                completion = out.outputs[0]
                finish = completion.finish_reason if out.finished else None
                try:
                    scores, prompt_scores = self._scores(out, sampling, prompt)
                    chunks = stream.push(
                        completion.token_ids, finish, spent_ms, scores, prompt_scores
                    )
                except ValueError as exc:  # aborted inside vLLM, or scores missing
                    await context.abort(grpc.StatusCode.INTERNAL, str(exc))
                for chunk in chunks:
                    yield chunk
                if stream.finished:
                    return
        await context.abort(grpc.StatusCode.INTERNAL, "vLLM ended the stream unfinished")

    async def generate(
        self, request: worker_pb2.AggregatedRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        ids = list(request.token_ids)
        first, limit = int(request.first_index), int(request.max_tokens)
        if first >= limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first_index >= max_tokens")
        stream = ChunkStream(
            self.detokenize,
            first_index=first,
            max_tokens=limit,
            eos=_eos(self.info, request.sampling),
            prior=ids[int(request.prompt_tokens) :],
        )
        sampling = self._sampling(request.sampling, limit - first, first, prompt_scored=first == 0)
        async for chunk in self._stream(
            request.request_id, int(request.epoch), ids, sampling, stream, context
        ):
            yield chunk

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        if not self._connector or not request.kv_target:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "not a prefill worker, or no KV target"
            )
        rid, epoch = request.request_id, int(request.epoch)
        try:
            wire_dtype = convert.kv_dtype_from_pb(request.kv_dtype) or self.info.kv_dtype
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown kv_dtype")
        wire_name = next(n for n, d in KV_DTYPES.items() if d is wire_dtype)
        params = kv.prefill_params(
            rid,
            epoch,
            request.kv_target,
            wire_name,
            int(request.decode_prefix_tokens),
            bytes(request.decode_prefix_hash),
        )
        first_index = int(request.first_index)
        sampling = self._sampling(
            request.sampling, 1, first_index, params, prompt_scored=first_index == 0
        )
        started = time.perf_counter()
        first: int | None = None
        first_scored: list[common_pb2.TokenLogprob] = []
        prompt_scored: list[common_pb2.TokenLogprob] = []
        spent_ms = 0.0
        cached = 0  # prompt tokens vLLM's prefix cache held (RequestOutput.num_cached_tokens)
        transfer_params: dict[str, Any] | None = None
        ids = list(request.token_ids)
        outputs = self._outputs(rid, epoch, ids, sampling, context)
        async with contextlib.aclosing(outputs):
            async for out, ms in outputs:
                spent_ms += ms
                cached = int(out.num_cached_tokens or 0) or cached
                try:
                    scores, prompt_scores = self._scores(out, sampling, ids)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INTERNAL, str(exc))
                prompt_scored += prompt_scores
                if out.outputs[0].token_ids and first is None:
                    first = int(out.outputs[0].token_ids[0])
                    first_scored = scores[:1]
                if out.finished:
                    transfer_params = out.kv_transfer_params
        result = kv.prefill_result(transfer_params)
        if first is None or not result.ok:
            log.warning("prefill of %s to %s failed: %s", rid, request.kv_target, result.error)
            if result.retryable:  # the receiving end is the one to avoid
                context.set_trailing_metadata(((BLAME_KEY, BLAME_KV_TARGET),))
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {result.error or 'no token'}"
            )
        assert first is not None
        elapsed_ms = (time.perf_counter() - started) * 1000
        transfer_ms = float(result.transfer_ms)
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(spent_ms / 1000)
            self.metrics.compute_seconds.inc(spent_ms / 1000)
            self.metrics.transfer_seconds.inc(transfer_ms / 1000)
            self.metrics.kv_sent_bytes.inc(int(result.kv_bytes))
        return worker_pb2.PrefillResponse(
            first_token=first,
            kv_bytes=int(result.kv_bytes),
            prefill_ms=max(0.0, elapsed_ms - transfer_ms),
            transfer_ms=transfer_ms,
            kv_dtype=convert.kv_dtype_to_pb(wire_dtype),
            cached_tokens=cached,
            first_logprob=first_scored[0] if first_scored else None,
            prompt_logprobs=prompt_scored,
            kv_prefix_tokens=result.prefix_tokens,
            kv_prefix_refused=result.prefix_refused,
        )

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        if self._control is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
        assert self._control is not None
        rid, epoch = request.request_id, int(request.epoch)
        ids = list(request.token_ids)
        generated, limit = int(request.generated), int(request.max_tokens)
        prompt_tokens = int(request.prompt_tokens)
        stream = ChunkStream(
            self.detokenize,
            first_index=generated - 1,
            max_tokens=limit,
            eos=_eos(self.info, request.sampling),
            prior=ids[prompt_tokens:],
        )
        for chunk in stream.push([int(request.last_token)], None, 0.0):
            yield chunk  # the token the prefill sampled, as the reference engine sends it
        if stream.finished:  # ended on it: the pushed KV is not needed
            await self._control.release(rid, epoch)
            return
        params = kv.decode_params(rid, epoch, len(ids))
        sampling = self._sampling(request.sampling, limit - generated, generated, params)
        async for chunk in self._stream(
            rid, epoch, [*ids, int(request.last_token)], sampling, stream, context
        ):
            yield chunk

    async def release(self, request: worker_pb2.ReleaseRequest) -> bool:
        if self._control is None:
            return False
        return bool(await self._control.release(request.request_id, int(request.epoch)))


async def _stop_output_handler(llm: Any) -> None:
    """Cancel ``AsyncLLM``'s output handler (its task on this loop) before the engine is
    shut down. ``AsyncLLM.shutdown``, run in a thread, stops the engine core, then cancels
    the task that reads its outputs — which turns that cancellation into an
    `EngineDeadError` for the handler — and only then cancels the handler, from its thread:
    whenever this loop turned between the two (a GIL switch is enough), the handler took
    the error and vLLM logged "AsyncLLM output_handler failed." with a traceback, on every
    clean stop of a worker that had served a request. Cancelled here first, the handler
    sees only its cancellation. A handler that already ended — the engine died while
    running — was reported by vLLM then, as an error, and is left as it is. By now the
    worker's server has stopped: no request waits on the handler's outputs."""
    handler = getattr(llm, "output_handler", None)
    if not isinstance(handler, asyncio.Task) or handler.done():
        return
    handler.cancel()
    await asyncio.wait({handler})  # (its outcome is its own: our cancellation still propagates)


def _refused(exc: Exception) -> str:
    """The INVALID_ARGUMENT details for vLLM refusing a request: `protocol.refusal` when
    vLLM names a parameter pdorch lets workers refuse (the client's error then names it),
    else ``vLLM refused: ...`` (the orchestrator names the prompt)."""
    parameter = getattr(exc, "parameter", None)
    if parameter in REFUSABLE_FIELDS:
        return refusal(parameter, f"vLLM refused: {exc}")
    return f"vLLM refused: {exc}"


def _eos(info: ModelInfo, msg: common_pb2.SamplingParams) -> tuple[int, ...]:
    """The tokens that end a request's output: none when it ignores EOS."""
    return () if msg.ignore_eos else info.eos_token_ids


def model_info(s: VllmSettings, fingerprint: str = "") -> ModelInfo:
    config = json.loads((s.model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    return ModelInfo(
        name=s.name,
        fingerprint=fingerprint,
        n_layers=int(config["num_hidden_layers"]),
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim", int(config["hidden_size"]) // heads)),
        vocab_size=int(config["vocab_size"]),
        max_context=s.max_model_len,
        eos_token_ids=_eos_ids(s.model_dir, config),
        kv_dtype=_DTYPES[s.dtype],
    )


def _eos_ids(model_dir: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids as the reference engine takes them: the generation config's,
    else the model config's."""
    path = model_dir / "generation_config.json"
    source = json.loads(path.read_text()) if path.exists() else config
    eos = source.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(sorted({int(eos)} if isinstance(eos, int) else {int(i) for i in eos}))


def _fingerprint(s: VllmSettings) -> str:
    """``vllm-<model_type>-<layers>L-<dtype>-<xxh3-128>`` over the config and
    every weight file's bytes. Distinct from the reference engine's (its KV is laid out in
    vLLM's blocks), so the two engines never exchange KV."""
    config = json.loads((s.model_dir / "config.json").read_text())
    h = xxhash.xxh3_128()
    h.update(json.dumps(config, sort_keys=True).encode())
    h.update(s.dtype.encode())
    for path in sorted(s.model_dir.glob(_WEIGHTS_GLOB)):
        with path.open("rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    layers = int(config["num_hidden_layers"])
    return f"vllm-{config.get('model_type', 'model')}-{layers}L-{s.dtype}-{h.hexdigest()}"
