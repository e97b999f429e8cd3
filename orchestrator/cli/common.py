"""What the command modules share: the parent parsers for flags several commands take
(each declared here once), argument types, a flag default read from a settings dataclass,
and the small pieces every server command runs (signals, the metrics endpoint).

Defaults come from the settings the flags fill (`default`), so a default lives in one place:
the dataclass field. The environment is read here and in the command modules only.

Settings modules are imported where a command's parser is built, not when this package is:
`pdorch plan` builds only the plan parser (`orchestrator.cli.app`) and never loads grpc,
redis or the worker code.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import select
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from orchestrator.core.environment import LOG_LEVEL_ENV, REDIS_URL_FILE_ENV
from orchestrator.errors import ConfigError
from transport.backend_names import BACKENDS, DEFAULT, needs_ucx

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``add_subparsers()`` returns: each command module adds its command to it."""

log = logging.getLogger("pdorch")

DEFAULT_ORCHESTRATOR = "127.0.0.1:50051"
"""`orchestrator.cli.orchestrator.ServerSettings`' address, which imports nothing heavy but
lives beside the server (a unit test keeps the two equal)."""

ENGINE_MODELS = ("tiny", "smollm2")
"""`orchestrator.workers.model_files.MODEL_NAMES`, which imports torch: not at parse time
(a unit test keeps the two equal)."""


class CommandError(Exception):
    """A failure the user can fix (a port in use, an unreachable Redis, no cluster running):
    `main` prints its message on one line and exits 1, without a traceback."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are two lines: the problem, and where help is
    (argparse's default prints the whole usage first, dozens of lines for a server)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n(see '{self.prog} --help')\n")


TRANSPORT_HELP = (
    "how KV moves from prefill to decode workers: ucx (UCX tag messages), ucx-read (UCX "
    "one-sided reads: the decode worker pulls the KV; faster for KV up to ~16 MiB, 0.83-0.95x "
    "of ucx at 64-256 MiB) or tcp (inline on the control connection, needs no UCX); a decode "
    "worker on ucx or ucx-read takes KV from prefill workers on either, one on tcp only from tcp"
)

ENGINES = ("reference", "vllm")
VLLM_MODELS = ("smollm2",)
"""The models `--engine vllm` serves (`orchestrator.workers.vllm`)."""


def check_transport(name: str) -> None:
    """CommandError when a UCX transport (``ucx``, ``ucx-read``) is asked for without UCXX
    installed (found without importing it: that takes a while and starts UCX)."""
    import importlib.util  # noqa: PLC0415

    if needs_ucx(name) and importlib.util.find_spec("ucxx") is None:
        raise CommandError(f"--transport {name}: UCXX is not installed (the ucx extra); "
                           "--transport tcp needs nothing")  # fmt: skip


def check_engine(engine: str, model: str) -> None:
    """CommandError, before anything starts, for a model `--engine vllm` does not serve or
    when vLLM is not installed here: the workers run on this interpreter (a worker is this
    process; `LocalCluster` starts them with ``sys.executable``), so without vLLM each
    would fail only once started (found without importing it: that takes seconds)."""
    if engine != "vllm":
        return
    if model not in VLLM_MODELS:
        raise CommandError(f"--engine vllm serves --model {', '.join(VLLM_MODELS)}, not {model}")
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        raise CommandError(
            f"--engine vllm: vLLM is not installed in this environment ({sys.prefix}); run "
            "it from the vllm environment: `make venv-vllm`, then `.venv-vllm/bin/pdorch`"
        )


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already names it (or
    there is none to name: a switch, an empty list, no value)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        value = action.default
        if (
            not action.option_strings
            or "default" in text
            or value is None
            or value is False  # a switch (0, a number, is shown)
            or value in ("", argparse.SUPPRESS)
            or value == []
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


_DOCS: dict[str, dict[str, str]] = {}
"""Class (qualified name) -> its field docstrings: the source is parsed once."""


def _field_docs(cls: type[Any]) -> dict[str, str]:
    """Dataclass ``cls``'s attribute docstrings (the string literal under a field)."""
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key not in _DOCS:
        _DOCS[key] = _parse_field_docs(cls)
    return _DOCS[key]


