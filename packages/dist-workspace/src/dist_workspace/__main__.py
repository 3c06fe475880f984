"""``python -m dist_workspace``: the same as the ``dist-workspace`` command."""

from __future__ import annotations

from dist_workspace.cli import main

raise SystemExit(main())
