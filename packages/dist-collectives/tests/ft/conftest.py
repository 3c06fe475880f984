import sys
from pathlib import Path

# The replica-group scenario (group_scenario.py) is a helper module the tests here and
# the soak in benchmarks/ft.py import by name.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
