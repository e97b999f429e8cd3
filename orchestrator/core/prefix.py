"""Which worker holds which prompt prefix in its KV cache: block hashes and the index. Pure.

**Block hashes (vLLM's).** A token sequence is cut into full blocks of ``block_size``
tokens (a partial last block is never cached, so never hashed). Block *i*'s digest is::

    d[i] = sha256(cbor([d[i-1], [t0, ..., t(B-1)], null]))      d[-1] = sha256(cbor(seed))

with ``cbor`` canonical CBOR — exactly vLLM v1's ``hash_block_tokens`` with its default
``sha256_cbor`` hash function (``prefix_caching_hash_algo="sha256_cbor"``; its default
"sha256" pickles Python objects), no LoRA / multimodal / cache-salt extra keys, and its
``NONE_HASH`` for ``seed`` (vLLM's fixed "vllm-none-hash" unless ``PYTHONHASHSEED`` is set);
`tests/vllm/test_vllm_prefix.py` checks this against vLLM itself. Chaining makes a digest
name the whole prefix up to its block: a worker that holds ``d[i]`` holds the KV of tokens
``[0, (i + 1) * B)`` — if it also holds every block before it, which is why a match is the
*longest run from block 0*, as vLLM's own cache lookup stops at the first miss.

The index and the heartbeat use a block's **key**: the low 64 bits of its digest (what
vLLM's KV events carry when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, its default).
Two different prefixes sharing a key (2^-64 per pair) would only mis-route a request, never
corrupt it: a key is advice for placement, and the engine that runs the request checks
its own full hashes.

**The index** (`PrefixIndex`): worker → the set of keys it holds, and key → workers.
Workers publish their keys in their heartbeat (`encode_keys`, newest last, bounded); each
orchestrator replica `sync`s its index from the live heartbeats — a full snapshot per
worker, so a replica that missed beats, or a worker that restarted, is exact again at the
next beat, and a worker whose heartbeat expired is dropped with everything it held.
`apply` takes stored/removed/cleared events (what the worker side does with vLLM's).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.errors import ConfigError

DEFAULT_SEED = "vllm-none-hash"
"""The hash seed of the first block's parent. Any fixed string works for routing (workers
re-hash their engine's blocks with pdorch's function); this one is vLLM's own default
(``DEFAULT_NONE_HASH_SEED``), so a vLLM engine hashing with sha256_cbor and no
``PYTHONHASHSEED`` computes exactly pdorch's digests."""

DEFAULT_REPORT_BLOCKS = 4096
"""The most block keys a worker's heartbeat carries (its newest; ~48 KiB of JSON). A worker
holding more is under-reported: only slower routing, never wrong."""

KEY_BITS = 64
_KEY_MASK = (1 << KEY_BITS) - 1


# --------------------------------------------------------------------------- hashing


def _cbor_head(major: int, n: int) -> bytes:
    """A canonical (shortest) CBOR head for major type ``major`` and argument ``n``."""
    if n < 24:
        return bytes([major << 5 | n])
    if n < 1 << 8:
        return bytes([major << 5 | 24, n])
    if n < 1 << 16:
        return bytes([major << 5 | 25]) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes([major << 5 | 26]) + struct.pack(">I", n)
    if n < 1 << 64:
        return bytes([major << 5 | 27]) + struct.pack(">Q", n)
    raise ConfigError("token_ids", f"token id {n} does not fit 64 bits")


_TOKEN_CBOR: dict[int, bytes] = {}
"""Token id -> its CBOR encoding: hashing is on every placement's path, and a dict lookup
per token is ~30x cheaper than encoding it again. Bounded by the vocabulary (and cleared
past ``_TOKEN_CBOR_MAX`` ids, should anyone send arbitrary ones)."""
_TOKEN_CBOR_MAX = 1 << 20


def _token_cbor(t: int) -> bytes:
    if t < 0:
        raise ConfigError("token_ids", f"negative token id {t}")
    if len(_TOKEN_CBOR) >= _TOKEN_CBOR_MAX:
        _TOKEN_CBOR.clear()
    enc = _TOKEN_CBOR[t] = _cbor_head(0, t)
    return enc


