"""Pick a backend by name (for the CLI, the benchmark and the conformance suite)."""

from __future__ import annotations

from typing import Literal

from transport.base import TransportSettings
from transport.receiver import KvReceiver
from transport.sender import KvSender
from transport.tcp import tcp_receiver, tcp_sender
from transport.ucx import UcxConfig, ucx_receiver, ucx_sender
from transport.wire import ModelSpec

Backend = Literal["ucx", "tcp"]
BACKENDS: tuple[Backend, ...] = ("ucx", "tcp")
UCX_TAG = "ucx-tag"
"""Not offered to users: transport v1's UCX tag-message path, kept selectable for the
benchmark's before/after and covered by the conformance suite while it exists."""


def make_sender(
    backend: str, settings: TransportSettings | None = None, ucx: UcxConfig | None = None
) -> KvSender:
    if backend == "ucx":
        return ucx_sender(settings, ucx)
    if backend == UCX_TAG:
        return ucx_sender(settings, UcxConfig(one_sided=False))
    if backend == "tcp":
        return tcp_sender(settings)
    raise ValueError(f"unknown transport backend {backend!r} (choose from {BACKENDS})")


def make_receiver(
    backend: str,
    settings: TransportSettings | None = None,
    model: ModelSpec | None = None,
    ucx: UcxConfig | None = None,
) -> KvReceiver:
    if backend in ("ucx", UCX_TAG):  # a receiver takes either path, as the sender opens it
        return ucx_receiver(settings, model, ucx)
    if backend == "tcp":
        return tcp_receiver(settings, model)
    raise ValueError(f"unknown transport backend {backend!r} (choose from {BACKENDS})")