def _parse_field_docs(cls: type[Any]) -> dict[str, str]:
    import ast  # noqa: PLC0415
    import inspect  # noqa: PLC0415
    import textwrap  # noqa: PLC0415

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (a frozen app): no docs
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def field_doc(cls: type[Any], name: str, fallback: str = "") -> str:
    """The docstring of dataclass ``cls``'s field ``name``, for a flag's help (``%`` escaped
    for argparse); ``fallback`` when it has none."""
    return _field_docs(cls).get(name, fallback).replace("``", "").replace("%", "%%")


def default(cls: type[Any], name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name`` (a default_factory called)."""
    for f in dataclasses.fields(cls):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise TypeError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


class Parents:
    """Parent parsers (``add_parser(parents=[...])``) for the flags several commands share,
    each built on first use: a command's parser reads only the settings it needs."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    @functools.cached_property
    def logging(self) -> argparse.ArgumentParser:
        """``--log-level``/``--log-format`` after a subcommand; every command takes them."""
        p = _parent()
        add_logging_flags(p, self._env, top=False)
        return p

    @functools.cached_property
    def json(self) -> argparse.ArgumentParser:
        p = _parent()
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    @functools.cached_property
    def redis(self) -> argparse.ArgumentParser:
        from orchestrator.store.redis_store import StoreSettings  # noqa: PLC0415 - imports redis

        p = _parent()
        p.add_argument(
            "--redis",
            type=redis_url,
            default=self._env.get("PDORCH_REDIS_URL", default(StoreSettings, "url")),
            help="Redis URL (default: $PDORCH_REDIS_URL, else %(default)s); redis:// or "
            "rediss:// (TLS), an ACL user as redis://USER@HOST:PORT/DB — its password from "
            f"--redis-password-file or $PDORCH_REDIS_URL, never the command line; {_HA_URLS}",
        )
        _redis_password_flag(p, self._env)
        return p

    @functools.cached_property
    def cluster_redis(self) -> argparse.ArgumentParser:
        """``--redis`` for the client commands: also found from a running `pdorch up`."""
        from orchestrator.cli.state import redis_default  # noqa: PLC0415
        from orchestrator.store.redis_store import StoreSettings  # noqa: PLC0415 - imports redis

        p = _parent()
        p.add_argument(
            "--redis",
            type=redis_url,
            default=redis_default(self._env, default(StoreSettings, "url")),
            help="the cluster's Redis URL (default: $PDORCH_REDIS_URL, else the running "
            f"`pdorch up` cluster's, else %(default)s; {_HA_URLS})",
        )
        _redis_password_flag(p, self._env)
        return p

    @functools.cached_property
    def orchestrator(self) -> argparse.ArgumentParser:
        """``--orchestrator`` for the client commands: also found from a running `pdorch up`."""
        from orchestrator.cli.state import orchestrator_default  # noqa: PLC0415

        p = _parent()
        p.add_argument(
            "--orchestrator",
            type=host_port,
            default=orchestrator_default(self._env, DEFAULT_ORCHESTRATOR),
            metavar="HOST:PORT",
            help="an orchestrator's gRPC address (default: $PDORCH_ORCHESTRATOR, else the "
            "running `pdorch up` cluster's, else %(default)s)",
        )
        return p

    @functools.cached_property
    def tls(self) -> argparse.ArgumentParser:
        """``--tls-dir`` and ``--insecure`` for the servers (orchestrator, worker)."""
        from orchestrator.cli.state import TLS_ENV  # noqa: PLC0415

        p = _parent()
        _tls_dir_flag(p, self._env.get(TLS_ENV, ""), "this process's certificate")
        p.add_argument(
            "--insecure",
            action="store_true",
            help="plaintext gRPC (and HTTP) even with $PDORCH_TLS_DIR set: for debugging "
            "only, said at WARNING at start",
        )
        return p

    @functools.cached_property
    def client_tls(self) -> argparse.ArgumentParser:
        """``--tls-dir`` for the client commands: also found from a running `pdorch up`."""
        from orchestrator.cli.state import tls_default  # noqa: PLC0415

        p = _parent()
        _tls_dir_flag(p, tls_default(self._env), "the client identity's certificate")
        return p

    @functools.cached_property
    def model(self) -> argparse.ArgumentParser:
        """The engine's weights (workers, demo, precision bench) — not a performance preset."""
        p = _parent()
        p.add_argument(
            "--model",
            type=model_name,
            default="smollm2",
            metavar="{tiny,smollm2,DIR}",
            help="tiny: random weights, seconds to load (tests); smollm2: SmolLM2-135M-Instruct, "
            "fetched and converted once into --model-cache; DIR: a local Hugging Face model "
            "directory (config.json, weights, tokenizer; Llama family tested) "
            "(default %(default)s)",
        )
        return p

    @functools.cached_property
    def model_cache(self) -> argparse.ArgumentParser:
        p = _parent()
        p.add_argument(
            "--model-cache",
            default=self._env.get("PDORCH_MODEL_CACHE", ""),
            help="where converted model weights are kept (default: $PDORCH_MODEL_CACHE, else "
            "~/.cache/pdorch/models)",
        )
        return p

    @functools.cached_property
    def transport(self) -> argparse.ArgumentParser:
        p = _parent()
        add_transport_flag(p, DEFAULT, DEFAULT)
        return p


def add_transport_flag(p: argparse.ArgumentParser, value: str | None, shown: str) -> None:
    """``--transport``, its choices `transport.backend_names.BACKENDS` (the one list),
    defaulting to ``value``, which the help names as ``shown``."""
    p.add_argument(
        "--transport", choices=BACKENDS, default=value, help=f"{TRANSPORT_HELP} (default {shown})"
    )


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def add_logging_flags(p: argparse.ArgumentParser, env: Mapping[str, str], *, top: bool) -> None:
    """``--log-level`` and ``--log-format``, on the top parser (``top``, with the defaults)
    and on every subcommand. A subcommand's copies default to SUPPRESS, so they override the
    top-level flags only when given: ``pdorch --log-level INFO worker`` and
    ``pdorch worker --log-level INFO`` mean the same."""
    p.add_argument(
        "--log-level",
        type=log_level,
        default=env.get(LOG_LEVEL_ENV, "WARNING") if top else argparse.SUPPRESS,
        help="DEBUG, INFO, WARNING, ERROR (default: $PDORCH_LOG_LEVEL, else WARNING)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text" if top else argparse.SUPPRESS,
        help="text, or one JSON object a line (default: text)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="on an error, show the full traceback too",
    )


def add_command(
    sub: Commands, name: str, parents: Parents, *uses: argparse.ArgumentParser, **kw: Any
) -> argparse.ArgumentParser:
    """``sub.add_parser(name)`` taking the shared flags in ``uses`` and the logging flags."""
    kw.setdefault("formatter_class", HelpFormatter)
    return sub.add_parser(name, parents=[*uses, parents.logging], **kw)


# ------------------------------------------------------------------------- argument types


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``1,4,16``): at least one, none empty
    (``1,,2`` is a typo, not ``1,2``)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text[:40]!r}"
        )
    return tuple(positive_int(part) for part in parts)


