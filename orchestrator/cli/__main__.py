"""``python -m orchestrator.cli``: what the `pdorch` console script runs."""

import sys

from orchestrator.cli import main

sys.exit(main())
