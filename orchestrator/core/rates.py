"""What the pools measurably do: prefill throughput and the KV transfer's cost. Pure.

An orchestrator feeds every finished prefill (worker, prompt tokens, engine seconds) and every
KV transfer (bytes, seconds) in; admission and placement read estimates out:

* **prefill rate** (tokens/s): an exponentially weighted mean per worker, falling back to the
  mean of the worker's GPU kind, then of the whole pool, so a new worker is estimated from
  its peers until it has its own samples;
* **transfer model**: ``seconds = fixed + bytes * per_byte``, a least-squares line over the
  last ``window`` transfers (fixed: connection, handshake and RPC round trips; per_byte: the
  link's inverse bandwidth). With too few samples, or samples all of one size, only what
  can be fitted is returned.

Nothing here is trusted before ``min_samples`` measurements: callers treat ``None`` as
"not known yet" and fall back to their defaults.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Ewma:
    alpha: float = 0.2
    value: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1


@dataclass(frozen=True, slots=True)
class TransferModel:
    fixed_s: float
    """Cost of a transfer of no bytes."""
    per_byte_s: float
    """Inverse bandwidth (0 when every sample had the same size: bandwidth unknown)."""

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes * self.per_byte_s


@dataclass(slots=True)
class Rates:
    min_samples: int = 5
    window: int = 64
    _by_worker: dict[str, Ewma] = field(default_factory=dict)
    _by_kind: dict[str, Ewma] = field(default_factory=dict)
    _pool: Ewma = field(default_factory=Ewma)
    _transfers: deque[tuple[float, float]] = field(default_factory=deque)
    _fitted: tuple[TransferModel | None] | None = None
    """`transfer_model`'s answer since the last transfer (None: not fitted since): admission
    and placement ask it for every request, a fit costs a pass over the window."""

    def prefill(self, worker_id: str, gpu_kind: str, tokens: int, seconds: float) -> None:
        """One prefill of ``tokens`` took ``seconds`` of engine time on ``worker_id``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        for ewma in (
            self._by_worker.setdefault(worker_id, Ewma()),
            self._by_kind.setdefault(gpu_kind, Ewma()),
            self._pool,
        ):
            ewma.add(rate)

    def prefill_rate(self, worker_id: str, gpu_kind: str) -> float | None:
        """Tokens per second a prefill on this worker is expected to run at."""
        for ewma in (self._by_worker.get(worker_id), self._by_kind.get(gpu_kind), self._pool):
            if ewma is not None and ewma.samples >= self.min_samples:
                return ewma.value
        return None

    def transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds < 0:
            return
        self._transfers.append((float(nbytes), seconds))
        while len(self._transfers) > self.window:
            self._transfers.popleft()
        self._fitted = None

    def transfer_model(self) -> TransferModel | None:
        """The least-squares line through the recent transfers (``None`` before enough);
        fitted once per change of the window."""
        if self._fitted is None:
            self._fitted = (self._fit(),)
        return self._fitted[0]

    def _fit(self) -> TransferModel | None:
        n = len(self._transfers)
        if n < self.min_samples:
            return None
        mx = sum(x for x, _ in self._transfers) / n
        my = sum(y for _, y in self._transfers) / n
        sxx = sxy = 0.0
        for x, y in self._transfers:
            sxx += (x - mx) ** 2
            sxy += (x - mx) * (y - my)
        if sxx <= 0:  # every transfer the same size: the mean is all we know
            return TransferModel(fixed_s=my, per_byte_s=0.0)
        slope = max(sxy / sxx, 0.0)  # noise can tilt it below zero; bytes never make it faster
        return TransferModel(fixed_s=max(0.0, my - slope * mx), per_byte_s=slope)
