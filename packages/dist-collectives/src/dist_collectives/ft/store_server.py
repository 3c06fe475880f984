"""Old import path of :mod:`dist_collectives.ft.coordination.store_server`.

Kept for code written before ``ft`` had subpackages: this name is the same module
object, so its attributes (private ones included) and patches of them are shared.
``python -m dist_collectives.ft.store_server`` stays the documented command.
"""

import sys
from typing import TYPE_CHECKING

from dist_collectives.ft.coordination import store_server as _module

if TYPE_CHECKING:
    from dist_collectives.ft.coordination.store_server import *  # noqa: F403

if __name__ == "__main__":
    raise SystemExit(_module.main())
sys.modules[__name__] = _module
