"""`pdorch migrate`: move a service's OpenAI traffic onto pdorch, watched and reversible.

A proxy with the OpenAI API sits between the clients and two upstreams, the *existing*
service and *pdorch*. In **shadow** mode every client gets the existing service's answer and a
sampled share of requests is also sent to pdorch in the background (outputs, latency and cost
compared); in **canary** mode a share of requests is answered by pdorch, and the share falls
back to 0 by itself when pdorch's error rate or TTFT/TPOT p99 over a window break the limits.
State (mode, share, rollbacks, window stats, bounded per-request samples) lives in Redis;
``pdorch migrate status`` and ``report`` read it.

Pure: `settings`, `policy` (routing, sampling, window statistics, the rollback rule),
`agreement`, `sse` (reading OpenAI answers), `report` (summary and rendering). I/O: `state`
(Redis), `proxy` (the HTTP front and upstream calls), `plots` (matplotlib), `service`
(what the CLI calls).
"""
