"""The reference engine: a transformers causal LM on CPU, float32, one sequence at a time.

KV layout. Each layer's cache lives in ONE numpy block shaped (2, kv_heads, capacity, head_dim):
K is ``block[0]``, V is ``block[1]``, so a layer's K and V are adjacent in memory and a
transport can move a whole layer as one zero-copy message. transformers reads and writes the
block through a torch view of the same memory (`_BlockLayer`, a `DynamicLayer` that appends
into spare capacity instead of concatenating a new tensor every step).

Prefill allocates blocks of exactly the prompt's length; they become the `PrefillResult`'s KV
without another copy, and ``on_layer(i, K, V)`` fires from inside the forward pass as soon as
layer *i* has written its KV (before its attention runs), so a sender can stream layer *i*
while layers *i+1…* compute. `start_decode` copies the caller's arrays into fresh blocks with
headroom; the caller may free its arrays as soon as it returns.

Decoding is NOT batched: `decode_step` runs its states one after another (interleaved). A
batched matmul may round differently from an unbatched one, so a token could depend on which
other requests shared its batch; one-at-a-time keeps every sequence's floating-point path a
function of that sequence alone, which is what makes a prefill/decode split and any failover
continuation token-identical to an uninterrupted run. Every token is drawn with
`orchestrator.core.sampling.sample` at its own output index.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import xxhash
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import Cache, DynamicLayer

from orchestrator.core import logprobs as lps
from orchestrator.core.sampling import SamplingParams, sample
from orchestrator.errors import ConfigError
from orchestrator.workers.engine import (
    DecodeState,
    Engine,
    KvLayers,
    LayerCallback,
    ModelInfo,
    PrefillResult,
)
from transport.wire import DType

TRANSFORMERS_MIN = (5, 24)
"""The oldest transformers this engine runs on (pyproject's ``engine`` extra): older ones take
the model's cache as ``past_key_values``, ignore ``cache=`` and build their own, so a prefill
would hand out a KV of zero tokens (`check_transformers`)."""


def check_transformers(version: str) -> None:
    """Refuse a transformers older than `TRANSFORMERS_MIN` (ConfigError, saying what to
    install) — e.g. the vLLM extra's environment, whose vLLM pins an older one."""
    found = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if found < TRANSFORMERS_MIN:
        need = ".".join(map(str, TRANSFORMERS_MIN))
        raise ConfigError(
            "transformers",
            f"the reference engine needs transformers>={need}, found {version}: install "
            "pdorch[engine] in an environment of its own (`make venv`; the vLLM extra's pins "
            "an older transformers — run `--engine vllm` there)",
        )


# Decode blocks start with this many free token slots and then double: a few appends per
# reallocation at first, amortised O(1) copying per token after that.
_DECODE_HEADROOM = 64

# Config keys that say nothing about what the model computes (paths, versions, output flags,
# token ids); everything else in the config, plus every weight's bytes, goes into the
# fingerprint. Unknown keys stay in: a false mismatch costs a re-prefill, a false match junk.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
)

_KV_DTYPE = DType.FLOAT32


class _BlockLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # untyped __init_subclass__
    """One layer's cache in a (2, kv_heads, capacity, head_dim) float32 numpy block.

    ``keys``/``values`` (what transformers reads) are torch views of the filled prefix,
    shaped (1, kv_heads, length, head_dim). ``on_update`` runs after every append.
    """

    def __init__(self, block: np.ndarray, length: int = 0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.block = block
        self.length = length
        self.on_update: Callable[[], None] | None = None
        self._view()

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(self.block).unsqueeze(1)  # (2, 1, heads, capacity, head_dim)
        keys, values = t[0, :, :, : self.length], t[1, :, :, : self.length]
        self.keys, self.values = keys, values
        self.device = t.device
        self.is_initialized = True
        return keys, values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: the block exists from construction."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = self.length + key_states.shape[-2]
        if new > self.block.shape[2]:
            grown = np.empty(
                (*self.block.shape[:2], max(new, 2 * self.block.shape[2]), self.block.shape[3]),
                np.float32,
            )
            grown[:, :, : self.length] = self.block[:, :, : self.length]
            self.block = grown
        t = torch.from_numpy(self.block)
        t[0, :, self.length : new].copy_(key_states[0])
        t[1, :, self.length : new].copy_(value_states[0])
        self.length = new
        views = self._view()
        if self.on_update is not None:
            self.on_update()
        return views

    def truncate(self, length: int) -> None:
        """Forget appends past ``length`` (undoes a decode step that failed part-way)."""
        self.length = min(self.length, length)
        self._view()

    def get_seq_length(self) -> int:
        return self.length

    def kv(self) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) of the filled prefix: views, contiguous only when the block is full."""
        return self.block[0, :, : self.length], self.block[1, :, : self.length]


def _kv_block(heads: int, tokens: int, head_dim: int) -> np.ndarray:
    return np.empty((2, heads, tokens, head_dim), dtype=np.float32)


@dataclass(eq=False)
class HfDecodeState(DecodeState):
    token_ids: list[int]
    generated: int
    sampling: SamplingParams
    cache: Cache = field(repr=False)
    owner: HfEngine = field(repr=False)
    logprobs: dict[int, lps.TokenLogprob] = field(default_factory=dict, repr=False)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is in the cache: all of ``token_ids`` but the last."""
        return len(self.token_ids) - 1


