"""`pdorch bench`: transport throughput, KV precision, the control plane at scale, and the
load generator it runs. Each reports ratios against a reference measured in the same run.

`bench control-plane` and `bench load` flags fill `ControlPlaneBench` and `LoadSpec`; their
defaults are those dataclasses' field defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli.common import (
    CommandError,
    Commands,
    Parents,
    add_command,
    client_tls,
    client_token,
    default,
    field_doc,
    non_negative_float,
    non_negative_int,
    positive_int,
    positive_ints,
    request_max_tokens,
    write_out,
)
from orchestrator.cli.orchestrator import ServerSettings
from transport.backend_names import BACKENDS

if TYPE_CHECKING:
    from orchestrator.bench.control_plane import ControlPlaneBench
    from orchestrator.bench.engine_batching import EngineBench
    from orchestrator.bench.load import LoadSpec
    from orchestrator.bench.side_by_side import ServingBench


NAME = "bench"
HELP = "benchmarks (ratios against a reference in the same run)"

_BENCH_HELP = {
    "workers": "simulated workers, both pools",
    "concurrency": "requests in flight at once",
    "requests": "requests measured",
    "orchestrators": "orchestrator replicas",
    "max_tokens": "output tokens per request",
    "prompt_words": "words per prompt",
    "prefill_gpu": "the simulated prefill workers' GPU kind",
    "decode_gpu": "the simulated decode workers' GPU kind",
}
"""Help for fields of the bench specs that carry no docstring."""


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    b = add_command(sub, NAME, parents, help=HELP)
    bsub = b.add_subparsers(dest="bench", required=True)
    _transport(add_command(
        bsub, "transport", parents, parents.json,
        help="KV transfer throughput vs ucx_perftest tag_bw",
    ))  # fmt: skip
    _precision(add_command(
        bsub, "precision", parents, parents.model, parents.model_cache, parents.json,
        help="token agreement with the KV converted for the wire (fp16/bf16/fp8) vs unchanged",
        description="Runs each prompt greedily twice in this process from one prefill: with "
        "the prompt's KV unchanged, and with it converted to --dtype and back (the wire "
        "encoding included). Reports agreement (matched prefix / length), the first "
        "divergence per prompt, and refuses to recommend a dtype (fp8) whose disagreement "
        "exceeds 1%. See README 'KV precision'.",
    ))  # fmt: skip
    _control_plane(add_command(
        bsub, "control-plane", parents, parents.json,
        help="the real orchestrator, Redis and gRPC against simulated workers",
        description="Starts Redis, simulated workers (pdorch worker --sim) and orchestrators, "
        "drives concurrent requests through gRPC and reports admitted req/s, orchestration "
        "overhead (client TTFT - worker TTFT) and CPU per request. See README 'Scale'.",
    ))  # fmt: skip
    _kv_routing(add_command(
        bsub, "kv-routing", parents, parents.json,
        help="multi-turn chat on simulated prefix-cache workers: KV-aware routing off, on, "
        "and on with suffix-only KV transfers",
        description="Runs one multi-turn chat workload (conversations sharing a system "
        "prompt, plus one-shot requests) on a fresh simulated cluster per mode: --kv-routing "
        "off; on with --kv-suffix off; on with --kv-suffix on. Reports prefill tokens "
        "computed, KV bytes moved, TTFT p50/p99, prefill GPU time and cost per request side "
        "by side. See README 'Admission and placement'.",
    ))  # fmt: skip
    _placement(add_command(
        bsub, "placement", parents, parents.json,
        help="admission and placement's CPU per request, by fleet size (in this process)",
        description="Runs the orchestrator's Ledger (admission's TTFT estimate and the "
        "placement of a prefill/decode pair) over synthetic fleets of each --workers size "
        "and reports CPU per request: the part of a request's fixed cost that grows with the "
        "fleet. No Redis, no gRPC. See README 'The token path'.",
    ))  # fmt: skip
    _load(add_command(
        bsub, "load", parents, parents.json, parents.client_tls,
        help="drive concurrent requests at running orchestrators",
    ))  # fmt: skip
    _engine(add_command(
        bsub, "engine", parents, parents.json,
        help="TTFT/TPOT of 1, 4, 8 concurrent streams on one worker (does it batch them?)",
        description="Starts Redis, an orchestrator and one worker of --engine (no prefill "
        "pool: every request aggregated on it), keeps C streams in flight for each C of "
        "--concurrency and reports TTFT, TPOT and engine time per token. See README 'vLLM "
        "workers'.",
    ))  # fmt: skip
    _serving(add_command(
        bsub, "serving", parents, parents.model, parents.model_cache, parents.json,
        help="one workload through vllm serve, pdorch (aggregated, P/D) and vLLM's own P/D",
        description="Runs the same requests (token-id prompts, greedy, streamed through "
        "one OpenAI-compatible client) through each of --systems in turn: plain `vllm "
        "serve`; vLLM behind pdorch on one aggregated worker; pdorch P/D with vLLM on both "
        "pools; vLLM's own P/D (NixlConnector + a proxy). Reports TTFT and TPOT p50/p99, "
        "throughput and KV transfer time per request for each, at each --concurrency. Run "
        "it from the vllm extra's environment. See README 'vLLM workers'.",
    ))  # fmt: skip


# ------------------------------------------------------------------------------ transport


def _transport(bt: argparse.ArgumentParser) -> None:
    bt.add_argument("--backend", choices=("ucx", "tcp"), default="ucx", help="the transport")
    bt.add_argument(
        "--size",
        default="1MiB,4MiB,16MiB,64MiB,256MiB",
        help="KV bytes per transfer, or a comma-separated list of sizes (e.g. 64MiB)",
    )
    bt.add_argument("--iters", type=positive_int, default=10, help="transfers per round")
    bt.add_argument("--layers", type=int, default=32, help="layers the KV is split into")
    bt.add_argument(
        "--rounds", type=int, default=5, help="alternations of ours/reference (medians compared)"
    )
    bt.add_argument(
        "--nixl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="NIXL as a reference in the same run (default: when nixl-cu12 is installed)",
    )
    bt.add_argument(
        "--tls-dir",
        default=None,
        help="also time ours with mutual TLS on the KV control link (ours-tls), alternating "
        "with plain; DIR holds ca.pem, pdorch-prefill.pem/.key and pdorch-decode.pem/.key",
    )
    bt.add_argument(
        "--only",
        default=None,
        help="time only these, comma-separated: ours, ours-tls, ours-32, ours-read, "
        "ours-read-32, ours-read-paged, nixl, ucx_perftest, memory (default: all; e.g. "
        "ours-read to compare "
        "two builds of one path between two processes)",
    )
    bt.set_defaults(call=_run_transport)


def _run_transport(args: argparse.Namespace) -> int:
    from transport import bench  # noqa: PLC0415

    try:
        sizes = [bench.parse_size(s) for s in args.size.split(",")]
        for size in sizes:
            result = bench.run(
                args.backend,
                size,
                args.iters,
                args.layers,
                args.rounds,
                args.nixl,
                tls_dir=args.tls_dir,
                only=None if args.only is None else args.only.split(","),
            )
            print(result.json() if args.json else result.human(), flush=True)
    except bench.BenchError as exc:
        print(f"pdorch bench transport: {exc}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------------------ precision


def _precision(bp: argparse.ArgumentParser) -> None:
    bp.add_argument(
        "--dtype", choices=("fp16", "bf16", "fp8"), default="fp8", help="KV wire dtype compared"
    )
    bp.add_argument("--prompts", default="", help="file: one prompt per line (default: 20)")
    bp.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per prompt")
    bp.set_defaults(call=_run_precision)


def _run_precision(args: argparse.Namespace) -> int:
    from orchestrator.bench.precision import prompts_from_text, render  # noqa: PLC0415
    from orchestrator.bench.precision_run import default_prompts, run_precision  # noqa: PLC0415
    from orchestrator.workers.model_files import load_engine  # noqa: PLC0415

    if args.prompts:
        try:
            prompts = prompts_from_text(Path(args.prompts).read_text())
        except OSError as exc:
            print(f"pdorch bench precision: --prompts: {exc}", file=sys.stderr)
            return 2
        if not prompts:
            print("pdorch bench precision: --prompts: no prompts in the file", file=sys.stderr)
            return 2
    else:
        prompts = default_prompts()
    engine = load_engine(args.model, Path(args.model_cache) if args.model_cache else None)

    def progress(i: int, r: object) -> None:  # stderr: stdout stays one JSON object
        print(f"  prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)

    report = run_precision(engine, args.dtype, prompts, args.max_tokens, progress)
    print(json.dumps(report.to_dict()) if args.json else render(report))
    return 0


# ----------------------------------------------------------------------------- kv routing


def _kv_routing(bk: argparse.ArgumentParser) -> None:
    from orchestrator.bench.kv_routing import ChatBench  # noqa: PLC0415 - cluster

    for field in ("conversations", "turns", "system_tokens", "user_tokens", "one_shot",
                  "max_tokens", "concurrency", "prefill_workers", "decode_workers"):  # fmt: skip
        bk.add_argument(
            "--" + field.replace("_", "-"),
            type=positive_int,
            default=default(ChatBench, field),
            help=field_doc(ChatBench, field, field.replace("_", " ")),
        )
    bk.set_defaults(call=_run_kv_routing)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of worker counts: {text!r}") from None
    if not sizes or min(sizes) < 2 or max(sizes) > 100_000:
        raise argparse.ArgumentTypeError(f"worker counts must be 2-100000: {text!r}")
    return sizes


def _placement(bp: argparse.ArgumentParser) -> None:
    bp.add_argument(
        "--workers", type=_sizes, default=[20, 80, 320],
        help="fleet sizes, comma-separated (half prefill, half decode)",
    )  # fmt: skip
    bp.add_argument("--requests", type=positive_int, default=2000, help="requests per size")
    bp.set_defaults(call=_run_placement)


def _run_placement(args: argparse.Namespace) -> int:
    from orchestrator.bench.placement import format_result, run_bench  # noqa: PLC0415

    result = run_bench(args.workers, args.requests)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def _run_kv_routing(args: argparse.Namespace) -> int:
    from orchestrator.bench.kv_routing import ChatBench, format_result, run_bench  # noqa: PLC0415
    from orchestrator.cluster import ClusterError  # noqa: PLC0415

    progress = _progress(quiet=args.json)

    spec = ChatBench(
        conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, one_shot=args.one_shot, max_tokens=args.max_tokens,
        concurrency=args.concurrency, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
    )  # fmt: skip
    try:
        result = run_bench(spec, log_level=args.log_level, progress=progress)
    except ClusterError as exc:
        print(f"pdorch bench kv-routing: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def _progress(*, quiet: bool) -> Callable[[str], None]:
    """A bench's progress lines: on stderr (stdout stays the result), none when ``quiet``."""

    def progress(message: str) -> None:
        if not quiet:
            print(f"  {message}", file=sys.stderr, flush=True)

    return progress


