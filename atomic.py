"""Writing result files so that a killed process or a second writer never leaves a half-written one,
and checking up front that a result can be written at all."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def _current_umask() -> int:
    """The process umask (read once: setting it back at once is the only portable way to read it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def _fsync_directory(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: not every platform can open a folder)."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` so that every reader sees either the old file or the new one, whole.

    The bytes go to a temporary file with a unique name in the same folder (so concurrent writers
    of the same path never share one), are flushed and fsynced, and the file is renamed over
    ``path`` (``os.replace``: atomic on POSIX and Windows); the folder is created if missing and
    fsynced after the rename. On any error the temporary file is removed and ``path`` is left as
    it was. The new file gets the usual permissions (0o666 minus the umask), not the temporary
    file's 0o600. Text is written as UTF-8.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o666 & ~_UMASK)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(path.parent)
    return path


def _first_missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist (None: ``folder`` exists)."""
    missing = None
    for candidate in (folder, *folder.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing = candidate
    return missing


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` and the folders in it, if no file (nor link) is in any of them."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for child in folder.iterdir():
        _remove_if_empty(child)
    with contextlib.suppress(OSError):  # not empty: something was written in it
        folder.rmdir()


@contextlib.contextmanager
def cleanup_on_error(*folders: str | Path):
    """Within the block, output ``folders`` may be created (by :func:`check_writable_folder`, a
    report); if the block raises, those it created that hold no file are removed again, so that a
    refused command leaves no empty folder behind. A folder that existed before, or that holds a
    file (a results store, a report), stays."""
    created = {missing for folder in folders if (missing := _first_missing(Path(folder))) is not None}
    try:
        yield
    except BaseException:
        for folder in sorted(created, key=lambda f: len(f.parts), reverse=True):
            _remove_if_empty(folder)
        raise


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def check_writable_folder(folder: str | Path, option: str) -> Path:
    """Create ``folder`` (and its parents) if missing and prove a file can be written in it.

    Raises ``NotADirectoryError`` (a file is in the way) or ``PermissionError`` (cannot create the
    folder or a file in it) with a one-line message naming ``option`` and the path. Call it before
    the expensive work, so that a result is never computed and then lost.
    """
    return _check_folder(Path(folder), f"{option} {folder}", "the folder")


def _check_folder(folder: Path, subject: str, what: str) -> Path:
    for link in (folder, *folder.parents):  # a link that leads nowhere: name it, not its symptom
        if link.is_symlink() and not link.exists():
            try:
                link.resolve(strict=True)
            except RuntimeError:  # Python < 3.13 reports a loop so
                reason = "a symbolic link that points back to itself (a loop)"
            except OSError as error:
                reason = ("a symbolic link that points back to itself (a loop)" if error.errno == errno.ELOOP
                          else f"a symbolic link to {os.readlink(link)}, which does not exist")
            else:
                continue
            named = what if link == folder else f"{link} (a parent of {what})"
            raise NotADirectoryError(f"{subject}: {named} is {reason}; remove the link or point it at a folder")
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{subject}: exists and is not a folder" if what == "the folder"
                                 else f"{subject}: {what} is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a parent is a file
        raise NotADirectoryError(f"{subject}: a parent of {what} is a file") from None
    except OSError as error:
        raise PermissionError(f"{subject}: cannot create {what} ({_reason(error)})") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".affdiv-write-check."):
            pass
    except OSError as error:
        raise PermissionError(f"{subject}: cannot write in {what} ({_reason(error)})") from None
    return folder


def check_writable_file(path: str | Path, option: str) -> Path:
    """Check up front that :func:`atomic_write` can write ``path``: its folder is writable (created if
    missing), ``path`` is not a folder, and an existing ``path`` is not read-only (a read-only
    file is taken as "do not overwrite", although a rename could replace it). Errors as in
    :func:`check_writable_folder`, naming ``option`` and ``path``."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{option} {path}: is a folder, expected a file path")
    _check_folder(path.parent, f"{option} {path}", f"its folder {path.parent}")
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"{option} {path}: the file is read-only")
    return path
