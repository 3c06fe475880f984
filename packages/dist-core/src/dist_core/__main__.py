"""``python -m dist_core``: print the detected distributed environment."""

from dist_core.collect_env import main

raise SystemExit(main())
