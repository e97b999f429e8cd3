"""The `pdorch` parser (`orchestrator.cli`): every command's help, the logging flags on both
sides of a subcommand, and flag defaults equal to the settings dataclasses' defaults."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Iterator

import pytest

from orchestrator.bench.control_plane import ControlPlaneBench
from orchestrator.bench.load import LoadSpec
from orchestrator.cli import bench, build_parser, main, migrate, operator, orchestrator, worker
from orchestrator.cli.common import DEFAULT_ORCHESTRATOR, ENGINE_MODELS, default, field_doc
from orchestrator.cli.orchestrator import ServerSettings
from orchestrator.control.orchestrator import ControlSettings
from orchestrator.core.admission import AdmissionPolicy
from orchestrator.migrate.settings import MigrationSettings, Upstreams
from orchestrator.operator.config import OperatorConfig
from orchestrator.planning.planner import PlanOptions
from orchestrator.store.redis_store import StoreSettings
from orchestrator.workers.server import WorkerSettings
from transport.base import TransportSettings

NO_ENV: dict[str, str] = {}


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command path (``()``, ``("bench",)``, ``("bench", "load")``, ...)."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def command_parser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser(NO_ENV)
    for name in path:
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(NO_ENV).parse_args(argv)


ALL_COMMANDS = list(commands(build_parser(NO_ENV)))


def test_the_command_tree_is_the_documented_one() -> None:
    top = {path[0] for path in ALL_COMMANDS if len(path) == 1}
    assert top == {
        "up", "status", "down",
        "orchestrator", "worker", "operator", "generate", "demo",
        "cost", "chaos", "migrate", "bench", "plan", "certs",
    }  # fmt: skip
    assert ("bench", "control-plane") in ALL_COMMANDS
    assert ("migrate", "canary") in ALL_COMMANDS
    assert ("chaos", "run") in ALL_COMMANDS


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "pdorch")
def test_every_command_prints_its_help(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"usage: {' '.join(('pdorch', *path))} ")
    assert "--log-level" in out.out  # the logging flags are taken everywhere
    assert out.err == ""


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "worker", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pdorch worker ")
    assert "Traceback" not in done.stderr


def test_a_command_parser_loads_only_its_own_settings() -> None:
    """`main` builds the chosen command's parser alone: `pdorch plan` and `pdorch --help`
    start without grpc, redis, the worker or the control plane."""
    code = (
        "import sys; from orchestrator.cli import build_parser; from orchestrator.cli.app "
        "import NAMES_ONLY; build_parser(only='plan'); build_parser(only=NAMES_ONLY); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'redis', 'torch'})); "
        "print(sorted(m for m in sys.modules if m.startswith(('orchestrator.workers', "
        "'orchestrator.control', 'orchestrator.store'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[:2] == ["[]", "[]"], done.stdout


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for path in ALL_COMMANDS:
        if len(path) == 1:
            assert f"    {path[0]} " in out


def test_an_unknown_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--no-such-flag"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


# -------------------------------------------------------------------------------- logging


@pytest.mark.parametrize(
    "argv",
    [
        ("--log-level", "DEBUG", "--log-format", "json", "chaos", "run", "x"),
        ("chaos", "--log-level", "DEBUG", "--log-format", "json", "run", "x"),
        ("chaos", "run", "x", "--log-level", "DEBUG", "--log-format", "json"),
    ],
)
def test_logging_flags_before_or_after_the_subcommand(argv: tuple[str, ...]) -> None:
    args = parse(*argv)
    assert (args.log_level, args.log_format) == ("DEBUG", "json")


def test_logging_flags_after_the_subcommand_override_only_when_given() -> None:
    env = {"PDORCH_LOG_LEVEL": "INFO"}
    assert build_parser(env).parse_args(["cost"]).log_level == "INFO"
    assert build_parser(env).parse_args(["--log-level", "ERROR", "cost"]).log_level == "ERROR"
    assert build_parser(env).parse_args(["cost", "--log-level", "DEBUG"]).log_level == "DEBUG"
    both = ["--log-level", "ERROR", "cost", "--log-level", "DEBUG"]
    assert build_parser(env).parse_args(both).log_level == "DEBUG"  # the later one wins


# ------------------------------------------------------------------------------- defaults


def test_shared_flags_default_to_the_settings_and_the_environment() -> None:
    for argv in (("orchestrator",), ("worker", "--role", "decode"), ("cost",)):
        assert parse(*argv).redis == default(StoreSettings, "url")
    env = {"PDORCH_REDIS_URL": "redis://r:1/2", "PDORCH_MODEL_CACHE": "/cache"}
    args = build_parser(env).parse_args(["worker", "--role", "decode"])
    assert (args.redis, args.model_cache) == ("redis://r:1/2", "/cache")
    assert parse("migrate", "status", "--name", "n").redis == default(StoreSettings, "url")


def test_orchestrator_flags_default_to_the_control_settings() -> None:
    args = parse("orchestrator")
    built = orchestrator.control_settings(args)
    # `pdorch orchestrator` lets the measured rates decide (AGGREGATE_BELOW = "auto"); a
    # bare AdmissionPolicy always disaggregates. Everything else is the dataclasses' default.
    assert built.admission.aggregate_below is None
    auto_off = dataclasses.replace(
        built.admission, aggregate_below=default(AdmissionPolicy, "aggregate_below")
    )
    assert dataclasses.replace(built, admission=auto_off) == ControlSettings()
    assert orchestrator.server_settings(args) == ServerSettings()
    assert args.api_key == ""


def test_orchestrator_flags_reach_the_settings() -> None:
    args = parse(
        "orchestrator", "--detach-grace", "3", "--max-queue", "7", "--ttft-slo-ms", "250",
        "--kv-dtype", "fp8", "--aggregate-below", "64", "--price", "H100=2",
    )  # fmt: skip
    built = orchestrator.control_settings(args)
    assert built.detach_grace_s == 3.0
    assert built.admission.max_queue == 7
    assert built.admission.ttft_slo_s == pytest.approx(0.25)
    assert built.kv_dtype == "fp8"
    assert built.admission.aggregate_below == 64
    assert built.prices["H100"].price_per_hour == 2.0


def test_worker_flags_default_to_the_worker_and_transport_settings() -> None:
    args = parse("worker", "--role", "decode")
    assert worker.worker_settings(args) == WorkerSettings(role="decode")
    assert args.kv_hold == default(TransportSettings, "kv_hold_s")
    help_text = command_parser("worker").format_help()
    assert f"default {default(WorkerSettings, 'kv_capacity_bytes') >> 20};" in help_text
    assert f"decode batch ({default(WorkerSettings, 'max_batch')};" in help_text


def test_worker_flags_override_what_the_worker_kind_chooses() -> None:
    sim = {"kv_capacity_bytes": 5 << 30, "max_batch": worker.SIM_MAX_BATCH}
    plain = parse("worker", "--role", "prefill")
    assert worker.worker_settings(plain, **sim).kv_capacity_bytes == 5 << 30
    assert worker.worker_settings(plain, **sim).max_batch == worker.SIM_MAX_BATCH
    given = parse("worker", "--role", "prefill", "--kv-capacity-mib", "64", "--max-batch", "4",
                  "--heartbeat-ttl", "6")  # fmt: skip
    built = worker.worker_settings(given, **sim)
    assert (built.kv_capacity_bytes, built.max_batch) == (64 << 20, 4)
    assert (built.heartbeat_ttl_s, built.heartbeat_interval_s) == (6.0, 2.0)


def test_worker_gpu_kind_comes_from_the_environment_else_the_settings() -> None:
    assert parse("worker", "--role", "decode").gpu_kind == default(WorkerSettings, "gpu_kind")
    env = {"PDORCH_GPU_KIND": "L4"}
    assert build_parser(env).parse_args(["worker", "--role", "decode"]).gpu_kind == "L4"


def test_operator_flags_default_to_the_operator_config() -> None:
    config = operator.operator_config(parse("operator", "--namespace", "ns"))
    assert config == OperatorConfig(namespaces=("ns",))


@pytest.mark.parametrize("mode", ["shadow", "canary"])
def test_migrate_flags_default_to_the_migration_settings(mode: str) -> None:
    argv = ["migrate", mode, "--name", "n", "--existing", "http://a", "--pdorch", "http://b"]
    if mode == "canary":
        argv += ["--percent", "5"]
    built = migrate.migration_settings(parse(*argv), mode)
    expected = MigrationSettings(
        name="n", mode=mode, upstreams=Upstreams("http://a", "http://b"),
        percent=5.0 if mode == "canary" else 0.0,
        sample=default(MigrationSettings, "sample") if mode == "shadow" else 0.0,
    )  # fmt: skip
    assert built == expected


def test_bench_flags_default_to_the_bench_specs() -> None:
    assert bench.control_plane_bench(parse("bench", "control-plane")) == ControlPlaneBench()
    spec = bench.load_spec(parse("bench", "load"))
    assert spec == LoadSpec(targets=(ServerSettings().address,))
    assert parse("generate", "hi").orchestrator == ServerSettings().address


def test_plan_help_names_the_planner_defaults() -> None:
    text = command_parser("plan").format_help()
    assert f"Gbit/s ({default(PlanOptions, 'link_gbps'):g})" in text
    assert f"decode batch ({default(PlanOptions, 'max_batch')})" in text


def test_engine_models_are_the_loadable_ones() -> None:
    pytest.importorskip("torch")
    from orchestrator.workers.model_files import MODEL_NAMES  # noqa: PLC0415 - imports torch

    assert ENGINE_MODELS == MODEL_NAMES


def test_default_reads_fields_and_factories() -> None:
    assert default(ControlSettings, "detach_grace_s") == 10.0
    assert default(ControlSettings, "admission") == AdmissionPolicy()  # default_factory
    with pytest.raises(TypeError):
        default(OperatorConfig, "namespaces")  # required: no default
    with pytest.raises(AttributeError):
        default(OperatorConfig, "nope")


# ---------------------------------------------------------------------------------- help


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "pdorch")
def test_every_option_says_what_it_does(path: tuple[str, ...]) -> None:
    parser = command_parser(*path)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.dest == "help":
            continue
        assert action.help, f"pdorch {' '.join(path)} {action.option_strings or action.dest}"


def test_help_shows_every_default() -> None:
    text = " ".join(command_parser("generate").format_help().split())
    assert "tokens at most (default 64)" in text
    assert "--seed SEED sampling seed (default 0)" in text
    text = " ".join(command_parser("bench", "load").format_help().split())
    assert f"requests measured (default: {default(LoadSpec, 'requests')})" in text


def test_flag_help_comes_from_the_settings_field_docstrings() -> None:
    assert field_doc(MigrationSettings, "shadow_concurrency").startswith(
        "Most shadow requests in flight"
    )
    assert field_doc(ServerSettings, "port") == (
        "The gRPC client API; `pdorch generate` and `pdorch bench load` connect here."
    )
    assert field_doc(ServerSettings, "host", "fallback") == "fallback"  # no docstring
    text = " ".join(command_parser("migrate", "shadow").format_help().split())
    assert field_doc(MigrationSettings, "drain_grace_s") in text
    text = " ".join(command_parser("orchestrator").format_help().split())
    assert f"{field_doc(ServerSettings, 'drain_grace_s')} (default: 10.0)" in text
    assert "Prometheus /metrics (0: off). (default: 0)" in text  # a 0 default is shown
    text = " ".join(command_parser("worker").format_help().split())
    assert field_doc(TransportSettings, "kv_hold_s") in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("pdorch 0.")


def test_the_default_orchestrator_address_is_the_servers() -> None:
    assert ServerSettings().address == DEFAULT_ORCHESTRATOR