def request_max_tokens(text: str) -> int:
    """A request's ``max_tokens``: 1 up to what the orchestrator admits."""
    from orchestrator.core.spec import RequestLimits  # noqa: PLC0415 - keeps the CLI light

    value = positive_int(text)
    limit = RequestLimits().max_tokens
    if value > limit:
        raise argparse.ArgumentTypeError(f"at most {limit} (a request's limit), got {value}")
    return value


def model_name(text: str) -> str:
    """One of `ENGINE_MODELS`, or a directory a model was saved into (by absolute path, so
    processes started elsewhere find it)."""
    from orchestrator.core import model_dir  # noqa: PLC0415

    if text in ENGINE_MODELS:
        return text
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither {' nor '.join(ENGINE_MODELS)} nor a model directory "
            "(one with a config.json, weights and a tokenizer)"
        )
    missing = model_dir.gaps(path)
    if missing:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a model directory: it lacks {'; '.join(missing)}"
        )
    return str(path.resolve())


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _integer(text: str, expected: str = "an integer") -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive (finite) number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or a positive (finite) number, got {text}")
    return value


def seed(text: str) -> int:
    """A sampling seed: an integer in [0, 2^63) (`SamplingParams`)."""
    from orchestrator.core.sampling import SEED_LIMIT  # noqa: PLC0415 - a light import

    value = _integer(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2^63), got {text}")
    return value


