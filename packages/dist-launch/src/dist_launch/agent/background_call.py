"""A blocking call run on a thread, its end announced through the caller's selector.

The agent's main thread serves signals from its selector; a call that may block for
long (joining a rendezvous that waits for other nodes, connecting to a store) runs
here, so that Ctrl-C is still served meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
from collections.abc import Callable
from typing import Any


class BackgroundCall:
    """Runs ``call`` on a daemon thread; a pipe registered on ``selector`` says when it ends.

    Once :attr:`done`, :attr:`result` holds what ``call`` returned, or :attr:`error`
    what it raised.
    """

    def __init__(self, selector: selectors.BaseSelector, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self._read, self._write = os.pipe()
        self._selector = selector
        selector.register(self._read, selectors.EVENT_READ, self._finish)
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as error:
            self.error = error
        with contextlib.suppress(OSError):
            os.write(self._write, b"x")

    def _finish(self) -> None:
        self.done = True
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._read)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
