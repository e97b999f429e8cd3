"""Pick a backend by name (for the CLI, the benchmark and the conformance suite)."""

from __future__ import annotations

from typing import Literal

from transport.base import TransportSettings
from transport.receiver import KvReceiver
from transport.security import LinkTls
from transport.sender import KvSender
from transport.tcp import tcp_receiver, tcp_sender
from transport.ucx import UcxConfig, ucx_receiver, ucx_sender
from transport.wire import ModelSpec

Backend = Literal["ucx", "tcp"]
BACKENDS: tuple[Backend, ...] = ("ucx", "tcp")
UCX_READ = "ucx-read"
"""Not offered on the command line yet: UCX with one-sided reads (transport v2,
``UcxConfig(one_sided=True)``), for the benchmark and the conformance suite."""


def make_sender(
    backend: str,
    settings: TransportSettings | None = None,
    ucx: UcxConfig | None = None,
    tls: LinkTls | None = None,
) -> KvSender:
    if backend == "ucx":
        return ucx_sender(settings, ucx, tls)
    if backend == UCX_READ:
        return ucx_sender(settings, UcxConfig(one_sided=True), tls)
    if backend == "tcp":
        return tcp_sender(settings, tls)
    raise ValueError(f"unknown transport backend {backend!r} (choose from {BACKENDS})")


def make_receiver(
    backend: str,
    settings: TransportSettings | None = None,
    model: ModelSpec | None = None,
    ucx: UcxConfig | None = None,
    tls: LinkTls | None = None,
) -> KvReceiver:
    if backend in ("ucx", UCX_READ):  # a UCX receiver takes either, as the sender opens it
        return ucx_receiver(settings, model, ucx, tls)
    if backend == "tcp":
        return tcp_receiver(settings, model, tls)
    raise ValueError(f"unknown transport backend {backend!r} (choose from {BACKENDS})")
