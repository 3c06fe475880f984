"""``python -m dist_launch``: the ``dist-launch`` command."""

from dist_launch.cli import run

run()
