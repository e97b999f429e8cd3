"""The KV-routing benchmark's pure parts: the multi-turn workload and the summary."""

from __future__ import annotations

from orchestrator.bench.kv_routing import ChatBench, Sample, chat_workload, format_result, summarize


def test_workload_shares_the_system_prompt_and_is_reproducible() -> None:
    b = ChatBench(conversations=3, turns=2, system_tokens=32, user_tokens=8, one_shot=2)
    system, chats, one_shots = chat_workload(b)
    assert len(system) == 32
    assert [len(c) for c in chats] == [2, 2, 2]
    assert all(len(m) == 8 for c in chats for m in c)
    assert [len(p) for p in one_shots] == [40, 40]
    assert chat_workload(b) == (system, chats, one_shots)
    assert chat_workload(ChatBench(seed=1, system_tokens=32))[0] != system


def test_summary_and_table() -> None:
    samples = [
        Sample(10.0, 0.002, 100, 0.001, "both pools up; prefill reuses 16/20 cached tokens"),
        Sample(30.0, 0.004, 300, 0.003, "both pools up"),
    ]
    s = summarize(samples)
    assert s["ttft_p50_ms"] == 10.0
    assert s["ttft_p99_ms"] == 30.0
    assert s["prefill_gpu_ms_per_request"] == 3.0
    assert s["kv_bytes_per_request"] == 200
    assert s["routed_to_a_cached_prefix"] == 0.5
    table = format_result({"off": s, "on": s})
    assert "routing off" in table
    assert "50%" in table