class HfEngine(Engine):
    """`Engine` over a transformers causal LM (Llama family tested), CPU float32."""

    def __init__(
        self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        check_transformers(transformers.__version__)
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise ValueError(f"HfEngine runs float32 on CPU, got {model.dtype} on {model.device}")
        self.model = model
        model.eval()  # type: ignore[no-untyped-call]
        self.tokenizer = tokenizer
        cfg = model.config
        self._heads = int(cfg.num_key_value_heads)
        self._head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self._n_layers = int(cfg.num_hidden_layers)
        self.info = ModelInfo(
            name=name,
            fingerprint=fingerprint(model, _KV_DTYPE),
            n_layers=self._n_layers,
            kv_heads=self._heads,
            head_dim=self._head_dim,
            vocab_size=int(cfg.vocab_size),
            max_context=int(cfg.max_position_embeddings),
            eos_token_ids=_eos_ids(model.generation_config, tokenizer),
            kv_dtype=_KV_DTYPE,
        )

    @classmethod
    def from_pretrained(cls, path: Path, name: str) -> HfEngine:
        """Load a model + tokenizer saved with ``save_pretrained`` (local files only)."""
        check_transformers(transformers.__version__)  # before loading with one too old
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
        )
        return cls(name, model, tokenizer)

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str) -> list[int]:
        """Plain text to ids, no special tokens added (markup in ``text`` is still parsed)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        conversation = [{"role": role, "content": content} for role, content in messages]
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, not str")
        return self.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

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
        # All layers in one allocation, layer after layer (K then V): the transport can then
        # send a run of consecutive layers as one zero-copy message.
        whole = np.empty((self._n_layers, 2, self._heads, n, self._head_dim), dtype=np.float32)
        layers = [_BlockLayer(whole[i]) for i in range(self._n_layers)]
        if on_layer is not None:
            for i, layer in enumerate(layers):
                layer.on_update = _emitter(on_layer, i, layer)
        scored = sampling.prompt_logprobs is not None and first_index == 0
        every = self._forward(token_ids, Cache(layers=[*layers]), position=0, every=scored)
        logits = every[-1]
        first = sample(logits, sampling, first_index, token_ids, self.info.eos_token_ids)
        return PrefillResult(
            first_token=first,
            kv=[layer.kv() for layer in layers],
            first_logprob=_logprob(logits, first, sampling),
            prompt_logprobs=(
                tuple(lps.prompt_logprobs(every, token_ids, sampling.prompt_logprobs or 0))
                if scored
                else ()
            ),
        )

    def start_decode(
        self,
        kv: KvLayers,
        token_ids: Sequence[int],
        last_token: int,
        generated: int,
        sampling: SamplingParams,
    ) -> HfDecodeState:
        n = len(token_ids)
        self._check_kv(kv, n)
        self._check_ids([*token_ids, last_token])
        if generated < 1:
            raise ValueError("generated must be >= 1: last_token is output token generated - 1")
        layers = []
        for k, v in kv:
            block = _kv_block(self._heads, n + _DECODE_HEADROOM, self._head_dim)
            block[0, :, :n] = k
            block[1, :, :n] = v
            layers.append(_BlockLayer(block, length=n))
        return HfDecodeState(
            token_ids=[*token_ids, last_token],
            generated=generated,
            sampling=sampling,
            cache=Cache(layers=[*layers]),
            owner=self,
        )

    def decode_step(self, states: Sequence[DecodeState]) -> list[int]:
        """All or nothing: if any state fails, the ones already advanced are rolled back, so
        no token is ever produced without being returned."""
        mine = [self._own(s) for s in states]
        if len({id(s) for s in mine}) != len(mine):
            raise ValueError("the same decode state appears twice in one step")
        for s in mine:
            if s.cached_tokens >= self.info.max_context:
                raise ValueError(f"context full: {s.cached_tokens} of {self.info.max_context}")
        done: list[HfDecodeState] = []
        try:
            for s in mine:
                self._step(s)
                done.append(s)
        except BaseException:
            for s in done:
                s.token_ids.pop()
                s.generated -= 1
                _truncate(s.cache, s.cached_tokens)
            raise
        return [s.token_ids[-1] for s in mine]

    def kv_bytes(self, state: DecodeState) -> int:
        return self._own(state).cached_tokens * self.info.kv_bytes_per_token()

    # ------------------------------------------------------------------ internals
    def _step(self, state: HfDecodeState) -> None:
        position = state.cached_tokens
        try:
            logits = self._forward(state.token_ids[-1:], state.cache, position=position)[-1]
            token = sample(
                logits, state.sampling, state.generated, state.token_ids, self.info.eos_token_ids
            )
            scored = _logprob(logits, token, state.sampling)
        except BaseException:
            _truncate(state.cache, position)
            raise
        if scored is not None:
            state.logprobs[state.generated] = scored
        state.token_ids.append(token)
        state.generated += 1

    def _forward(
        self, token_ids: Sequence[int], cache: Cache, position: int, every: bool = False
    ) -> np.ndarray:
        """Run ``token_ids`` at ``position`` onwards through the model; the logits of the
        last position (of ``every`` position: prompt log-probabilities), one row each."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        positions = torch.arange(position, position + len(token_ids), dtype=torch.long)[None]
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if every else 1,
            )
        logits: np.ndarray = out.logits[0].float().numpy()
        return logits

    def _own(self, state: DecodeState) -> HfDecodeState:
        if not isinstance(state, HfDecodeState) or state.owner is not self:
            raise ValueError("decode state was not started by this engine")
        return state

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.info.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            raise ValueError(f"token id outside the vocabulary [0, {vocab})")

    def _check_kv(self, kv: KvLayers, tokens: int) -> None:
        if len(kv) != self._n_layers:
            raise ValueError(f"KV has {len(kv)} layers, model has {self._n_layers}")
        want = (self._heads, tokens, self._head_dim)
        for i, (k, v) in enumerate(kv):
            for what, a in (("K", k), ("V", v)):
                if a.shape != want or a.dtype != np.float32:
                    raise ValueError(
                        f"layer {i} {what}: {a.dtype}{list(a.shape)}, expected float32{list(want)}"
                    )


