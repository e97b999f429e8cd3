"""The OpenAI-compatible HTTP gateway: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` and ``/health`` in front of `orchestrator.control`, as `orchestrator.rpc` is.

    settings.py   GatewaySettings (frozen; filled in by the CLI)
    errors.py     ApiError and the one table from orchestrator errors to HTTP statuses
    parse.py      PURE: OpenAI request JSON → `Call` (a `GenerateInput` and how to answer)
    render.py     PURE: `OutChunk`s → OpenAI JSON objects and server-sent events
    app.py        the Starlette application (routes, auth, streaming), over a `Backend`
    backend.py    the `Backend` on a `control.Orchestrator` in this process
    server.py     uvicorn on a socket we bind, started and stopped as a named task
"""
