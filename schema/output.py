"""Every file a command writes: checked before any work starts, written atomically, never onto an
input of the same command, and only to a regular file or a new path.

``reserve_output(path, inputs=...)`` refuses, in one line, an empty path, a directory, a path whose
folder is missing or is a file, an existing file that is not a regular file (a device, a FIFO: it
would be replaced by a regular file, or written to), and a path that is one of ``inputs`` (the same
file, through any link). It then creates the temporary file the output will be written to, beside
the target, so a folder that cannot be written (read-only, /proc, no permission) is refused before
the work, too. ``Output.write(data)`` writes, fsyncs and renames it over the target: readers see the
old file or the complete new one, never a part, also when the disk is full or a file-size limit is
hit (the old file stays as it was). An Output not written (the command failed) leaves nothing.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from dctms.schema.errors import DctmsError


class Output:
    """A reserved output file; use as a context manager so a failed command leaves nothing."""

    def __init__(self, target: Path, label: str, fd: int, temp: Path, mode: int):
        self.target = target
        self._label = label
        self._fd: int | None = fd
        self._temp = temp
        self._mode = mode

    def write(self, data: bytes) -> None:
        """Write ``data`` as the target's complete new content (once)."""
        if self._fd is None:
            raise ValueError("output already written or discarded")
        fd, self._fd = self._fd, None
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fchmod(handle.fileno(), self._mode)  # mkstemp creates 0600
                os.fsync(handle.fileno())
            os.replace(self._temp, self.target)
        except BaseException as err:
            self._temp.unlink(missing_ok=True)
            if isinstance(err, OSError):
                raise DctmsError(f"cannot write {self._label}: {err.strerror or err}") from None
            raise
        _fsync_directory(self.target.parent)

    def discard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._temp.unlink(missing_ok=True)

    def __enter__(self) -> Output:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.discard()  # a no-op once written


def check_output_path(
    path: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = (), label: str = ""
) -> Path:
    """The checks of ``reserve_output`` that create nothing; returns the target path."""
    text = os.fspath(path)
    label = label or text
    if text == "":
        raise DctmsError(f"cannot write {label or 'output'}: empty path")
    target = Path(text)
    parent = target.parent
    info = _stat_or_none(target, label)
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            raise DctmsError(f"cannot write {label}: it is a directory (give a file path)")
        if not stat.S_ISREG(info.st_mode):
            raise DctmsError(f"cannot write {label}: it is not a regular file (refusing to replace it)")
        for source in inputs:
            if _same_file(target, Path(source)):
                raise DctmsError(
                    f"cannot write {label}: it is an input of this command ({source}); choose another path"
                )
    elif not parent.exists():
        raise DctmsError(f"cannot write {label}: folder {parent} does not exist")
    elif not parent.is_dir():
        raise DctmsError(f"cannot write {label}: {parent} is a file, not a folder")
    return target


def reserve_output(
    path: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = (), label: str = ""
) -> Output:
    """Check ``path`` and create the temporary file its content will go to (see the module)."""
    label = label or os.fspath(path)
    target = check_output_path(path, inputs=inputs, label=label)
    try:
        mode = target.stat().st_mode & 0o777 if target.exists() else _default_mode()
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise DctmsError(f"cannot write {label}: {err.strerror or err}") from None
    return Output(target, label, fd, Path(temp), mode)


def write_output(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    label: str = "",
) -> None:
    """``reserve_output`` and write at once (when the content is already made)."""
    with reserve_output(path, inputs=inputs, label=label) as out:
        out.write(data)


def check_output_folder(path: str | os.PathLike[str], *, label: str = "") -> Path:
    """A folder a command will write several files into: an existing folder, or a new path whose
    parent is a writable folder (probed with a temporary file that is removed again)."""
    text = os.fspath(path)
    label = label or text
    if text == "":
        raise DctmsError(f"cannot write {label or 'output folder'}: empty path")
    folder = Path(text)
    info = _stat_or_none(folder, label)
    if info is not None and not stat.S_ISDIR(info.st_mode):
        raise DctmsError(f"cannot write {label}: it exists and is not a folder")
    probe_in = folder if info is not None else folder.parent
    if info is None and not probe_in.is_dir():
        raise DctmsError(f"cannot write {label}: folder {probe_in} does not exist")
    try:
        fd, temp = tempfile.mkstemp(dir=probe_in, prefix=".dctms-probe.", suffix=".tmp")
    except OSError as err:
        raise DctmsError(f"cannot write {label}: {err.strerror or err}") from None
    os.close(fd)
    Path(temp).unlink(missing_ok=True)
    return folder


def _stat_or_none(path: Path, label: str) -> os.stat_result | None:
    """``path``'s stat, None when it does not exist; a path that cannot be written is refused."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise DctmsError(f"cannot write {label}: {_first_file(path)} is a file, not a folder") from None
    except OSError as err:
        raise DctmsError(f"cannot write {label}: {err.strerror or err}") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _first_file(path: Path) -> Path:
    """The first component of ``path`` that exists and is not a folder."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, and not needed for atomicity.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
