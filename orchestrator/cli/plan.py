"""`pdorch plan`: roofline estimates of colocated and prefill/decode-split layouts
(`orchestrator.planning`). Flags are laid over ``--config``; a flag not given leaves the
document's value, else the planner's default (named in the help text from where it lives).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from orchestrator.cli.common import Commands, Parents, add_command, default
from orchestrator.planning import planconfig
from orchestrator.planning.planner import PlanOptions
from orchestrator.planning.traffic import Slo

_FLAGS = {
    "model.preset": "model",
    "model.dtype": "dtype",
    "traffic.rate": "rate",
    "traffic.prompt": "prompt_tokens",
    "traffic.output": "output_tokens",
    "slo.ttft_ms": "ttft_ms",
    "slo.tpot_ms": "tpot_ms",
    "slo.percentile": "percentile",
    "plan.kinds": "gpus",
    "plan.prefill_kinds": "prefill_gpus",
    "plan.link_gbps": "link_gbps",
    "plan.max_batch": "max_batch",
}
"""Document key ← flag (dest), for the flags laid over the document as they are."""


NAME = "plan"
HELP = "estimate cost and goodput of colocated and disaggregated layouts"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    pl = add_command(
        sub,
        NAME,
        parents,
        parents.json,
        help=HELP,
        description="Roofline estimates of colocated and prefill/decode-split layouts on GPU "
        "kinds: replicas, TTFT, TPOT, goodput and cost per 1,000 requests, and a "
        "recommendation. Flags override --config; see README 'Planner'.",
    )
    pl.add_argument("--config", help="JSON or TOML file (sections: model, traffic, slo, ...)")
    pl.add_argument("--model", help="preset: smollm2-135m, llama-3-8b, llama-3-70b")
    pl.add_argument("--dtype", choices=("bf16", "fp16", "fp8"), help="weights/KV dtype")
    pl.add_argument(
        "--rate", type=float, help=f"requests per second (default {planconfig.DEFAULT_RATE:g})"
    )
    pl.add_argument("--prompt-tokens", help="512 | uniform:LO:HI | lognormal:MEDIAN:P90")
    pl.add_argument(
        "--output-tokens",
        help=f"same forms as --prompt-tokens (default {planconfig.DEFAULT_OUTPUT})",
    )
    pl.add_argument("--ttft-ms", type=float, help="TTFT target for the percentile prompt")
    pl.add_argument("--tpot-ms", type=float, help="TPOT target")
    pl.add_argument(
        "--percentile",
        type=float,
        help=f"prompt percentile for TTFT ({default(Slo, 'percentile'):g})",
    )
    pl.add_argument("--gpus", help="kinds, comma-separated: colocated and decode pools")
    pl.add_argument("--prefill-gpus", help="kinds for prefill pools (default: first of --gpus)")
    pl.add_argument("--price", action="append", default=[], help="KIND=USD per GPU-hour")
    pl.add_argument("--gpu-file", help="JSON or TOML table of GPU kinds overriding the defaults")
    pl.add_argument(
        "--link-gbps",
        type=float,
        help=f"prefill->decode link, Gbit/s ({default(PlanOptions, 'link_gbps'):g})",
    )
    pl.add_argument(
        "--max-batch",
        type=int,
        help=f"most sequences per decode batch ({default(PlanOptions, 'max_batch')})",
    )
    pl.add_argument("--allow-fp16", action="store_true", help="plan bf16 models in fp16 on T4")
    pl.set_defaults(call=run)


def _read(path: str) -> dict[str, object]:
    from orchestrator.errors import ConfigError  # noqa: PLC0415

    fmt = "json" if path.endswith(".json") else "toml"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    return planconfig.parse_text(text, fmt)


def run(args: argparse.Namespace) -> int:
    from orchestrator.errors import ConfigError  # noqa: PLC0415
    from orchestrator.planning import planner  # noqa: PLC0415
    from orchestrator.planning.plan_report import format_plan, plan_to_dict  # noqa: PLC0415

    flags: dict[str, object] = {
        key: value for key, dest in _FLAGS.items() if (value := getattr(args, dest)) is not None
    }
    if args.allow_fp16:
        flags["plan.allow_fp16"] = True
    try:
        data = _read(args.config) if args.config else {}
        if args.gpu_file:
            gpus = {f"gpus.{kind}": spec for kind, spec in _read(args.gpu_file).items()}
            data = planconfig.overlay(data, gpus)
        if args.model:
            data.pop("model", None)  # a preset named on the command line replaces the file's
        flags |= {f"prices.{k}": v for k, v in map(planconfig.parse_price, args.price)}
        request = planconfig.plan_request_from_mapping(planconfig.overlay(data, flags))
        result = planner.plan(request)
    except (ConfigError, OSError) as exc:
        print(f"pdorch plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(result), indent=2) if args.json else format_plan(result))
    if result.recommended is None:
        print("pdorch plan: no layout is feasible (reasons above)", file=sys.stderr)
        return 1
    return 0
