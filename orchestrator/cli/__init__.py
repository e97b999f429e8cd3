"""`pdorch` command line: the composition root.

The only package that reads the environment and picks concrete parts (the Redis store, the
UCX or TCP transport, the engine) and wires them together. One module per command group
registers its subcommand (`orchestrator.cli.app` lists them); `orchestrator.cli.common`
holds the flags several commands share, declared once, and reads flag defaults from the
settings dataclasses the flags fill.
"""

from orchestrator.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
