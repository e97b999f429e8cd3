"""A whole local fleet (orchestrator, 1 prefill + 2 decode workers) on a 3-primary Redis
Cluster (``--redis redis+cluster://…``), a decode worker killed mid-stream (issue 21)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

import pytest

from orchestrator.cluster import LocalCluster
from orchestrator.core.state import State
from orchestrator.store.connect import sync_client
from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.keys import Keys
from orchestrator.store.redis_store import RedisStore, StoreSettings
from tests.integration.conftest import collect, request
from transport.ucx import ucx_available

pytestmark = [pytest.mark.slow, pytest.mark.failover, pytest.mark.timeout(300)]

REQUESTS = 4
TOKENS = 300


def _decoding(url: str) -> bool:
    """Whether a decode worker's heartbeat says it is decoding."""
    keys = Keys()
    with contextlib.closing(sync_client(url)) as client:
        for wid in client.smembers(keys.workers):
            raw = client.get(keys.worker(wid))
            if raw and json.loads(raw)["role"] == "decode" and json.loads(raw)["active"]:
                return True
    return False


def test_a_fleet_on_a_redis_cluster_survives_a_decode_worker_kill(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path / "redis") as redis_cluster:
        fleet = LocalCluster(
            model="tiny",
            transport="ucx" if ucx_available() else "tcp",
            prefill_workers=1,
            decode_workers=2,
            external_redis=redis_cluster.url,
            workdir=tmp_path,
        )
        with fleet:
            address = fleet.orchestrator_addresses[0]
            rids = [f"rc-{i}" for i in range(REQUESTS)]

            async def main() -> list[list[int]]:
                tasks = [
                    asyncio.create_task(
                        collect(address, request(f"c{i}", max_tokens=TOKENS, request_id=rid))
                    )
                    for i, rid in enumerate(rids)
                ]
                deadline = time.monotonic() + 60
                while not await asyncio.to_thread(_decoding, redis_cluster.url):
                    assert time.monotonic() < deadline, "decoding never started"
                    await asyncio.sleep(0.05)  # polling a condition while the requests run
                fleet.procs["decode-0"].signal(signal.SIGKILL)
                results = await asyncio.gather(*tasks)
                store = RedisStore(StoreSettings(url=redis_cluster.url))
                try:
                    for rid in rids:
                        got = await store.get(rid)
                        assert got is not None, rid
                        assert (got.state, got.output_tokens) == (State.DONE, TOKENS), rid
                        journal = await store.journal(rid)
                        assert sum(len(e.token_ids) for e in journal) == TOKENS, rid
                    assert await store.active() == []
                finally:
                    await store.close()
                for _ids, _text, chunks in results:  # contiguous from 0, no duplicate
                    starts = [c.index for c in chunks if c.token_ids]
                    lengths = [len(c.token_ids) for c in chunks if c.token_ids]
                    assert starts == [sum(lengths[:i]) for i in range(len(lengths))]
                return [r[0] for r in results]

            outputs = asyncio.run(main())
            assert all(len(o) == TOKENS for o in outputs)
        # The state really was spread over the cluster: every primary holds keys.
        sizes = []
        for node in redis_cluster.nodes:
            with contextlib.closing(sync_client(f"redis://127.0.0.1:{node.port}/0")) as client:
                sizes.append(client.dbsize())
        assert sum(1 for n in sizes if n > 0) >= 2, sizes