MAX_PORT = 65535


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = _integer(text, "a port number")
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is 0 to {MAX_PORT}, got {value}")
    return value


def host_port(text: str) -> str:
    """A gRPC server's address, HOST:PORT (``[v6]:PORT`` for an IPv6 literal; a port of 1
    to 65535); a target naming its scheme (``dns:///…``, ``unix:…``) is taken as it is."""
    if text.startswith("unix:") or "://" in text:
        return text
    host, colon, number = text.rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    if not colon or not bare or any(c.isspace() for c in host) or not number.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    value = int(number)
    if not 1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is 1 to {MAX_PORT}, got {value}")
    return text


INSECURE_WARNING = (
    "NO TLS: %s (anyone on the network can read and forge its traffic; README: Security)"
)


def _tls_dir_flag(p: argparse.ArgumentParser, default_dir: str, whose: str) -> None:
    p.add_argument(
        "--tls-dir",
        default=default_dir,
        metavar="DIR",
        help=f"TLS directory: ca.pem, and {whose} as <identity>.pem/.key (README: Security; "
        "`pdorch certs DIR` makes a throwaway one) (default: $PDORCH_TLS_DIR; none: plaintext)",
    )


def server_tls_dir(args: argparse.Namespace, what: str) -> str:
    """The TLS directory a server runs with, "" for plaintext — which is said at WARNING:
    "for debugging" with ``--insecure``, else that ``--tls-dir`` was not given."""
    if args.tls_dir and not args.insecure:
        return str(args.tls_dir)
    why = (
        f"--insecure: {what} serves plaintext, for debugging only"
        if args.insecure
        else f"no --tls-dir: {what} serves plaintext"
    )
    log.warning(INSECURE_WARNING, why)
    return ""


def client_tls(args: argparse.Namespace) -> Any:
    """The client identity's `orchestrator.api.tls.Tls` from ``--tls-dir``, None without."""
    if not getattr(args, "tls_dir", ""):
        return None
    from orchestrator.api.tls import Tls  # noqa: PLC0415 - imports grpc
    from orchestrator.core.peers import Role  # noqa: PLC0415

    return Tls.load(args.tls_dir, Role.CLIENT.identity)


TOKEN_ENV = "PDORCH_TOKEN"  # noqa: S105 - a variable name
TOKEN_FILE_ENV = "PDORCH_TOKEN_FILE"  # noqa: S105 - a variable name


def client_token(env: Mapping[str, str]) -> str | None:
    """The bearer token pdorch's clients send: ``$PDORCH_TOKEN``, else the first line of
    ``$PDORCH_TOKEN_FILE``; None (no credential) when neither is set."""
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV].strip()
    path = env.get(TOKEN_FILE_ENV)
    return _secret_file(TOKEN_FILE_ENV, path) if path else None


