"""A simulated engine: the performance model's timings, no model computed.

`SimEngine` is an `Engine` for scale tests of the control plane: it tokenizes by a cheap
rule, "computes" by hashing, and says how long each call would take on a GPU kind according
to the roofline model (`orchestrator.core.perfmodel`); `SimRunner` then holds the worker's
simulated GPU for that long *on the event loop* (no thread), so one process can host
hundreds of workers. Nothing here imports torch or transformers.

**Tokens.** Text is split on whitespace; a word's id is its CRC-32 modulo the vocabulary
(minus the EOS id). Output token *i* is a 64-bit mix of a rolling hash of every token before
it (prompt and earlier outputs), and — when sampling (temperature > 0) — of the seed and *i*;
top_p is ignored. So, like a real model, the next token is a function of the context: a
prefill/decode split, an aggregated run and a failover's re-prefill of prompt + generated
tokens all produce the same tokens. The EOS id (the vocabulary's last) is never produced:
every request runs to ``max_tokens``, which keeps benchmark loads deterministic (so
``ignore_eos`` and ``min_tokens`` hold trivially; ``top_k``, ``min_p`` and
``repetition_penalty``, like top_p, change nothing).

**Log-probabilities** are made up the same way (`sim_logprob`): after a context, the greedy
token has log-probability -0.1 and the alternatives ranked after it -0.5 each further; any
other token a hashed value below -5. A function of the context, like the tokens.

**KV.** Real shapes would not fit: Llama-3-8B's KV is 128 KiB per token, so 2,000 requests
of ~100 tokens would hold ~25 GiB. The simulated KV keeps the model's layer count and dtype
(bf16, carried as uint16 bits) but shrinks each layer to ``SIM_KV_HEADS`` heads of
``SIM_HEAD_DIM``: ``kv_scale`` = real bytes per token / simulated bytes per token (256 for
Llama-3-8B). Every KV figure a simulated worker publishes — bytes per token, capacity, bytes
used — is the real one divided by ``kv_scale``, so placement decisions are the real ones.
K's first two elements of every (layer, head, token) hold the token id, 14 bits each (bit
patterns of finite bf16 values: receivers refuse NaN and infinities), and `start_decode`
checks them: a KV adopted for the wrong tokens fails loudly.

**Prefix cache** (``prefix_cache=True``, ``pdorch worker --sim ... --sim-prefix-cache``): a
simulated vLLM prefix cache — an LRU of pdorch's block keys (`orchestrator.core.prefix`,
blocks of ``SIM_BLOCK`` tokens) as large as the worker's KV room, filled by every prefill
and every adopted KV. A prefill is then charged only for the tokens after the longest cached
run (at least the last one), and the heartbeat reports the keys, as a vLLM worker does.
A decode worker takes a suffix-only KV transfer for a prefix it caches (`holds_prefix`) and
rebuilds the prefix's KV from its tokens (`prefix_kv`: the simulated KV is a function of
them) — a real engine would point at its cached blocks instead.

**Time.** A prefill of *n* tokens holds the GPU for ``prefill_seconds(model, gpu, n)``; one
decode step of a batch for ``decode_step_seconds(model, gpu, batch, mean context)``; adopting
a KV, tokenizing and detokenizing take no simulated time. The real KV moves over the
transport at 1/``kv_scale`` of its size; the link time of the full-size KV is not simulated.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from orchestrator.core.hardware import DEFAULT_GPUS, GpuProfile, get_gpu
from orchestrator.core.logprobs import TokenLogprob, TopLogprob
from orchestrator.core.perfmodel import (
    ModelConfig,
    decode_step_seconds,
    get_model,
    kv_bytes_per_token,
    prefill_seconds,
)
from orchestrator.core.prefix import (
    DEFAULT_REPORT_BLOCKS,
    block_digests,
    block_keys,
    encode_keys,
    key_of,
)
from orchestrator.core.sampling import SamplingParams
from orchestrator.errors import ConfigError
from orchestrator.workers.batcher import EngineRunner
from orchestrator.workers.engine import (
    DecodeState,
    Engine,
    KvLayers,
    LayerCallback,
    ModelInfo,
    PrefillResult,
)
from transport.wire import DType

T = TypeVar("T")

SIM_KV_HEADS = 1
SIM_HEAD_DIM = 4
SIM_MAX_CONTEXT = 8192
"""Llama 3's context; the presets do not carry one."""
SIM_BLOCK = 16
"""Tokens per block of the simulated prefix cache (vLLM's default block size)."""
KV_MEMORY_FRACTION = 0.9
"""Of GPU memory usable for weights + KV (the planner's headroom)."""

_MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_FNV_OFFSET = 0xCBF29CE484222325
_KV_DTYPE = DType.BFLOAT16


# ----------------------------------------------------------------------------- the spec


@dataclass(frozen=True, slots=True)
class SimSpec:
    """A model preset on a GPU kind (a tensor-parallel group of ``tp`` of them)."""

    model: ModelConfig
    gpu: GpuProfile
    tp: int = 1

    @classmethod
    def parse(cls, text: str, gpus: dict[str, GpuProfile] | None = None) -> SimSpec:
        """``MODEL@GPU`` or ``MODEL@GPUxTP``: ``llama-3-8b@H100``, ``llama-3-70b@H100x4``."""
        model_name, at, gpu_name = text.partition("@")
        if not at or not model_name or not gpu_name:
            raise ConfigError("sim", f"expected MODEL@GPU (e.g. llama-3-8b@H100), got {text!r}")
        tp = 1
        kind, x, degree = gpu_name.rpartition("x")
        if x and kind and degree.isdigit():
            gpu_name, tp = kind, int(degree)
        spec = cls(get_model(model_name), get_gpu(gpus or DEFAULT_GPUS, gpu_name), tp)
        spec.check()
        return spec

    def check(self) -> None:
        if not 1 <= self.tp <= self.gpu.max_tp:
            raise ConfigError("sim", f"{self.gpu.name}: tensor parallelism 1..{self.gpu.max_tp}")
        if not self.gpu.supports(self.model.dtype):
            raise ConfigError("sim", f"{self.gpu.name} has no {self.model.dtype} support")
        if self.real_kv_capacity_bytes <= 0:
            raise ConfigError(
                "sim", f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}"
            )

    @property
    def name(self) -> str:
        tp = f"x{self.tp}" if self.tp > 1 else ""
        return f"{self.model.name}@{self.gpu.name}{tp}"

    @property
    def real_kv_capacity_bytes(self) -> int:
        """Memory left for KV beside the weights on the group, at full size."""
        usable = self.tp * self.gpu.memory_bytes * KV_MEMORY_FRACTION
        return int(usable - self.model.weight_bytes)

    @property
    def sim_kv_bytes_per_token(self) -> int:
        return 2 * self.model.layers * SIM_KV_HEADS * SIM_HEAD_DIM * _KV_DTYPE.itemsize

    @property
    def kv_scale(self) -> float:
        """Real KV bytes per simulated KV byte."""
        return kv_bytes_per_token(self.model) / self.sim_kv_bytes_per_token

    @property
    def kv_capacity_bytes(self) -> int:
        """The KV capacity a simulated worker publishes (real capacity / ``kv_scale``)."""
        return int(self.real_kv_capacity_bytes / self.kv_scale)

    def prefill_s(self, tokens: int) -> float:
        return prefill_seconds(self.model, self.gpu, tokens, tp=self.tp)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return decode_step_seconds(self.model, self.gpu, batch, context_tokens, tp=self.tp)


# ------------------------------------------------------------------------------ hashing


def _roll(h: int, token: int) -> int:
    """FNV-1a over token ids (one 64-bit step per token)."""
    return ((h ^ (token + 1)) * _FNV_PRIME) & _MASK


