"""How vLLM's CPU build is told to place its compute threads. Pure constants; no vLLM import.

vLLM's CPU build binds its OpenMP compute threads to cores and keeps some cores free of
them: one for its scheduler and front end, and one more whenever a KV connector is
configured ("for nixl_connector"). On a 2-core machine that asks for both cores, which it
cannot honour, so it falls back to reserving none: two OpenMP threads bound to both cores,
spin-waiting against the worker's own front end, the orchestrator and the client. pdorch's
connector moves KV from vLLM's worker thread and needs no core of its own, so its workers
reserve one, as plain ``vllm serve`` does (figures: README 'vLLM workers'). The CUDA build
ignores the variable.
"""

from __future__ import annotations

RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
RESERVED_CPUS = "1"


def reserved_cpus_env() -> dict[str, str]:
    """The environment entry a vLLM engine is started with (unless the caller's own
    environment already sets it)."""
    return {RESERVED_CPUS_ENV: RESERVED_CPUS}
