"""The per-request parameters between pdorch and its connector, and the prefill's outcome. Pure.

They travel through vLLM as plain dicts: in ``SamplingParams.extra_args["kv_transfer_params"]``
into the engine core (the scheduler-side connector reads ``request.kv_transfer_params``), and
back in the finished ``RequestOutput.kv_transfer_params``. Everything we put there sits under
one key (`KEY`) so vLLM's own connectors' keys never collide with ours, and everything read
back is validated here: a dict that is not ours, or a prefill whose transfer outcome is
missing, reads as a *failed* transfer, never as a success.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transport import wire

KEY = "pdorch"
"""The one key of ``kv_transfer_params`` that carries pdorch's parameters and results."""

DTYPES: dict[str, wire.DType] = {
    "float32": wire.DType.FLOAT32,
    "float16": wire.DType.FLOAT16,
    "bfloat16": wire.DType.BFLOAT16,
    "fp8": wire.DType.FLOAT8_E4M3,
}
"""Wire dtypes by the names `prefill_params` accepts (``""`` means the cache's own)."""


class ParamsError(ValueError):
    """kv_transfer_params that are not valid pdorch parameters."""


@dataclass(frozen=True, slots=True)
class PrefillParams:
    request_id: str
    epoch: int
    target: str
    """Decode worker's KV address, "host:port"."""
    kv_dtype: str
    """Wire dtype name (a key of `DTYPES`) or "" for the cache's own dtype."""
    prefix_tokens: int = 0
    """The decode worker holds the first this many tokens' KV (whole blocks, named by
    ``prefix_hash``): send only the blocks after them. 0: send the whole KV."""
    prefix_hash: str = ""
    """With ``prefix_tokens``: the prefix's chained block digest (`orchestrator.core.prefix`),
    hex."""

    def to_dict(self) -> dict[str, Any]:
        return {
            KEY: {
                "role": "prefill",
                "request_id": self.request_id,
                "epoch": self.epoch,
                "target": self.target,
                "kv_dtype": self.kv_dtype,
                "prefix_tokens": self.prefix_tokens,
                "prefix_hash": self.prefix_hash,
            }
        }

    @property
    def prefix_digest(self) -> bytes:
        return bytes.fromhex(self.prefix_hash)


@dataclass(frozen=True, slots=True)
class DecodeParams:
    request_id: str
    epoch: int
    num_tokens: int
    """Tokens the pushed KV covers (the prompt's tokens except the last, which decode computes)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            KEY: {
                "role": "decode",
                "request_id": self.request_id,
                "epoch": self.epoch,
                "num_tokens": self.num_tokens,
            }
        }


def parse(params: dict[str, Any] | None) -> PrefillParams | DecodeParams | None:
    """Our parameters from a request's ``kv_transfer_params``; None if it carries none."""
    if not params or KEY not in params:
        return None
    p = params[KEY]
    if not isinstance(p, dict):
        raise ParamsError(f"{KEY!r} must be a dict, got {type(p).__name__}")
    role = p.get("role")
    rid, epoch = p.get("request_id"), p.get("epoch")
    if not isinstance(rid, str) or not rid or not isinstance(epoch, int) or _negative(epoch):
        raise ParamsError(f"bad request id or epoch in {p!r}")
    if role == "prefill":
        target, dtype = p.get("target"), p.get("kv_dtype", "")
        if not isinstance(target, str) or ":" not in target:
            raise ParamsError(f"bad KV target {target!r}")
        if dtype not in ("", *DTYPES):
            raise ParamsError(f"unknown KV dtype {dtype!r}")
        n, digest = p.get("prefix_tokens", 0), p.get("prefix_hash", "")
        if not isinstance(n, int) or _negative(n) or not isinstance(digest, str):
            raise ParamsError(f"bad prefix {n!r} {digest!r}")
        if n and not _digest_hex(digest):
            size = wire.PREFIX_HASH_BYTES
            raise ParamsError(f"a {n}-token prefix needs a {size}-byte hex digest")
        return PrefillParams(rid, epoch, target, dtype, n, digest if n else "")
    if role == "decode":
        n = p.get("num_tokens")
        if not isinstance(n, int) or _negative(n) or n == 0:
            raise ParamsError(f"bad num_tokens {n!r}")
        return DecodeParams(rid, epoch, n)
    raise ParamsError(f"unknown role {role!r}")


def _digest_hex(s: str) -> bool:
    try:
        return len(bytes.fromhex(s)) == wire.PREFIX_HASH_BYTES
    except ValueError:
        return False


def _negative(x: int) -> bool:
    """A bool is an int to Python; here it is as wrong as a negative number."""
    return isinstance(x, bool) or x < 0


@dataclass(frozen=True, slots=True)
class PrefillTransfer:
    """How the prefill's KV push ended. ``ok`` only once the decode side verified all of it."""

    ok: bool
    error: str = ""
    kv_bytes: int = 0
    transfer_ms: float = 0.0
    """Open to the receiver's DONE."""
    retryable: bool = False
    """The error may go away on another try (the transport error's own ``retryable``)."""
    tail_ms: float = 0.0
    """How long the engine step waited for the transfer after its last layer was computed:
    the part of the transfer the layer-wise push did not hide behind compute."""
    prefix_tokens: int = 0
    """The KV sent extends the decode worker's first this many tokens (a suffix only)."""
    prefix_refused: bool = False
    """A suffix was asked, the decode worker lacked its prefix: the whole KV was sent."""
    gather_ms: float = 0.0
    """Time the forward spent handing the layers over (gathering the request's blocks,
    unless they were read in place)."""
    in_place: bool = False
    """The decode side read the blocks straight out of the prefill's cache (``ucx-read``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "error": self.error,
            "kv_bytes": self.kv_bytes,
            "transfer_ms": self.transfer_ms,
            "retryable": self.retryable,
            "tail_ms": self.tail_ms,
            "prefix_tokens": self.prefix_tokens,
            "prefix_refused": self.prefix_refused,
            "gather_ms": self.gather_ms,
            "in_place": self.in_place,
        }

    @classmethod
    def from_dict(cls, d: object) -> PrefillTransfer:
        if not isinstance(d, dict) or not isinstance(d.get("ok"), bool):
            return cls(ok=False, error=f"malformed transfer result {d!r}")
        try:
            return cls(
                ok=d["ok"],
                error=str(d.get("error", "")),
                kv_bytes=int(d.get("kv_bytes", 0)),
                transfer_ms=float(d.get("transfer_ms", 0.0)),
                retryable=bool(d.get("retryable", False)),
                tail_ms=float(d.get("tail_ms", 0.0)),
                prefix_tokens=int(d.get("prefix_tokens", 0)),
                prefix_refused=bool(d.get("prefix_refused", False)),
                gather_ms=float(d.get("gather_ms", 0.0)),
                in_place=bool(d.get("in_place", False)),
            )
        except (TypeError, ValueError) as exc:
            return cls(ok=False, error=f"malformed transfer result: {exc}")


RESULT = "result"
"""Key (under `KEY`) of the prefill's `PrefillTransfer` in the finished output's params."""


def result_of(kv_transfer_params: dict[str, Any] | None) -> PrefillTransfer:
    """The outcome the connector recorded for a finished prefill request (fails closed)."""
    ours = (kv_transfer_params or {}).get(KEY)
    if not isinstance(ours, dict) or RESULT not in ours:
        return PrefillTransfer(
            ok=False, error="the engine reported no KV transfer outcome", retryable=True
        )
    return PrefillTransfer.from_dict(ours[RESULT])