def _secret_file(variable: str, path: str) -> str:
    """The one value in the file ``$variable`` names (a mounted Secret), stripped."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"${variable} {path}: {exc}") from None
    if not text:
        raise CommandError(f"${variable} {path}: empty")
    return text


REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_PASSWORD_FILE_ENV = "PDORCH_REDIS_PASSWORD_FILE"  # noqa: S105 - a variable name
REDIS_URL_ENV = "PDORCH_REDIS_URL"


def _redis_password_flag(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    p.add_argument(
        "--redis-password-file",
        default=env.get(REDIS_PASSWORD_FILE_ENV, ""),
        metavar="PATH",
        help="read Redis's password (of --redis's user, else the default user) from PATH "
        "(one line; default: $PDORCH_REDIS_PASSWORD_FILE)",
    )


def resolve_redis(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Settle ``args.redis`` (in memory only): the URL from ``$PDORCH_REDIS_URL_FILE`` if
    set, ``--redis-password-file`` folded in; warn when a password came on the command
    line, where every user of the host can read it.

    ``$PDORCH_REDIS_URL_FILE`` names a file holding the whole URL, read once here: a Secret
    mounted read-only keeps the password out of the process's environment (which
    ``/proc/PID/environ``, crash reports and a pod's spec show). It stands in for
    ``$PDORCH_REDIS_URL``: both set is an error, and so is a ``--redis`` that differs from
    it (two sources, and no telling which one was meant)."""
    url = getattr(args, "redis", None)
    if url is None:
        return
    from orchestrator.store.redis_store import StoreSettings  # noqa: PLC0415 - imports redis
    from orchestrator.store.url import has_password, redacted, with_password  # noqa: PLC0415

    url_file = env.get(REDIS_URL_FILE_ENV, "")
    if url_file:
        if env.get(REDIS_URL_ENV):
            raise CommandError(f"set one of ${REDIS_URL_ENV} and ${REDIS_URL_FILE_ENV}, not both")
        text = _secret_file(REDIS_URL_FILE_ENV, url_file)
        try:
            from_file = redis_url(text)
        except argparse.ArgumentTypeError as exc:
            raise CommandError(f"${REDIS_URL_FILE_ENV} {url_file}: {exc}") from None
        if url not in (from_file, default(StoreSettings, "url")):
            raise CommandError(
                f"--redis {redacted(url)} and ${REDIS_URL_FILE_ENV} {url_file}: give one"
            )
        args.redis = url = from_file
    elif has_password(url) and url != env.get(REDIS_URL_ENV):
        log.warning(
            "--redis carries a password on the command line (visible to every user of this "
            "host): use $%s or --redis-password-file",
            REDIS_URL_ENV,
        )
    path = getattr(args, "redis_password_file", "")
    if path:
        try:
            password = Path(path).read_text(encoding="utf-8").strip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"--redis-password-file {path}: {exc}") from None
        if not password:
            raise CommandError(f"--redis-password-file {path}: empty")
        args.redis = with_password(url, password)


