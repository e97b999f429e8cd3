"""The loopback TCP fault proxy, against a real echo server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from orchestrator.chaos.proxy import FaultProxy


async def _echo_server() -> tuple[asyncio.Server, str]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _roundtrip(address: str, payload: bytes) -> tuple[bytes, float]:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        started = time.monotonic()
        writer.write(payload)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
        return got, time.monotonic() - started
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def test_forwards_faithfully_then_delays_corrupts_and_paces() -> None:
    async def main() -> None:
        server, target = await _echo_server()
        proxy = FaultProxy("t", target, seed=3)
        address = await proxy.start()
        payload = bytes(range(256)) * 64  # 16 KiB
        try:
            got, fast = await _roundtrip(address, payload)
            assert got == payload

            proxy.faults.delay_s = 0.2  # each direction: >= 0.4 s round trip
            got, slow = await _roundtrip(address, payload)
            assert got == payload
            assert slow >= 0.4 > fast

            proxy.faults.clear()
            proxy.faults.corrupt_p = 1.0
            got, _ = await _roundtrip(address, payload)
            assert got != payload
            assert sum(a != b for a, b in zip(got, payload, strict=True)) >= 1
            assert proxy.corrupted >= 1

            proxy.faults.clear()
            proxy.faults.bytes_per_s = 64 * 1024  # 16 KiB each way: >= ~0.25 s each
            got, paced = await _roundtrip(address, payload)
            assert got == payload
            assert paced >= 0.4
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_drop_resets_open_connections_and_new_ones_still_work() -> None:
    async def main() -> None:
        server, target = await _echo_server()
        proxy = FaultProxy("t", target)
        address = await proxy.start()
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"ping")
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
            assert proxy.drop() == 1
            # the reset reaches the client: its read ends (EOF or reset), nothing comes back
            try:
                got = await asyncio.wait_for(reader.read(100), 5)
            except ConnectionError:
                got = b""
            assert got == b""
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            got, _ = await _roundtrip(address, b"after the drop")
            assert got == b"after the drop"
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_target_down_means_link_down_and_retarget_moves_it() -> None:
    async def main() -> None:
        server, target = await _echo_server()
        proxy = FaultProxy("t", "127.0.0.1:1")  # nothing listens on port 1
        address = await proxy.start()
        try:
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await _roundtrip(address, b"x")
            proxy.retarget(target)  # the process behind it restarted elsewhere
            got, _ = await _roundtrip(address, b"moved")
            assert got == b"moved"
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_drop_resets_a_connection_still_connecting_to_its_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection whose upstream connect is slow (the proxy's loop held back, a full
    backlog) is dropped too, and its upstream side aborted once it connects."""

    async def main() -> None:
        server, target = await _echo_server()
        gate = asyncio.Event()
        real = asyncio.open_connection

        async def slow(*args: object, **kwargs: object) -> object:
            await gate.wait()
            return await real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(asyncio, "open_connection", slow)
        proxy = FaultProxy("t", target, seed=1)
        address = await proxy.start()
        host, _, port = address.rpartition(":")
        reader, writer = await real(host, int(port))
        try:
            for _ in range(100):  # until the proxy's handler waits on its target
                if proxy._connecting:
                    break
                await asyncio.sleep(0.01)
            assert proxy.drop() == 1
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(1), 2) == b""
            gate.set()
            for _ in range(100):  # the handler aborts the late upstream side and ends
                if not proxy._conns:
                    break
                await asyncio.sleep(0.01)
            assert not proxy._conns
            assert not proxy._writers
            assert not proxy._connecting
        finally:
            writer.close()
            await proxy.close()
            server.close()

    asyncio.run(main())
