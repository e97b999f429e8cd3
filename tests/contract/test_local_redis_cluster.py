"""`LocalRedisCluster` below 3 primaries: joined by hand (``redis-cli --cluster create``
refuses fewer), every slot served, keys of every node reachable through ``redis+cluster://``.
What `pdorch bench control-plane --redis-shards 1|2` starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.store.connect import sync_client
from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.server import RedisServerError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("primaries", [1, 2])
def test_a_small_cluster_serves_every_slot(tmp_path: Path, primaries: int) -> None:
    with LocalRedisCluster(tmp_path, primaries=primaries) as cluster:
        assert set(cluster.roles().values()) == {"master"}
        assert len(cluster.roles()) == primaries
        client = sync_client(cluster.url, 2.0)
        try:
            keys = [f"k{{{i}}}" for i in range(32)]  # hash tags over both halves of the slots
            for key in keys:
                client.set(key, key)
            assert [client.get(k) for k in keys] == keys
        finally:
            client.close()


def test_replicas_need_three_primaries(tmp_path: Path) -> None:
    with pytest.raises(RedisServerError, match="at least 3 primaries"):
        LocalRedisCluster(tmp_path, primaries=2, replicas=1)
