"""The environment variables a pdorch process reads that something else sets — one place
for their names: the CLI reads them (`orchestrator.cli.common`, `orchestrator.cli.log_file`),
the Kubernetes operator sets them in its pods (`orchestrator.operator`)."""

from __future__ import annotations

LOG_LEVEL_ENV = "PDORCH_LOG_LEVEL"
"""The log level at start (``--log-level`` wins)."""

LOG_LEVEL_FILE_ENV = "PDORCH_LOG_LEVEL_FILE"
"""A file holding the log level, followed while the process runs (a ConfigMap's key
mounted as a file: a changed level reaches running pods without a restart)."""

REDIS_URL_FILE_ENV = "PDORCH_REDIS_URL_FILE"
"""A file holding the whole Redis URL, password included (a Secret mounted read-only),
read once at start."""
