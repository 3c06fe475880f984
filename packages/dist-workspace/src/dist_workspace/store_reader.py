"""Reads from the process group's store that wait for a key, for as long as a call allows.

The default store's own timeout belongs to the process group (30 minutes by default)
and changing it would change it for every user of the store. A :class:`StoreReader`
reads through a clone of the store instead (one more connection to the store's
server per process, opened at its first exchange), whose timeout it sets before each
read.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

_MIN_WAIT = timedelta(milliseconds=1)


class StoreReader:
    """Blocking reads of one store, each bounded by its own timeout."""

    def __init__(self, store: Any) -> None:
        self._clone = store.clone()

    def get(self, key: str, seconds: float) -> bytes | None:
        """The value of ``key``, waiting up to ``seconds`` for it; None if it never came."""
        self._clone.set_timeout(max(timedelta(seconds=seconds), _MIN_WAIT))
        try:
            value: bytes = self._clone.get(key)
        except RuntimeError:  # DistStoreError (FileStore: RuntimeError): not set in time
            return None
        return value


_readers: weakref.WeakKeyDictionary[Any, StoreReader] = weakref.WeakKeyDictionary()


def frees_deleted_values(store: Any) -> bool:
    """Whether deleting a key of ``store`` frees its value (a TCPStore or HashStore does).

    Looks through PrefixStores (``underlying_store``) to the store that holds values.

    A FileStore appends every value to its file and never shrinks it: values posted
    on every call would grow the file for as long as the job runs.
    """
    # Public, not re-exported in the stubs; imported when asked, as the rest of torch here.
    from torch.distributed import HashStore, TCPStore  # type: ignore[attr-defined]  # noqa: PLC0415

    # A store that wraps another (a PrefixStore, or a wrapper that forwards its
    # attributes) keeps its values where the wrapped one does.
    while (wrapped := getattr(store, "underlying_store", None)) is not None:
        store = wrapped
    return isinstance(store, TCPStore | HashStore)


def reader_for(store: Any) -> StoreReader:
    """The reader of ``store``, made at the first call and kept while the store lives."""
    reader = _readers.get(store)
    if reader is None:
        reader = _readers[store] = StoreReader(store)
    return reader
