"""File-system steps with the guarantees the workspace relies on.

Atomic replace: a temporary file in the target's own directory (same file system, so
``rename`` is atomic), written, flushed and fsynced, renamed over the target, then
the directory fsynced so the rename itself survives a crash. Files are opened with
``O_NOFOLLOW`` and created with ``O_EXCL`` so a planted symlink is never followed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

# File systems whose pages another client may invalidate under a mapping (a file
# replaced on the server makes a later page-in fail with a SIGBUS): read into memory.
_NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre"}
    | {"gpfs", "beegfs", "orangefs", "pvfs2", "ocfs2", "gfs2", "virtiofs"}
)


def fsync_directory(directory: Path) -> None:
    """Flushes a directory's entries (renames, unlinks) to stable storage."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_directory(path: Path, mode: int) -> None:
    """Creates ``path`` (and parents) with ``mode``; an existing directory keeps its mode.

    Raises:
        NotADirectoryError: ``path`` exists and is not a directory (or is a symlink).
    """
    try:
        path.mkdir(mode=mode, parents=True)
    except FileExistsError:
        pass
    else:
        os.chmod(path, mode)  # the umask must not change what the caller asked for
    if path.is_symlink() or not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")


def atomic_write(
    target: Path, size: int, fill: Callable[[int], None], mode: int, *, durable: bool = True
) -> None:
    """Writes a file of ``size`` bytes through ``fill(fd)`` and renames it over ``target``.

    A reader opening ``target`` sees the old file or the complete new one, never a
    part. On any error the temporary file is removed and ``target`` is untouched.
    ``durable=False`` skips both fsyncs: still atomic for readers, but a machine crash
    may leave an empty or old file.
    """
    directory = target.parent
    temporary = directory / f".{target.name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask must not widen or narrow what the caller asked
            if size:
                os.ftruncate(fd, size)
            fill(fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    if durable:
        fsync_directory(directory)


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (``"ext4"``, ``"nfs4"``, ...).

    Reads ``/proc/self/mountinfo``; returns ``""`` when it cannot tell.
    """
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ""
    best_point, best_type = "", ""
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) != 2:
            continue
        mount_point = fields[0].split()[4].replace("\\040", " ")
        fs_type = fields[1].split()[0]
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best_point):
            best_point, best_type = mount_point, fs_type
    return best_type


def is_local_filesystem(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on a file system of this machine (so mapping it is safe).

    Unknown types count as network file systems, and FUSE ones too: a mapping then
    falls back to reading.
    """
    fs_type = filesystem_type(path)
    return bool(fs_type) and fs_type not in _NETWORK_FILESYSTEMS and not fs_type.startswith("fuse")


def write_all(fd: int, data: memoryview | bytes, offset: int) -> int:
    """Writes all of ``data`` at ``offset`` (retrying short writes); returns the end."""
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
    return offset


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def swap_paths_atomically(first: Path, second: Path) -> bool:
    """Swaps two existing paths in one step (``renameat2`` with ``RENAME_EXCHANGE``).

    Returns:
        False when this C library or file system cannot (the caller then renames
        twice, leaving a moment when the second path is missing).

    Raises:
        OSError: The swap itself failed (naming both paths).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap {first} and {second}: {os.strerror(code)}")


def put_directory_in_place(building: Path, output: Path) -> None:
    """Puts the finished directory ``building`` at ``output``; removes the old one.

    A missing or empty ``output`` is replaced by one rename; an existing one is
    swapped in one step (:func:`swap_paths_atomically`), or where the file system
    cannot, renamed aside first (``output`` is then missing for an instant, never
    half-written).
    """
    if not os.path.lexists(output) or (output.is_dir() and not os.listdir(output)):
        os.rename(building, output)  # rename(2) replaces an empty directory atomically
        return
    if swap_paths_atomically(building, output):
        shutil.rmtree(building)  # the old directory, now under the temporary name
        return
    old = output.parent / f".{output.name}.{secrets.token_hex(8)}.old"
    os.rename(output, old)
    try:
        os.rename(building, output)
    except BaseException:
        os.rename(old, output)
        raise
    shutil.rmtree(old)
