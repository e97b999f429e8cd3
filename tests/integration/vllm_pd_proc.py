"""One vLLM engine with pdorch's connector, driven over stdin/stdout (JSON lines).

Used by ``test_vllm_connector.py`` (run with the vLLM venv's python). Roles: ``prefill``
(commands ``prefill`` and ``generate``: plain aggregated generation, the reference) and
``decode`` (command ``decode``). The decode role hosts its `DecodeKvControl` on a loop thread
and prints the KV address first. Every reply is one line ``{"ok": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--hold-s", type=float, default=30.0)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    # Imported after the environment is set (vLLM reads it at import).
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from orchestrator.workers.vllm import kv  # noqa: PLC0415
    from orchestrator.workers.vllm.kv_loop import LoopThread  # noqa: PLC0415

    control = None
    loop = LoopThread("test-kv-control")
    if args.role == "decode":
        control = kv.DecodeKvControl()
        loop.start()
        started = loop.submit(control.start(600))
    cfg = kv.connector_config(
        args.role,
        backend=args.backend,
        kv_address="127.0.0.1:0",
        fingerprint="smollm2-test",
        hold_s=args.hold_s,
        timeout_s=args.timeout_s,
        control_path=control.control_path if control else None,
    )
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(**cfg),
    )
    hello: dict[str, Any] = {"ok": True, "role": args.role}
    if control is not None:
        hello["kv_address"] = started.result(60)
    _reply(hello)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        t0 = time.perf_counter()
        if op == "quit":
            break
        if op == "held":
            assert control is not None
            _reply({"ok": True, "held_bytes": control.held_bytes()})
            continue
        if op == "release":
            assert control is not None
            released = loop.submit(control.release(cmd["request_id"], cmd["epoch"])).result(10)
            _reply({"ok": True, "released": released})
            continue
        extra: dict[str, Any] = {}
        max_tokens = int(cmd.get("max_tokens", 1))
        if op == "prefill":
            params = kv.prefill_params(
                cmd["request_id"], cmd["epoch"], cmd["target"], cmd.get("kv_dtype", "")
            )
            extra = {"kv_transfer_params": params}
            max_tokens = 1
        elif op == "decode":
            extra = {
                "kv_transfer_params": kv.decode_params(
                    cmd["request_id"], cmd["epoch"], len(cmd["ids"]) - 1
                )
            }
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra or None)
        try:
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=cmd["ids"])], sp, use_tqdm=False)
        except Exception as exc:  # an errored request may surface as an exception
            _reply({"ok": False, "error": repr(exc), "s": time.perf_counter() - t0})
            continue
        comp = out.outputs[0]
        reply: dict[str, Any] = {
            "ok": True,
            "tokens": list(comp.token_ids),
            "finish_reason": comp.finish_reason,
            "s": time.perf_counter() - t0,
        }
        if op == "prefill":
            result = kv.prefill_result(out.kv_transfer_params)
            reply["transfer"] = result.to_dict()
        _reply(reply)
    if control is not None:
        loop.stop(control.close())


def _reply(msg: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
