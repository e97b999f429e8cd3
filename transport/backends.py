"""Build a backend by name (for the CLI, the benchmark and the conformance suite); the names,
and which receiver takes which sender, are in `transport.backend_names`."""

from __future__ import annotations

import dataclasses

from transport.backend_names import BACKENDS, TCP, UCX, UCX_READ, Backend, needs_ucx
from transport.base import DataPlane, TransportSettings
from transport.receiver import KvReceiver
from transport.security import LinkTls
from transport.sender import KvSender
from transport.tcp import TcpDataPlane
from transport.ucx import UcxConfig, UcxDataPlane
from transport.wire import ModelSpec

__all__ = ["BACKENDS", "UCX_READ", "Backend", "make_data_plane", "make_receiver", "make_sender"]


def make_data_plane(backend: str, ucx: UcxConfig | None = None) -> DataPlane:
    """``backend``'s data plane (``ucx``: ``ucx`` options, one-sided for ``ucx-read``)."""
    if backend == TCP:
        return TcpDataPlane()
    if needs_ucx(backend):
        config = ucx or UcxConfig()
        if backend == UCX_READ and not config.one_sided:
            config = dataclasses.replace(config, one_sided=True)
        return UcxDataPlane(config)
    raise ValueError(f"unknown transport backend {backend!r} (choose from {', '.join(BACKENDS)})")


def make_sender(
    backend: str,
    settings: TransportSettings | None = None,
    ucx: UcxConfig | None = None,
    tls: LinkTls | None = None,
) -> KvSender:
    return KvSender(make_data_plane(backend, ucx), settings or TransportSettings(), tls)


def make_receiver(
    backend: str,
    settings: TransportSettings | None = None,
    model: ModelSpec | None = None,
    ucx: UcxConfig | None = None,
    tls: LinkTls | None = None,
) -> KvReceiver:
    """A UCX receiver takes either UCX sender, as each sender opens it: ``ucx-read``'s is
    ``ucx``'s (`transport.backend_names.receiver_takes`)."""
    if needs_ucx(backend):
        backend = UCX
    return KvReceiver(make_data_plane(backend, ucx), settings or TransportSettings(), model, tls)
