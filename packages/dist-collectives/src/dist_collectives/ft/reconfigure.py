"""Old import path of :mod:`dist_collectives.ft.groups.reconfigure`.

Kept for code written before ``ft`` had subpackages: this name is the same module
object, so its attributes (private ones included) and patches of them are shared.
"""

import sys
from typing import TYPE_CHECKING

from dist_collectives.ft.groups import reconfigure as _module

if TYPE_CHECKING:
    from dist_collectives.ft.groups.reconfigure import *  # noqa: F403

sys.modules[__name__] = _module
