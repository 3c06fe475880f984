"""Old import path of :mod:`dist_collectives.ft.groups.baby`.

Kept for code written before ``ft`` had subpackages: this name is the same module
object, so its attributes (private ones included) and patches of them are shared.
"""

import sys
from typing import TYPE_CHECKING

from dist_collectives.ft.groups import baby as _module

if TYPE_CHECKING:
    from dist_collectives.ft.groups.baby import *  # noqa: F403

sys.modules[__name__] = _module
