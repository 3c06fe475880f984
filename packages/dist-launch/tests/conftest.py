import sys
from pathlib import Path

# Worker functions of the library tests live in a helper module that the worker
# processes import by name; multiprocessing passes sys.path on to them.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