def _mix(x: int) -> int:
    """splitmix64's finalizer: spreads every input bit over the output."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def context_hash(token_ids: Sequence[int], h: int = _FNV_OFFSET) -> int:
    for t in token_ids:
        h = _roll(h, t)
    return h


def next_token(context: int, sampling: SamplingParams, index: int, vocab: int) -> int:
    """Output token ``index`` after a context whose hash is ``context``: never ``vocab - 1``
    (the EOS id)."""
    x = _mix(context)
    if not sampling.greedy:
        x = _mix(x ^ _mix((sampling.seed * _FNV_PRIME + index) & _MASK))
    return x % (vocab - 1)


def sim_logprob(context: int, token: int, n: int, vocab: int) -> TokenLogprob:
    """``token``'s made-up log-probability after a context whose hash is ``context``, with
    ``n`` alternatives (see the module's docstring)."""
    best = next_token(context, _GREEDY, 0, vocab)
    words = vocab - 1
    ranked = [(best + k * _ALT_STRIDE) % words for k in range(max(n, _ALT_RANKS))]
    scores = {t: -0.1 - 0.5 * k for k, t in enumerate(ranked)}
    top = tuple(TopLogprob(t, scores[t]) for t in ranked[:n])
    own = scores.get(token, -5.0 - (_mix(context ^ (token + 1)) % 1000) / 100)
    return TokenLogprob(token, own, top)


_GREEDY = SamplingParams()
_ALT_STRIDE = 7919
_ALT_RANKS = 20


# ------------------------------------------------------------------------------- engine


@dataclass(eq=False)
class SimDecodeState(DecodeState):
    token_ids: list[int]
    generated: int
    sampling: SamplingParams
    context: int = field(repr=False)
    """Hash of every token in ``token_ids``."""
    owner: SimEngine = field(repr=False)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict, repr=False)


