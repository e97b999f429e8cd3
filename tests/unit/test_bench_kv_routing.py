"""The KV-routing benchmark's pure parts: the multi-turn workload and the summary."""

from __future__ import annotations

from dataclasses import replace

from orchestrator.bench.kv_routing import (
    ChatBench,
    Sample,
    chat_workload,
    format_result,
    replay,
    summarize,
)


def test_workload_shares_the_system_prompt_and_is_reproducible() -> None:
    b = ChatBench(conversations=3, turns=2, system_tokens=32, user_tokens=8, one_shot=2)
    system, chats, one_shots = chat_workload(b)
    assert len(system) == 32
    assert [len(c) for c in chats] == [2, 2, 2]
    assert all(len(m) == 8 for c in chats for m in c)
    assert [len(p) for p in one_shots] == [40, 40]
    assert chat_workload(b) == (system, chats, one_shots)
    assert chat_workload(ChatBench(seed=1, system_tokens=32))[0] != system


def test_replay_counts_what_each_prefill_worker_computed() -> None:
    system = tuple(range(100, 132))  # 2 blocks of 16
    turn1 = (*system, *range(500, 516))  # + 1 block
    turn2 = (*turn1, *range(600, 616))
    s = Sample(1.0, 0.0, 0, 0.0, "", "p1", turn1)
    got = replay([s, replace(s, prompt=turn2), replace(s, prefill_worker="p2", prompt=turn2)])
    # p1: all of turn 1; then only turn 2's new block; p2 never saw any of it
    assert [g.computed for g in got] == [48, 16, 64]


def test_summary_and_table() -> None:
    samples = [
        Sample(
            10.0,
            0.002,
            100,
            0.001,
            "both pools up; prefill reuses 16/20 cached tokens",
            "p1",
            tuple(range(20)),
        ),
        Sample(30.0, 0.004, 300, 0.003, "both pools up", "p1", tuple(range(20))),
    ]
    s = summarize(samples)
    assert s["ttft_p50_ms"] == 10.0
    assert s["ttft_p99_ms"] == 30.0
    assert s["prefill_gpu_ms_per_request"] == 3.0
    assert s["kv_bytes_per_request"] == 200
    assert s["routed_to_a_cached_prefix"] == 0.5
    assert s["prefill_tokens_computed_per_request"] == (20 + 4) / 2  # 16 cached the 2nd time
    assert s["kv_suffix_only"] == 0.0
    table = format_result(
        {
            "off": s,
            "on": s,
            "suffix": summarize(
                [replace(samples[0], placement="x; KV suffix only: 4/20 tokens sent")]
            ),
        }
    )
    assert "routing off" in table
    assert "+ suffix KV" in table
    assert "50%" in table
    assert "100%" in table.splitlines()[-1]  # KV sent as a suffix only