# -------------------------------------------------------------------------- control plane


def _control_plane(bc: argparse.ArgumentParser) -> None:
    from orchestrator.bench.control_plane import ControlPlaneBench  # noqa: PLC0415 - cluster

    def flag(name: str, field: str, **kw: Any) -> None:
        kw.setdefault("help", field_doc(ControlPlaneBench, field, _BENCH_HELP.get(field, "")))
        bc.add_argument(name, default=default(ControlPlaneBench, field), **kw)

    flag("--workers", "workers", type=positive_int)
    flag("--prefill-workers", "prefill_workers", type=int, help="of --workers (0: half)")
    flag("--concurrency", "concurrency", type=positive_int)
    flag("--requests", "requests", type=positive_int)
    flag("--orchestrators", "orchestrators", type=positive_int)
    flag("--clients", "clients", type=positive_int, help="load processes")
    flag("--fleet-processes", "fleet_processes", type=positive_int,
         help="processes per worker role")  # fmt: skip
    flag("--max-tokens", "max_tokens", type=positive_int)
    flag("--prompt-words", "prompt_words", type=positive_int)
    flag("--model", "model", help="performance-model preset")
    flag("--prefill-gpu", "prefill_gpu")
    flag("--decode-gpu", "decode_gpu")
    flag("--warmup", "warmup", type=int, help="unmeasured requests (0: 2/worker)")
    flag("--ramp-s", "ramp_s", type=non_negative_float)
    flag("--chunk-window-ms", "chunk_window_ms", type=int)
    bc.add_argument("--profile-dir", default="", help="cProfile each orchestrator into DIR")
    bc.add_argument(
        "--orchestrator-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="pass FLAG to every orchestrator, e.g. --orchestrator-arg=--max-inflight=300",
    )
    bc.add_argument(
        "--fleet-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="pass FLAG to every simulated-worker process, e.g. --fleet-arg=--loop=uvloop",
    )
    for switch in ("tls", "pin", "hiredis", "generate_many"):
        bc.add_argument(
            f"--{switch.replace('_', '-')}",
            choices=("on", "off"),
            default="on" if default(ControlPlaneBench, switch) else "off",
            help=field_doc(ControlPlaneBench, switch),
        )
    flag("--redis-shards", "redis_shards", type=non_negative_int)
    flag("--gpu-batch", "gpu_batch", type=positive_int)
    bc.set_defaults(call=_run_control_plane)


