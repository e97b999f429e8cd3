"""A KV sender's HELLO carries its UCX worker address, which the receiver hands to libucp to
reach it — and libucp *asserts* on an address version it does not know, aborting the
process (every stream on the worker with it). A junk address fails that transfer alone:
refused before UCX sees it (`ucx.check_worker_address`), or reported by libucp as an
error; the receiver lives on and moves the next KV. The sender leaves no task whose
failure nobody reads."""

from __future__ import annotations

import asyncio
import gc
import random
from typing import Any

import pytest

from transport import control, errors, testing
from transport import sender as sender_module
from transport.backends import make_sender
from transport.base import TransportSettings
from transport.ucx import ADDRESS_MIN_BYTES, check_worker_address, ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]

OURS = bytes([0x20]) + bytes(range(1, 64))
"""A worker address's shape: format version 0 in the header's low bits, flags above."""


def test_an_address_of_another_format_version_or_too_short_is_refused() -> None:
    check_worker_address(bytes([0x30]) + OURS[1:], OURS)  # other flags, same version: fine
    for junk, why in (
        (b"\x0f" * 16, "format version 15, this UCX's is 0"),
        (bytes([0x21]) + OURS[1:], "format version 1"),
        (OURS[: ADDRESS_MIN_BYTES - 1], "8 bytes, not a UCX worker address"),
    ):
        with pytest.raises(errors.PeerLostError, match=why):
            check_worker_address(junk, OURS)


async def _send_with_address(address: str, junk: bytes, rid: str) -> BaseException | None:
    real = control.hello
    sender_module.control.hello = lambda instance, _: real(instance, junk)  # type: ignore[attr-defined]
    sender = make_sender("ucx", TransportSettings())
    try:
        # Past the 4 MiB eager bound: the receiver makes a UCX endpoint to the sender.
        await sender.send(address, testing.synthetic_cache(rid, 1, 8 << 20, n_layers=4))
    except errors.TransportError as exc:
        return exc
    finally:
        sender_module.control.hello = real  # type: ignore[attr-defined]
        await sender.close()
    return None


@pytest.mark.slow  # a receiver process: an abort must not take the test with it
def test_junk_worker_addresses_fail_their_transfer_and_the_receiver_lives_on() -> None:
    rnd = random.Random(7)
    junks = [b"\x0f" * 16, b"\x00" * 16]
    junks += [b"\x20" + rnd.randbytes(rnd.randint(8, 300)) for _ in range(12)]
    unretrieved: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx))
        async with testing.peer("ucx", TransportSettings()) as p:
            address = (await p.call(op="listen"))["address"]
            for i, junk in enumerate(junks):
                failed = await _send_with_address(address, junk, f"junk-{i}")
                assert failed is not None, junk[:8]
                assert p.proc.returncode is None, f"the receiver died on {junk[:8]!r}"
            sender = make_sender("ucx", TransportSettings())
            cache = testing.synthetic_cache("fine", 1, 8 << 20, n_layers=4)
            try:
                await sender.send(address, cache)
            finally:
                await sender.close()
            got = await p.call(op="take", rid="fine", epoch=1, timeout=30)
            assert got == {"ok": True, "digest": testing.digest(cache), "nbytes": cache.nbytes}
            gc.collect()
            await asyncio.sleep(0.2)

    asyncio.run(main())
    assert [c.get("message") for c in unretrieved] == []
