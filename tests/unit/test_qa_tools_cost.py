"""`pdorch cost`: a tenant whose requests cost something is not shown as costing 0."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.cli import cost, main
from orchestrator.store.redis_store import RedisStore

# three tiny-model requests on CPU workers ($0.10/h): 4.3e-7 USD in all
TOTALS = {
    "team-a": {
        "requests": 3.0,
        "usd": 4.312e-07,
        "prefill_gpu_s": 0.002,
        "decode_gpu_s": 0.0135,
        "aggregated_gpu_s": 0.0,
        "transfer_bytes": 39936.0,
        "prefill_reused_tokens": 0.0,
        "reuse_saved_usd": 0.0,
    },
    "big": {"requests": 7.0, "usd": 0.00239},
}


def test_a_cost_below_the_table_s_decimals_shows_its_digits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def tenant_costs(self: Any) -> dict[str, dict[str, float]]:
        return TOTALS

    monkeypatch.setattr(cost, "check_redis", lambda url: None)
    monkeypatch.setattr(RedisStore, "tenant_costs", tenant_costs)
    assert main(["cost", "--redis", "redis://127.0.0.1:1/0"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["team-a"][2] == "4.31e-07"  # USD, not 0.000000
    assert rows["team-a"][3] == "0.000144"  # USD per 1k requests, not 0.0001
    assert rows["team-a"][-1] == "0.000000"  # nothing saved is 0
    assert rows["big"][2:4] == ["0.002390", "0.3414"]  # as before where the decimals suffice
