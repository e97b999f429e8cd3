"""Generate the Python code for the pdorch.v1 contracts (`make proto`).

    python proto/generate.py [--out DIR]

Runs grpc_tools' bundled protoc over proto/pdorch/v1/*.proto with four outputs: messages
(`*_pb2.py`), gRPC stubs and servicers (`*_pb2_grpc.py`) and the mypy-protobuf stubs of
both (`*_pb2.pyi`, `*_pb2_grpc.pyi`), which are what mypy checks our code against.

protoc names the generated modules after the proto files' paths (`pdorch.v1.common_pb2`);
we keep that layout for the .proto sources but ship the modules flat in
`orchestrator.api`, so the Python import paths are rewritten (protoc has no option for
this: protocolbuffers/protobuf#1491). Only module paths change — the package `pdorch.v1`
inside the serialized descriptors and the RPC method paths (`/pdorch.v1.Orchestrator/...`)
are wire names and stay as they are. A proto file that declares no service gets no
`_pb2_grpc` modules (protoc would emit an empty one).

The output depends only on the .proto files and the versions of grpcio-tools and
mypy-protobuf: nothing from the environment (paths, time, ordering) reaches it, so a test
can regenerate into a temporary directory and compare byte for byte. The files are
written only once protoc and every rewrite have succeeded; generated files in DIR that are
no longer produced are removed. DIR's other files (`__init__.py`) are left alone.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE = "pdorch/v1"
"""The sources' directory under PROTO_ROOT; protoc derives the module path from it."""
TARGET_PACKAGE = "orchestrator.api"
DEFAULT_OUT = ROOT / "orchestrator" / "api"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")

_SOURCE_MODULE = PROTO_PACKAGE.replace("/", ".")
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    # `from pdorch.v1 import common_pb2 as ...` (the .py modules and the .pyi stubs).
    (
        re.compile(rf"^from {re.escape(_SOURCE_MODULE)} import ", re.MULTILINE),
        f"from {TARGET_PACKAGE} import ",
    ),
    # Dotted module names: `'pdorch.v1.common_pb2'` passed to the descriptor builder (it
    # becomes the classes' __module__, which pickling relies on). Anchored on `_pb2` so
    # that protobuf type names (`.pdorch.v1.SamplingParams`) are never touched.
    (
        re.compile(rf"(?<![\w.]){re.escape(_SOURCE_MODULE)}\.(\w+_pb2(?:_grpc)?)\b"),
        rf"{TARGET_PACKAGE}.\1",
    ),
    # The file named in grpc's version-mismatch error message.
    (
        re.compile(rf"\b{re.escape(PROTO_PACKAGE)}/(\w+_pb2_grpc\.py)\b"),
        rf"{TARGET_PACKAGE.replace('.', '/')}/\1",
    ),
)
_LEFTOVER_IMPORT = re.compile(rf"^\s*(?:from|import)\s+{re.escape(_SOURCE_MODULE)}\b", re.MULTILINE)
_SERVICE = re.compile(r"^def add_\w+Servicer_to_server\(", re.MULTILINE)


class GenerationError(Exception):
    """protoc failed, a plugin is missing, or the output is not what the rewrites expect."""


def proto_files() -> list[str]:
    """The sources, as protoc names them (relative to PROTO_ROOT), in a fixed order."""
    files = sorted(
        p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto")
    )
    if not files:
        raise GenerationError(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE}")
    return files


def plugin_path(name: str) -> Path:
    """A mypy-protobuf plugin, installed next to this interpreter (the venv's bin/)."""
    # Not resolved: a venv's python is a symlink to the base interpreter, outside the venv.
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise GenerationError(f"{name} not found next to {sys.executable}; install mypy-protobuf")
    return path


def run_protoc(dest: Path) -> None:
    """All four outputs of every source into `dest`, in protoc's own (nested) layout."""
    argv = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        # Relative include path and sources: no absolute path can reach the output.
        "--proto_path=.",
        *(f"--plugin={name}={plugin_path(name)}" for name in PLUGINS),
        f"--python_out={dest}",
        f"--grpc_python_out={dest}",
        f"--mypy_out={dest}",
        f"--mypy_grpc_out={dest}",
        *proto_files(),
    ]
    done = subprocess.run(argv, cwd=PROTO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise GenerationError(f"protoc failed ({done.returncode}):\n{done.stderr}")


def rewrite(text: str) -> str:
    """Point a generated module's imports of its siblings at TARGET_PACKAGE."""
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    return text


def collect(raw: Path) -> dict[str, str]:
    """The flattened, rewritten files protoc wrote under `raw`: file name -> text."""
    generated = raw / PROTO_PACKAGE
    out: dict[str, str] = {}
    for path in sorted(generated.iterdir()):
        if not path.name.endswith(GENERATED_SUFFIXES):
            raise GenerationError(f"unexpected protoc output {path.name}")
        out[path.name] = rewrite(path.read_text(encoding="utf-8"))
    for name in [n for n in out if n.endswith("_pb2_grpc.py")]:
        if not _SERVICE.search(out[name]):
            del out[name], out[name + "i"]
    for name, text in out.items():
        if _LEFTOVER_IMPORT.search(text):
            raise GenerationError(f"{name} still imports {_SOURCE_MODULE}; update the rewrites")
    return out


def generate(out_dir: Path) -> list[Path]:
    """Regenerate into `out_dir`; returns the files written, sorted."""
    with tempfile.TemporaryDirectory(prefix="pdorch-proto-") as tmp:
        run_protoc(Path(tmp))
        files = collect(Path(tmp))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in sorted(out_dir.iterdir()):
        if stale.name.endswith(GENERATED_SUFFIXES) and stale.name not in files:
            stale.unlink()
    written = []
    for name, text in sorted(files.items()):
        path = out_dir / name
        path.write_bytes(text.encode("utf-8"))  # bytes: no platform newline translation
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Generate the Python code for the pdorch.v1 contracts."
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        written = generate(args.out)
    except GenerationError as exc:
        print(f"proto/generate.py: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