def redis_url(text: str) -> str:
    """``redis://HOST:PORT/DB`` (or rediss://, unix://, a cluster's or Sentinel's:
    `orchestrator.store.connect`), checked for form only."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    from orchestrator.store.connect import SCHEMES, RedisUrlError, parse  # noqa: PLC0415
    from orchestrator.store.url import redacted  # noqa: PLC0415

    if text.partition("://")[0] in set(SCHEMES) - set(REDIS_SCHEMES):
        try:
            parse(text)
        except RedisUrlError as exc:
            raise argparse.ArgumentTypeError(
                f"not a Redis URL: {redacted(text)!r} ({exc})"
            ) from None
        return text
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a Redis URL: {redacted(text)!r} ({exc})") from None
    if parts.scheme not in REDIS_SCHEMES or not (parts.hostname or parts.path):
        raise argparse.ArgumentTypeError(
            f"not a Redis URL: {redacted(text)!r} (expected redis://HOST:PORT/DB, "
            "redis+cluster://HOST:PORT[,HOST:PORT...] or "
            "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER)"
        )
    return text


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_HA_URLS = (
    "a Redis Cluster as redis+cluster://HOST:PORT[,HOST:PORT...], a Sentinel-watched "
    "primary as redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER (rediss+ for TLS)"
)


def log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r} (one of {', '.join(LOG_LEVELS)})"
        )
    return level


def gpu_kind(text: str) -> str:
    """A kind the orchestrators price (`orchestrator.core.hardware.PRICED_KINDS`), any case."""
    from orchestrator.core.hardware import PRICED_KINDS  # noqa: PLC0415

    if text.strip().lower() not in {k.lower() for k in PRICED_KINDS}:
        raise argparse.ArgumentTypeError(
            f"unknown GPU kind {text!r} (known: {', '.join(PRICED_KINDS)})"
        )
    return text.strip()


def price(text: str) -> tuple[str, float]:
    """``KIND=USD`` per GPU-hour."""
    from orchestrator.planning.planconfig import parse_price  # noqa: PLC0415

    try:
        return parse_price(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ----------------------------------------------------------------------- server plumbing


async def until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def check_port_free(host: str, port: int, flag: str) -> None:
    """CommandError when ``port`` cannot be bound on ``host`` (0 always can)."""
    import socket  # noqa: PLC0415

    if port == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise CommandError(
                f"{flag} {port}: cannot listen on {host}:{port}: {exc.strerror}"
            ) from None


def check_redis(url: str, flag: str = "--redis", timeout_s: float = 2.0) -> None:
    """CommandError unless the Redis at ``url`` answers PING within ``timeout_s``."""
    import redis  # noqa: PLC0415
    from redis.exceptions import RedisClusterException  # noqa: PLC0415

    from orchestrator.store.connect import sync_client  # noqa: PLC0415

    client = None
    try:
        client = sync_client(url, timeout_s)  # a cluster's connects here
        client.ping()
        if url.partition("://")[0] in REDIS_SCHEMES and _cluster_node(client):
            from orchestrator.store.url import redacted  # noqa: PLC0415

            raise CommandError(
                f"{flag} {redacted(url)}: this Redis is a Redis Cluster node: use a "
                "redis+cluster://HOST:PORT[,HOST:PORT...] URL (README: Redis Cluster / "
                "Sentinel)"
            )
    except redis.AuthenticationError as exc:
        from orchestrator.store.url import has_password, redacted  # noqa: PLC0415

        who = "a password" if has_password(url) else "no password"
        raise CommandError(
            f"{flag} {redacted(url)}: Redis refused the credentials (sent {who}; "
            f"--redis-password-file or ${REDIS_URL_ENV} give them): {exc}"
        ) from None
    except redis.ResponseError as exc:
        # Redis answered, with an error reply to the connection's settings (a DB index it
        # lacks, a user the ACL refuses a command): reachable, so not "does not answer".
        from orchestrator.store.url import redacted  # noqa: PLC0415

        why = f"Redis refused the connection's settings: {exc}"
        raise CommandError(f"{flag} {redacted(url)}: {why}") from None
    except (redis.RedisError, RedisClusterException, OSError, ValueError) as exc:
        from orchestrator.store.url import redacted  # noqa: PLC0415

        raise CommandError(f"{flag} {redacted(url)}: Redis does not answer ({exc})") from None
    finally:
        if client is not None:
            client.close()


def _cluster_node(client: Any) -> bool:
    """Whether the server ``client`` (one plain connection) is a Redis Cluster node: its
    multi-key scripts would fail (CROSSSLOT) on every request. False when it will not say
    (an ACL user without INFO)."""
    import redis  # noqa: PLC0415

    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except redis.ResponseError:
        return False


def serve_metrics(registry: object, host: str, port: int) -> Any:
    """Prometheus ``/metrics`` on ``port`` (a daemon thread); None when port is 0."""
    if port <= 0:
        return None
    from prometheus_client import start_http_server  # noqa: PLC0415

    server, _thread = start_http_server(port, host, registry=registry)  # type: ignore[arg-type]
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server


def write_out(text: str) -> None:
    """Write ``text`` and a newline to stdout, all of it, for a parent that parses it.

    `print` can lose the tail of a large text: under ``PYTHONUNBUFFERED`` (``-u``) stdout's
    text layer sits on the raw file, whose ``write`` may write less than it was given (a
    full pipe on a non-blocking descriptor, or a write a signal interrupts), and the text
    layer drops the rest without a word. A `bench load` client on uvloop printed 121,122
    bytes of samples to a pipe its parent was not yet reading: its ``write`` returned
    65,536 (strace), and the parent got those and a newline. Here every byte goes out,
    waiting for room while the pipe is full (the parent's deadline bounds the wait)."""
    sys.stdout.flush()
    fd = sys.stdout.fileno()
    data = memoryview((text + "\n").encode())
    while data:
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            select.select([], [fd], [], 1.0)  # wait for room in the pipe
