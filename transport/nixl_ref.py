"""NIXL as a reference for `pdorch bench transport` (optional: ``make nixl`` installs
``nixl-cu12`` without its CUDA dependencies; absent, the bench leaves NIXL out).

NIXL is the library vLLM and Dynamo move KV with. Measured the way it is used: two agents
in two processes (the target registers a buffer, the initiator reads from or writes into
it), each transfer timed from before its descriptor lists are prepared until both sides
know it is done — the initiator saw DONE and the target its notification (relayed over a
pipe, as our receiver's DONE crosses a socket). Buffers are numpy arrays on both sides, as
ours are: equal huge-page treatment (≥ 4 MiB arrays get transparent huge pages here).

The agents live only for one measurement: NIXL's Python API hard-codes its progress
thread's delay to 0, a core spinning per agent, which would slow whatever runs beside it.
Addresses and metadata travel as JSON/hex between our own two processes (no pickle).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from transport import ucx_env

_MODULE = "nixl_cu12"


def nixl_available() -> bool:
    return importlib.util.find_spec(_MODULE) is not None


def measure(size: int, iters: int, op: str, descs: int, timeout_s: float = 120.0) -> float:
    """Median seconds per transfer of ``size`` bytes as ``descs`` descriptors (READ or
    WRITE), over ``iters`` transfers after one warm-up. Raises RuntimeError on failure."""
    args = ["initiator", str(size), str(iters), op, str(descs)]
    out = subprocess.run(
        [sys.executable, "-m", "transport.nixl_ref", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=ucx_env.for_child(),  # not our ucxx's UCX defaults: NIXL as it runs on its own
    )
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["median_s"])
    raise RuntimeError(f"NIXL reference failed: {out.stderr[-500:]}")


def _agent(name: str) -> Any:
    api = importlib.import_module(f"{_MODULE}._api")
    # No progress thread: NIXL's spins a core (its delay is hard-coded to 0); our loops
    # below progress it (check_xfer_state, get_new_notifs) while they wait.
    config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return api.nixl_agent(name, config)


def _buffer(size: int) -> Any:
    import numpy as np  # noqa: PLC0415 - the bench process imports it anyway

    buf = np.ones(size, dtype=np.uint8)  # touched: no page faults inside the timing
    return buf, int(buf.ctypes.data)


def _target(size: int, expected: int) -> None:
    agent = _agent("pdorch-nixl-target")
    buf, addr = _buffer(size)
    agent.register_memory([(addr, size, 0, "")], "DRAM")
    meta = agent.get_agent_metadata()
    print(json.dumps({"meta": meta.hex(), "addr": addr}), flush=True)
    seen = 0
    while seen < expected:
        for notes in agent.get_new_notifs().values():
            for _ in notes:
                seen += 1
                print("n", flush=True)
    del buf


def _initiator(size: int, iters: int, op: str, descs: int) -> None:
    import numpy as np  # noqa: PLC0415

    target = subprocess.Popen(
        [sys.executable, "-m", "transport.nixl_ref", "target", str(size), str(iters + 1)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert target.stdout is not None
    try:
        while not (line := target.stdout.readline()).startswith("{"):
            if not line:
                raise RuntimeError("NIXL target exited")
        hello = json.loads(line)
        agent = _agent("pdorch-nixl-initiator")
        buf, addr = _buffer(size)
        agent.register_memory([(addr, size, 0, "")], "DRAM")
        remote = agent.add_remote_agent(bytes.fromhex(hello["meta"]))
        step = size // descs
        offsets = [i * step for i in range(descs)]
        lengths = [step] * (descs - 1) + [size - step * (descs - 1)]
        local = np.array([(addr + o, n, 0) for o, n in zip(offsets, lengths, strict=True)])
        far = np.array([(hello["addr"] + o, n, 0) for o, n in zip(offsets, lengths, strict=True)])
        times: list[float] = []
        for i in range(iters + 1):
            started = time.perf_counter()
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(far, "DRAM"),
                remote,
                b"done",
            )
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer {state}")
            if target.stdout.readline().strip() != "n":
                raise RuntimeError("NIXL target saw no notification")
            elapsed = time.perf_counter() - started
            agent.release_xfer_handle(handle)
            if i:  # the first one connects
                times.append(elapsed)
        print(json.dumps({"median_s": statistics.median(times)}), flush=True)
        del buf
    finally:
        target.kill()
        target.wait()


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "target":
        _target(int(rest[0]), int(rest[1]))
    else:
        _initiator(int(rest[0]), int(rest[1]), rest[2], int(rest[3]))
