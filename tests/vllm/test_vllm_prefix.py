"""KV-aware routing against real vLLM: pdorch's block hashes are vLLM's, and a vLLM host's
heartbeat report (from vLLM's KV cache events over ZMQ) names the prompt's blocks.

Runs in the ``vllm`` extra's environment; vLLM is imported inside the tests (this module
is collected without it too). The engine test starts one ``AsyncLLM`` (~20-40 s here).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from orchestrator.core.prefix import PrefixIndex, block_digests, block_keys, decode_keys
from tests.vllm.conftest import model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_block_digests_equal_vllms_sha256_cbor_hashes() -> None:
    """In a fresh process without PYTHONHASHSEED: vLLM's NONE_HASH is its fixed default."""
    ids = list(range(1000, 1050))
    code = textwrap.dedent(
        f"""
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils as u
        u.init_none_hash(sha256_cbor)
        ids, parent, out = {ids!r}, None, []
        for i in range(0, len(ids) - 15, 16):
            parent = u.hash_block_tokens(sha256_cbor, parent, ids[i:i + 16], None)
            out.append(bytes(parent).hex())
        print(",".join(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    got = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env,
        timeout=300,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    assert got.split(",") == [d.hex() for d in block_digests(ids, 16)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch/vLLM's, at import
# vLLM's engine client leaves its own zmq context to the GC (ours is closed: asserted below)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_vllm_host_reports_the_blocks_it_cached() -> None:
    asyncio.run(_host_reports())


async def _host_reports() -> None:
    from vllm import SamplingParams, TokensPrompt  # noqa: PLC0415

    from orchestrator.workers.vllm.engine import VllmHost, VllmSettings  # noqa: PLC0415

    host = VllmHost(VllmSettings(model_dir(), role="aggregated", kv_cache_bytes=256 << 20))
    await host.start("127.0.0.1", 0)
    feed = host._events
    assert feed is not None
    try:
        size, _ = host.kv_prefix()
        assert size > 0
        prompt = [(7 * i) % 5000 + 10 for i in range(4 * size + 3)]  # 4 full blocks
        gen = host._llm.generate(  # the engine itself: no gRPC needed
            TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=2), "r1"
        )
        async for _ in gen:
            pass
        want = block_keys(prompt, size)
        deadline = time.monotonic() + 30
        while not set(want) <= set(decode_keys(host.kv_prefix()[1])):
            assert time.monotonic() < deadline, "vLLM's stored blocks never reached the report"
            await asyncio.sleep(0.1)
        index = PrefixIndex()
        index.sync({"w": host.kv_prefix()})
        turn2 = [*prompt, 11, 12, 13, *range(20, 20 + size)]
        assert index.match({size: block_keys(turn2, size)})["w"].blocks == 4
    finally:
        await host.close()
    assert feed.closed
