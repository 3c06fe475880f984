"""Prints this process's DistEnv as one JSON line (no torch)."""

import dataclasses
import json

from dist_core.env import DistEnv

env = DistEnv.from_environ()
print(json.dumps({**dataclasses.asdict(env), "source": env.source}), flush=True)