def _block_cbor(parent: bytes, tokens: Sequence[int]) -> bytes:
    """``cbor([parent, tokens, null])`` — the tuple vLLM hashes for a block."""
    get = _TOKEN_CBOR.get
    body = b"".join([get(t) or _token_cbor(t) for t in tokens])
    return b"".join(
        (b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(tokens)), body, b"\xf6")
    )


def root_digest(seed: str = DEFAULT_SEED) -> bytes:
    """The first block's parent: vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed``."""
    raw = seed.encode()
    return hashlib.sha256(_cbor_head(3, len(raw)) + raw).digest()


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    seed: str = DEFAULT_SEED,
) -> list[bytes]:
    """The chained sha256 digests of the full blocks of ``token_ids``, continuing after
    ``parent`` (the digest of the block before them; None: from the sequence's start)."""
    if block_size <= 0:
        raise ConfigError("block_size", f"must be > 0, got {block_size!r}")
    prev = root_digest(seed) if parent is None else parent
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hashlib.sha256(_block_cbor(prev, token_ids[start : start + block_size])).digest()
        out.append(prev)
    return out


def key_of(digest: bytes) -> int:
    """A digest's 64-bit key (the low 64 bits of it read big-endian, as vLLM's events)."""
    return int.from_bytes(digest, "big") & _KEY_MASK


def block_keys(token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED) -> list[int]:
    return [key_of(d) for d in block_digests(token_ids, block_size, seed=seed)]


def iter_block_keys(
    token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED
) -> Iterator[int]:
    """`block_keys`, one block at a time: a lookup stops hashing at the first block no
    worker holds (a new prompt costs one hash, not one per block)."""
    if block_size <= 0:
        raise ConfigError("block_size", f"must be > 0, got {block_size!r}")
    prev = root_digest(seed)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hashlib.sha256(_block_cbor(prev, token_ids[start : start + block_size])).digest()
        yield key_of(prev)


@dataclass(frozen=True, slots=True)
class SuffixPlan:
    """A suffix-only KV transfer: the receiver holds the KV of the first ``tokens`` tokens
    (whole blocks), the prefix named by ``digest``; only the tokens after it are sent."""

    tokens: int
    digest: bytes


def suffix_plan(
    token_ids: Sequence[int], held_tokens: int, block_size: int, seed: str = DEFAULT_SEED
) -> SuffixPlan | None:
    """What need not be sent to a worker holding the first ``held_tokens`` of
    ``token_ids`` in blocks of ``block_size``: whole blocks, leaving at least one token to
    send (a transfer carries at least one); None when nothing can be left out."""
    if block_size <= 0 or held_tokens <= 0:
        return None
    blocks = min(held_tokens, len(token_ids) - 1) // block_size
    if blocks <= 0:
        return None
    n = blocks * block_size
    return SuffixPlan(n, block_digests(token_ids[:n], block_size, seed=seed)[-1])


# --------------------------------------------------------------- heartbeat payload


def encode_keys(keys: Sequence[int]) -> str:
    """Keys as they travel in a heartbeat: base64 of big-endian uint64s (12 bytes of JSON
    per block, against ~20 for a decimal number)."""
    return base64.b64encode(b"".join(struct.pack(">Q", k & _KEY_MASK) for k in keys)).decode()


