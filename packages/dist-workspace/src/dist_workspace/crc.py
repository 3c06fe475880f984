"""CRC-32 over chunks, hashed on a helper thread while the next chunk is read or written."""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK_BYTES = 16 * 1024 * 1024


class OverlappedCrc:
    """A CRC-32 over chunks fed in order, computed on a helper thread.

    zlib releases the GIL while it hashes, so hashing chunk k overlaps the read or
    write of chunk k+1 on another core; the chunks are hashed strictly in order by
    the single worker. Small inputs are hashed inline (no thread).
    """

    def __init__(self, total: int, crc: int = 0) -> None:
        self.value = crc
        self._pool = ThreadPoolExecutor(max_workers=1) if total > 2 * CHUNK_BYTES else None
        self._pending: list[Future[None]] = []

    def _hash(self, chunk: memoryview) -> None:
        self.value = zlib.crc32(chunk, self.value)

    def feed(self, chunk: memoryview) -> None:
        """Adds the next chunk (which must stay unchanged until :meth:`result`)."""
        if self._pool is None:
            self._hash(chunk)
        else:
            self._pending.append(self._pool.submit(self._hash, chunk))

    def result(self) -> int:
        """The CRC of every chunk fed, once all are hashed."""
        if self._pool is not None:
            try:
                for future in self._pending:
                    future.result()
            finally:
                self._pool.shutdown(wait=True)
            self._pool = None
        return self.value