def _logprob(logits: np.ndarray, token: int, sampling: SamplingParams) -> lps.TokenLogprob | None:
    if sampling.logprobs is None:
        return None
    return lps.token_logprob(logits, token, sampling.logprobs)


def _truncate(cache: Cache, length: int) -> None:
    for layer in cache.layers:
        if isinstance(layer, _BlockLayer):
            layer.truncate(length)


def _emitter(on_layer: LayerCallback, index: int, layer: _BlockLayer) -> Callable[[], None]:
    def emit() -> None:
        on_layer(index, *layer.kv())

    return emit


def _eos_ids(
    generation: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, ...]:
    ids: set[int] = set()
    configured = generation.eos_token_id if generation is not None else None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def fingerprint(model: PreTrainedModel, kv_dtype: DType) -> str:
    """``<model_type>-<layers>L-<kv dtype>-<xxh3-128 hex>`` over the compute-relevant config,
    the KV dtype and every parameter and buffer's name, dtype, shape and bytes.

    Hashing all weights (not a sample) costs ~0.1 s for 135M parameters with xxh3 and makes
    two checkpoints that differ in one tensor never exchange KV.
    """
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = xxhash.xxh3_128()
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(kv_dtype.name.encode())
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        t = tensor.detach().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    n_layers = model.config.num_hidden_layers
    return f"{model.config.model_type}-{n_layers}L-{kv_dtype.name.lower()}-{h.hexdigest()}"