def decode_keys(text: str) -> tuple[int, ...]:
    """`encode_keys`'s inverse; a malformed payload is a `ConfigError` (the caller treats
    the worker as holding nothing)."""
    try:
        raw = base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError("kv_prefix", f"not base64: {exc}") from exc
    if len(raw) % 8:
        raise ConfigError("kv_prefix", f"{len(raw)} bytes is not a whole number of keys")
    return tuple(k for (k,) in struct.iter_unpack(">Q", raw))


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Stored:
    """The worker now holds these blocks."""

    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    """The worker evicted these blocks."""

    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The worker dropped its whole cache (vLLM's ``AllBlocksCleared``; a restart)."""


Event = Stored | Removed | Cleared


# ---------------------------------------------------------------------------- index


@dataclass(frozen=True, slots=True)
class Match:
    """How much of a sequence a worker holds: its first ``blocks`` full blocks."""

    worker_id: str
    blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


class PrefixIndex:
    """Worker → keys held, and key → workers. Not thread-safe (one per event loop)."""

    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}
        self._where: dict[int, set[str]] = {}
        self._block_size: dict[str, int] = {}
        self._seen: dict[str, str] = {}
        """Worker → the heartbeat payload its keys were last rebuilt from."""

    def __len__(self) -> int:
        return len(self._where)

    def workers(self) -> set[str]:
        return set(self._held)

    def held(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._held.get(worker_id, ()))

    def block_size(self, worker_id: str) -> int:
        return self._block_size.get(worker_id, 0)

    def _add(self, worker_id: str, keys: Iterable[int]) -> None:
        held = self._held.setdefault(worker_id, set())
        for k in keys:
            if k not in held:
                held.add(k)
                self._where.setdefault(k, set()).add(worker_id)

    def _remove(self, worker_id: str, keys: Iterable[int]) -> None:
        held = self._held.get(worker_id)
        if held is None:
            return
        for k in keys:
            if k in held:
                held.discard(k)
                owners = self._where[k]
                owners.discard(worker_id)
                if not owners:
                    del self._where[k]

    def apply(self, worker_id: str, block_size: int, events: Iterable[Event]) -> None:
        """Apply a worker's events in order."""
        self._block_size[worker_id] = block_size
        self._held.setdefault(worker_id, set())
        self._seen.pop(worker_id, None)  # no longer what any payload said
        for e in events:
            if isinstance(e, Stored):
                self._add(worker_id, e.keys)
            elif isinstance(e, Removed):
                self._remove(worker_id, e.keys)
            else:
                self._remove(worker_id, list(self._held.get(worker_id, ())))

    def replace(self, worker_id: str, block_size: int, keys: Iterable[int]) -> None:
        """Rebuild a worker's entry from its full state (a snapshot)."""
        new = set(keys)
        old = self._held.get(worker_id, set())
        self._remove(worker_id, old - new)
        self._add(worker_id, new - old)
        self._block_size[worker_id] = block_size

    def drop(self, worker_id: str) -> None:
        """Forget a worker (its heartbeat expired: it took its cache with it)."""
        self._remove(worker_id, list(self._held.get(worker_id, ())))
        self._held.pop(worker_id, None)
        self._block_size.pop(worker_id, None)
        self._seen.pop(worker_id, None)

    def sync(self, reports: Mapping[str, tuple[int, str]]) -> None:
        """Make the index what the live heartbeats say: ``reports`` is worker id →
        (block size, `encode_keys` payload) of every live worker that reports a cache.
        Workers not in it are dropped; a payload seen before costs nothing; a malformed
        one counts as holding nothing (only slower, never wrong)."""
        for wid in self.workers() - set(reports):
            self.drop(wid)
        for wid, (block_size, payload) in reports.items():
            if self._seen.get(wid) == payload and self._block_size.get(wid) == block_size:
                continue
            try:
                keys: Sequence[int] = decode_keys(payload)
            except ConfigError:
                keys = ()
            if block_size <= 0:
                keys = ()
            self.replace(wid, block_size, keys)
            self._seen[wid] = payload

    def match(self, keys_by_size: Mapping[int, Iterable[int]]) -> dict[str, Match]:
        """Per worker holding at least block 0: the longest run of the sequence's blocks
        from block 0 it holds. ``keys_by_size``: block size → the sequence's keys for that
        size (`block_keys`, or `iter_block_keys`: read only while some worker still holds
        every block so far)."""
        out: dict[str, Match] = {}
        for size, keys in keys_by_size.items():
            alive: set[str] | None = None
            depth = 0
            for key in keys:
                holders = {w for w in self._where.get(key, ()) if self._block_size.get(w) == size}
                nxt = holders if alive is None else alive & holders
                for w in (alive or set()) - nxt:
                    out[w] = Match(w, depth, size)
                alive = nxt
                if not alive:
                    break
                depth += 1
            for w in alive or ():
                out[w] = Match(w, depth, size)
        return out

    def sizes(self) -> set[int]:
        """The block sizes of the workers in the index."""
        return {s for w, s in self._block_size.items() if self._held.get(w)}
