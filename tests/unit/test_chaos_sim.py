"""Chaos scenarios on simulated prefix-cache workers (``engine: sim``) with prompts sharing
an opening (``shared_prefix_words``): what routing and suffix-only transfer act on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.workload import make_requests
from orchestrator.cluster import SIM_WORKER, LocalCluster
from orchestrator.workers.sim_engine import SIM_MAX_CONTEXT


def _doc(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "s",
        "cluster": {"engine": "sim", "transport": "tcp"},
        "workload": {"requests": 4, "shared_prefix_words": 40, "output_tokens": [10, 20]},
        "faults": [{"at": 1.0, "kind": "kill", "target": "decode:busiest"}],
        "duration_s": 5,
    }
    doc.update(over)
    return doc


def test_a_sim_scenario_parses_and_its_prompts_share_an_opening() -> None:
    s = sc.parse(_doc())
    assert (s.cluster.engine, s.workload.shared_prefix_words) == ("sim", 40)
    plans = make_requests(s.workload, seed=3)
    openings = {" ".join(p.prompt.split()[:40]) for p in plans}
    assert len(openings) == 1
    assert openings == {" ".join(p.prompt.split()[:40]) for p in make_requests(s.workload, 4)}
    # Without a shared opening the draws are what they always were.
    plain = sc.parse(_doc(workload={"requests": 4, "output_tokens": [10, 20]}))
    assert [p.prompt for p in make_requests(plain.workload, 3)] == [
        " ".join(p.prompt.split()[40:]) for p in plans
    ]
    assert sc.MODEL_CONTEXT[("tiny", "sim")] == SIM_MAX_CONTEXT


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (
            {
                "faults": [
                    {"at": 1.0, "kind": "delay", "target": "link:kv", "params": {"delay_ms": 5}}
                ]
            },
            "process faults only",
        ),
        ({"cluster": {"engine": "sim", "model": "smollm2"}}, "leave model at tiny"),
    ],
)
def test_what_a_sim_scenario_refuses(over: dict[str, Any], match: str) -> None:
    with pytest.raises(sc.ScenarioError, match=match):
        sc.parse(_doc(**over))


def test_sim_workers_are_started_with_a_prefix_cache(tmp_path: Path) -> None:
    c = LocalCluster(engine="sim", transport="tcp", workdir=tmp_path)
    args = c.worker_args("decode", 1)
    assert args[args.index("--sim") + 1] == SIM_WORKER
    assert "--sim-prefix-cache" in args
    assert args[args.index("--worker-id") + 1] == "decode-1"
    assert "--model" not in args
