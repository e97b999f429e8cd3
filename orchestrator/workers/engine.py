"""The engine interface: what a worker needs from a model runtime.

An engine is synchronous and single-threaded (workers call it from one executor thread);
it computes, it does no I/O. KV caches cross the engine boundary as numpy arrays, one
(K, V) pair per layer, each shaped (kv_heads, tokens, head_dim) and C-contiguous — the form
the transport moves (`transport.wire`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.sampling import SamplingParams
from transport.wire import DType, ModelSpec

KvLayers = list[tuple[np.ndarray, np.ndarray]]
LayerCallback = Callable[[int, np.ndarray, np.ndarray], None]
"""Called with (layer index, K, V) as soon as a layer's KV exists (layer-wise streaming)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    fingerprint: str
    """Identifies weights + architecture + KV dtype; KV is accepted only between equals."""
    n_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    kv_dtype: DType
    kv_convertible: bool = True
    """The KV holds numbers a dtype conversion preserves (`transport.kvcodec`); False for an
    engine whose KV bits mean something else (the simulated engine's carry token ids)."""

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            fingerprint=self.fingerprint,
            n_layers=self.n_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_tokens=self.max_context,
        )

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int
    """Output token 0, sampled from the last prompt position's logits."""
    kv: KvLayers
    """KV of every *input* token (the prompt), per layer."""
    first_logprob: TokenLogprob | None = None
    """The first token's log-probability, when ``sampling.logprobs`` is set (texts empty:
    the host names the tokens)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """Every input token's, when ``sampling.prompt_logprobs`` is set and ``first_index`` is
    0 (a failover's re-prefill has the prompt's in the journal already)."""
    cached_tokens: int = 0
    """Input tokens the engine found in its prefix cache and did not compute."""


class DecodeState(abc.ABC):
    """One sequence being decoded: its KV so far and what it has generated."""

    token_ids: list[int]
    """Every token whose KV is in the state, plus the last sampled token (not yet in KV)."""
    generated: int
    """How many output tokens exist so far (index of the next one to sample)."""
    sampling: SamplingParams
    logprobs: dict[int, TokenLogprob]
    """Output index -> that token's log-probability, filled by `Engine.decode_step` when
    ``sampling.logprobs`` is set; the host takes each out as it streams the token."""


class Engine(abc.ABC):
    info: ModelInfo

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of (role, content) messages through the model's chat template,
        with the generation prompt appended."""

    @abc.abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    @abc.abstractmethod
    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        first_index: int = 0,
        on_layer: LayerCallback | None = None,
    ) -> PrefillResult:
        """Run the prompt; sample output token ``first_index`` (0 for a new request; the
        number already generated when a failover re-prefills prompt + generated tokens).
        ``token_ids`` are the whole history the draw sees (`core.sampling.sample`)."""

    @abc.abstractmethod
    def start_decode(
        self,
        kv: KvLayers,
        token_ids: Sequence[int],
        last_token: int,
        generated: int,
        sampling: SamplingParams,
    ) -> DecodeState:
        """Adopt a KV cache (copied: the caller may release ``kv`` afterwards) covering
        ``token_ids``; ``last_token`` is output token ``generated - 1``, not yet in the KV."""

    @abc.abstractmethod
    def decode_step(self, states: Sequence[DecodeState]) -> list[int]:
        """Advance each state by one token (feeding its last token, sampling the next with
        its own parameters at index ``generated``); returns the new token of each."""

    @abc.abstractmethod
    def kv_bytes(self, state: DecodeState) -> int: ...

    def prefix_report(self) -> tuple[int, str]:
        """(block size, `orchestrator.core.prefix.encode_keys` of its prefix cache) for
        KV-aware routing; (0, "") without a prefix cache — the reference engine recomputes
        every prompt (its KV is per request)."""
        return 0, ""

    def holds_prefix(self, tokens: int, digest: bytes) -> bool:
        """Whether the prefix cache holds the KV of a ``tokens``-token prefix whose last
        block's chained digest is ``digest`` (`orchestrator.core.prefix`): what a
        suffix-only transfer's receiver checks before taking it. False without a cache."""
        return False

    def prefix_kv(self, token_ids: Sequence[int], digest: bytes) -> KvLayers:
        """The cached KV of ``token_ids`` (a prefix whose last block's digest is ``digest``),
        to which a suffix-only transfer's KV is appended; ValueError if it is not held."""
        raise ValueError("this engine has no prefix cache")