def _run_control_plane(args: argparse.Namespace) -> int:
    from orchestrator.bench.control_plane import format_result, run_bench  # noqa: PLC0415
    from orchestrator.cluster import ClusterError  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415

    progress = _progress(quiet=args.json)

    try:
        result = run_bench(control_plane_bench(args), log_level=args.log_level, progress=progress)
    except (ConfigError, ClusterError) as exc:
        print(f"pdorch bench control-plane: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def control_plane_bench(args: argparse.Namespace) -> ControlPlaneBench:
    from orchestrator.bench.control_plane import ControlPlaneBench  # noqa: PLC0415

    return ControlPlaneBench(
        workers=args.workers,
        prefill_workers=args.prefill_workers,
        concurrency=args.concurrency,
        requests=args.requests,
        orchestrators=args.orchestrators,
        clients=args.clients,
        fleet_processes=args.fleet_processes,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        model=args.model,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
        warmup=args.warmup,
        ramp_s=args.ramp_s,
        chunk_window_ms=args.chunk_window_ms,
        profile_dir=Path(args.profile_dir) if args.profile_dir else None,
        orchestrator_args=tuple(args.orchestrator_arg),
        fleet_args=tuple(args.fleet_arg),
        tls=args.tls == "on",
        redis_shards=args.redis_shards,
        pin=args.pin == "on",
        hiredis=args.hiredis == "on",
        generate_many=args.generate_many == "on",
        gpu_batch=args.gpu_batch,
    )


# ----------------------------------------------------------------------------------- load


def _targets(text: str) -> str:
    """``host:port[,host:port...]``: at least one target, no empty entry."""
    parts = [t.strip() for t in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected host:port[,host:port...], got {text!r}")
    return ",".join(parts)


def _chunk_window_ms(text: str) -> int:
    from orchestrator.core.spec import MAX_CHUNK_WINDOW_MS  # noqa: PLC0415

    value = non_negative_int(text)
    if value > MAX_CHUNK_WINDOW_MS:
        raise argparse.ArgumentTypeError(f"at most {MAX_CHUNK_WINDOW_MS}, got {value}")
    return value


def _ramp_phase(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _load(bl: argparse.ArgumentParser) -> None:
    from orchestrator.bench.load import LoadSpec  # noqa: PLC0415 - imports grpc

    def flag(name: str, field: str, **kw: Any) -> None:
        kw.setdefault("help", field_doc(LoadSpec, field, _BENCH_HELP.get(field, "")))
        bl.add_argument(name, default=default(LoadSpec, field), **kw)

    bl.add_argument(
        "--target", type=_targets, default=ServerSettings().address,
        help="host:port[,host:port...]",
    )  # fmt: skip
    flag("--requests", "requests", type=positive_int)
    flag("--concurrency", "concurrency", type=positive_int)
    flag("--max-tokens", "max_tokens", type=positive_int)
    flag("--prompt-words", "prompt_words", type=positive_int)
    flag("--offset", "offset", type=non_negative_int, help="first request number")
    flag("--ramp-s", "ramp_s", type=non_negative_float)
    flag("--ramp-phase", "ramp_phase", type=_ramp_phase)
    flag("--chunk-window-ms", "chunk_window_ms", type=_chunk_window_ms)
    bl.add_argument(
        "--generate-many",
        choices=("on", "off"),
        default="on" if default(LoadSpec, "generate_many") else "off",
        help=field_doc(LoadSpec, "generate_many"),
    )
    bl.add_argument("--samples", action="store_true", help="print every sample as JSON")
    bl.set_defaults(call=_run_load)


def _run_load(args: argparse.Namespace) -> int:
    from orchestrator.bench.load import run_load  # noqa: PLC0415

    result = asyncio.run(run_load(load_spec(args), client_token(os.environ), client_tls(args)))
    if args.samples:  # for `bench control-plane`, which merges several clients
        write_out(result.to_json())  # large: print could lose its tail (write_out says how)
    elif args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        for key, value in result.summary().items():
            print(f"{key}: {value}")
    if not args.samples and not any(x.completed for x in result.samples):
        raise CommandError(f"no request completed: does an orchestrator answer at {args.target}?")
    return 0


def load_spec(args: argparse.Namespace) -> LoadSpec:
    from orchestrator.bench.load import LoadSpec  # noqa: PLC0415

    return LoadSpec(
        targets=tuple(t for t in args.target.split(",") if t),
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        offset=args.offset,
        ramp_s=args.ramp_s,
        ramp_phase=args.ramp_phase,
        chunk_window_ms=args.chunk_window_ms,
        generate_many=args.generate_many == "on",
    )


# --------------------------------------------------------------------------------- engine


def _engine(be: argparse.ArgumentParser) -> None:
    from orchestrator.bench.engine_batching import EngineBench  # noqa: PLC0415

    be.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default=default(EngineBench, "engine"),
        help="the engine measured",
    )
    be.add_argument(
        "--concurrency",
        type=positive_ints,
        default=default(EngineBench, "concurrency"),
        help="comma-separated stream counts (default %(default)s)",
    )
    be.add_argument(
        "--rounds", type=positive_int, default=default(EngineBench, "rounds"),
        help="requests per stream at each level",
    )  # fmt: skip
    be.add_argument(
        "--max-tokens",
        type=request_max_tokens,
        default=default(EngineBench, "max_tokens"),
        help="tokens per request",
    )
    be.set_defaults(call=_run_engine)


def _run_engine(args: argparse.Namespace) -> int:
    from orchestrator.bench.engine_batching import format_result, run_bench  # noqa: PLC0415
    from orchestrator.cluster import ClusterError  # noqa: PLC0415

    progress = _progress(quiet=args.json)

    try:
        result = run_bench(engine_bench(args), log_level=args.log_level, progress=progress)
    except ClusterError as exc:
        print(f"pdorch bench engine: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def engine_bench(args: argparse.Namespace) -> EngineBench:
    from orchestrator.bench.engine_batching import EngineBench  # noqa: PLC0415

    return EngineBench(
        engine=args.engine,
        concurrency=tuple(args.concurrency),
        rounds=args.rounds,
        max_tokens=args.max_tokens,
    )


# -------------------------------------------------------------------------------- serving


def _serving(bs: argparse.ArgumentParser) -> None:
    from orchestrator.bench.serving import SYSTEMS, Workload  # noqa: PLC0415
    from orchestrator.bench.side_by_side import ServingBench  # noqa: PLC0415

    def flag(name: str, field: str, **kw: Any) -> None:
        bs.add_argument(name, default=default(Workload, field), **kw)

    flag("--requests", "requests", type=positive_int, help="per concurrency level")
    bs.add_argument(
        "--concurrency",
        default=",".join(str(c) for c in default(Workload, "concurrency")),
        help="comma-separated client slots; each level runs --requests requests",
    )
    flag("--prompt-tokens", "prompt_tokens", type=positive_int, help="tokens per prompt")
    flag("--max-tokens", "max_tokens", type=positive_int, help="output tokens per request")
    flag("--warmup", "warmup", type=int, help="unmeasured requests per system")
    bs.add_argument(
        "--systems",
        default=",".join(default(ServingBench, "systems")),
        help=f"comma-separated, of {', '.join(SYSTEMS)}",
    )
    bs.add_argument(
        "--transport", choices=BACKENDS, default=default(ServingBench, "transport"),
        help="pdorch's KV transport for pdorch-pd",
    )  # fmt: skip
    bs.add_argument(
        "--nixl-path", default="",
        help="directory holding the nixl package for vllm-nixl (pip install --no-deps "
        "--target DIR nixl nixl-cu12), if it is not importable here",
    )  # fmt: skip
    bs.set_defaults(call=_run_serving)


def _run_serving(args: argparse.Namespace) -> int:
    from orchestrator.bench.serving import format_table  # noqa: PLC0415
    from orchestrator.bench.side_by_side import NotRun, run  # noqa: PLC0415

    try:
        bench = serving_bench(args)
    except ValueError as exc:
        print(f"pdorch bench serving: {exc}", file=sys.stderr)
        return 2

    progress = _progress(quiet=False)  # stdout stays one JSON object

    try:
        result = run(bench, progress)
    except NotRun as exc:
        print(f"pdorch bench serving: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def serving_bench(args: argparse.Namespace) -> ServingBench:
    from orchestrator.bench.serving import SYSTEMS, Workload  # noqa: PLC0415
    from orchestrator.bench.side_by_side import ServingBench  # noqa: PLC0415

    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(",") if c)
    except ValueError:
        raise ValueError("--concurrency: comma-separated integers") from None
    if not concurrency or min(concurrency) < 1:
        raise ValueError("--concurrency: positive integers")
    return ServingBench(
        workload=Workload(
            requests=args.requests,
            concurrency=concurrency,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            warmup=max(0, args.warmup),
        ),
        systems=systems,
        model=args.model,
        model_cache=Path(args.model_cache) if args.model_cache else None,
        transport=args.transport,
        nixl_path=args.nixl_path,
        log_level=args.log_level,
    )
