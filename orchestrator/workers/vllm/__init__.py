"""vLLM hosted behind pdorch's worker API, with pdorch's own KV connector.

Modules prefixed ``kv``/``connector`` are the KV connector side: ``kv`` is what the pdorch
worker process imports (no vLLM import at module level), ``kv_layout`` and ``kv_params`` are
pure, ``connector*`` run inside vLLM's engine-core/worker processes and import vLLM and torch.
"""