class SimPrefixCache:
    """An LRU of block keys, ``capacity`` blocks large; each key remembers its parent's
    (the block before it), so a prefix named by its last block is checked back to block 0."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._lru: OrderedDict[int, int | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def use(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest cached run of ``token_ids``' blocks; then all its full
        blocks are cached (most recently used)."""
        keys = block_keys(token_ids, SIM_BLOCK)
        hit = 0
        while hit < len(keys) and keys[hit] in self._lru:
            hit += 1
        for i, k in enumerate(keys):
            self._lru[k] = keys[i - 1] if i else None
            self._lru.move_to_end(k)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return hit * SIM_BLOCK

    def holds(self, tokens: int, digest: bytes) -> bool:
        """Whether every block of the ``tokens``-token prefix whose last block's digest is
        ``digest`` is cached (whole blocks only)."""
        if tokens <= 0 or tokens % SIM_BLOCK:
            return False
        key: int | None = key_of(digest)
        for _ in range(tokens // SIM_BLOCK):
            if key is None or key not in self._lru:
                return False
            key = self._lru[key]
        return key is None  # reached block 0: the prefix is exactly that long

    def report(self, limit: int) -> str:
        keys = list(self._lru)
        return encode_keys(keys[-limit:] if limit > 0 else [])


class SimEngine(Engine):
    """`Engine` whose compute is a hash and whose time comes from the performance model."""

    def __init__(self, spec: SimSpec, *, prefix_cache: bool = False) -> None:
        self.spec = spec
        m = spec.model
        kv_dtype = m.kv_dtype or m.dtype
        self.info = ModelInfo(
            name=f"sim-{m.name}",
            # Not the GPU: a prefill on an H100 hands KV to a decode on an L4.
            fingerprint=f"sim-{m.name}-{m.layers}L-{kv_dtype}-h{SIM_KV_HEADS}d{SIM_HEAD_DIM}",
            n_layers=m.layers,
            kv_heads=SIM_KV_HEADS,
            head_dim=SIM_HEAD_DIM,
            vocab_size=m.vocab,
            max_context=SIM_MAX_CONTEXT,
            eos_token_ids=(m.vocab - 1,),
            kv_dtype=_KV_DTYPE,
            kv_convertible=False,  # K's bits carry token ids, not numbers
        )
        self._words = m.vocab - 1
        blocks = spec.kv_capacity_bytes // (self.info.kv_bytes_per_token() * SIM_BLOCK)
        self.cache = SimPrefixCache(blocks) if prefix_cache else None
        self.reused = 0
        """Prompt tokens the last prefill found cached (what `busy_seconds` does not charge)."""
        self.reused_total = 0

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % self._words for w in text.split()]

    def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        ids: list[int] = []
        for role, content in messages:
            ids += self.tokenize(f"<{role}> {content}")
        return ids + self.tokenize("<assistant>")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return "".join(f" t{t}" for t in token_ids if t != self._words)

    # ------------------------------------------------------------------ compute
    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        first_index: int = 0,
        on_layer: LayerCallback | None = None,
    ) -> PrefillResult:
        n = len(token_ids)
        if not 0 < n <= self.info.max_context:
            raise ValueError(f"prompt of {n} tokens; this model takes 1..{self.info.max_context}")
        self._check_ids(token_ids)
        if self.cache is not None:
            self.reused = min(self.cache.use(token_ids), n - 1)
            self.reused_total += self.reused
        info = self.info
        kv = self._kv_of(token_ids)
        if on_layer is not None:
            for i, (k, v) in enumerate(kv):
                on_layer(i, k, v)
        context = context_hash(token_ids)
        first = next_token(context, sampling, first_index, info.vocab_size)
        first_logprob = None
        if sampling.logprobs is not None:
            first_logprob = sim_logprob(context, first, sampling.logprobs, info.vocab_size)
        prompt: list[TokenLogprob] = []
        if sampling.prompt_logprobs is not None and first_index == 0:
            prompt.append(TokenLogprob(token_ids[0], None))
            h = _roll(_FNV_OFFSET, token_ids[0])
            for t in token_ids[1:]:
                prompt.append(sim_logprob(h, t, sampling.prompt_logprobs, info.vocab_size))
                h = _roll(h, t)
        return PrefillResult(first, kv, first_logprob, tuple(prompt), self.reused)

    def _kv_of(self, token_ids: Sequence[int]) -> KvLayers:
        """The simulated KV of ``token_ids``: one block, layer after layer (K then V), like
        the reference engine's (the transport can send consecutive layers as one message)."""
        info = self.info
        n = len(token_ids)
        whole = np.zeros((info.n_layers, 2, info.kv_heads, n, info.head_dim), dtype=np.uint16)
        whole[:, 0, :, :, :2] = _id_bits(token_ids)
        return [(whole[i, 0], whole[i, 1]) for i in range(info.n_layers)]

    def holds_prefix(self, tokens: int, digest: bytes) -> bool:
        return self.cache is not None and self.cache.holds(tokens, digest)

    def prefix_kv(self, token_ids: Sequence[int], digest: bytes) -> KvLayers:
        n = len(token_ids)
        if self.cache is None:
            raise ValueError("this worker has no prefix cache")
        digests = block_digests(token_ids, SIM_BLOCK)
        if n % SIM_BLOCK or not digests or digests[-1] != digest:
            raise ValueError(f"the KV's prefix hash does not name these {n} tokens")
        if not self.cache.holds(n, digest):
            raise ValueError(f"the {n}-token prefix is no longer cached here")
        self._check_ids(token_ids)
        return self._kv_of(token_ids)  # the simulated KV is a function of the tokens

    def start_decode(
        self,
        kv: KvLayers,
        token_ids: Sequence[int],
        last_token: int,
        generated: int,
        sampling: SamplingParams,
    ) -> SimDecodeState:
        self._check_kv(kv, token_ids)
        self._check_ids([*token_ids, last_token])
        if self.cache is not None:  # the adopted KV's blocks are cached from now on
            self.cache.use(token_ids)
        if generated < 1:
            raise ValueError("generated must be >= 1: last_token is output token generated - 1")
        context = _roll(context_hash(token_ids), last_token)
        return SimDecodeState([*token_ids, last_token], generated, sampling, context, self)

    def decode_step(self, states: Sequence[DecodeState]) -> list[int]:
        mine = [self._own(s) for s in states]
        if len({id(s) for s in mine}) != len(mine):
            raise ValueError("the same decode state appears twice in one step")
        for s in mine:
            if len(s.token_ids) > self.info.max_context:
                raise ValueError(f"context full: {len(s.token_ids)} of {self.info.max_context}")
        out = []
        vocab = self.info.vocab_size
        for s in mine:
            token = next_token(s.context, s.sampling, s.generated, vocab)
            if s.sampling.logprobs is not None:
                s.logprobs[s.generated] = sim_logprob(s.context, token, s.sampling.logprobs, vocab)
            s.token_ids.append(token)
            s.context = _roll(s.context, token)
            s.generated += 1
            out.append(token)
        return out

    def kv_bytes(self, state: DecodeState) -> int:
        return (len(self._own(state).token_ids) - 1) * self.info.kv_bytes_per_token()

    # ------------------------------------------------------------------ time
    def busy_seconds(self, fn: Callable[..., Any], args: Sequence[Any]) -> float:
        """Simulated GPU time of ``fn(*args)`` (a call a worker makes through its runner)."""
        name = getattr(fn, "__name__", "")
        if name == "prefill":
            reused, self.reused = self.reused, 0
            return self.spec.prefill_s(len(args[0]) - reused)
        if name == "decode_step":
            states: Sequence[DecodeState] = args[0]
            if not states:
                return 0.0
            context = sum(len(s.token_ids) for s in states) // len(states)
            return self.spec.decode_step_s(len(states), max(1, context))
        return 0.0

    def prefix_report(self) -> tuple[int, str]:
        if self.cache is None:
            return 0, ""
        return SIM_BLOCK, self.cache.report(DEFAULT_REPORT_BLOCKS)

    # ------------------------------------------------------------------ checks
    def _own(self, state: DecodeState) -> SimDecodeState:
        if not isinstance(state, SimDecodeState) or state.owner is not self:
            raise ValueError("decode state was not started by this engine")
        return state

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.info.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            raise ValueError(f"token id outside the vocabulary [0, {vocab})")

    def _check_kv(self, kv: KvLayers, token_ids: Sequence[int]) -> None:
        info = self.info
        if len(kv) != info.n_layers:
            raise ValueError(f"KV has {len(kv)} layers, model has {info.n_layers}")
        want = (info.kv_heads, len(token_ids), info.head_dim)
        expected = _id_bits(token_ids)
        for i in (0, info.n_layers - 1):
            k, v = kv[i]
            for what, a in (("K", k), ("V", v)):
                if a.shape != want or a.dtype.itemsize != _KV_DTYPE.itemsize:
                    raise ValueError(
                        f"layer {i} {what}: {a.dtype}{list(a.shape)}, expected bf16{list(want)}"
                    )
            ids = k[:, :, :2].view(np.uint16)
            if not np.array_equal(ids, np.broadcast_to(expected, (*want[:2], 2))):
                raise ValueError(f"layer {i}: KV was computed for other tokens")


def _id_bits(token_ids: Sequence[int]) -> np.ndarray:
    """Each token id as two bf16 bit patterns of 14 bits (low, high): below 0x4000 every
    pattern is a finite bf16 value, so the simulated KV passes the receiver's NaN check."""
    ids = np.asarray(token_ids, dtype=np.int64)
    return np.stack([ids & 0x3FFF, (ids >> 14) & 0x3FFF], axis=-1).astype(np.uint16)


# ------------------------------------------------------------------------------- runner


class SimRunner(EngineRunner):
    """Runs a `SimEngine`'s calls on the event loop, then holds the worker's simulated GPU.

    The GPU is a FIFO clock: a call whose simulated time is *t* starts when the previous one
    ends (``free_at``) and returns at ``start + t`` — the queueing a real worker's single
    engine thread imposes, without a thread. Deadlines are kept on the clock, not by chaining
    sleeps, so event-loop lag does not accumulate into the simulated time.
    """

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self._sim = engine
        self._free_at = 0.0

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        result = fn(*args)
        seconds = self._sim.busy_seconds(fn, args)
        if seconds > 0:
            now = asyncio.get_running_loop().time()
            self._free_at = max(now, self._free_at) + seconds
            await asyncio.sleep(self._free_at - now)
        return result
