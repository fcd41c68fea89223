"""atomic_write: whole versions only, under concurrent writers and errors; the up-front write checks."""

import os
import stat
import threading

import pytest

from affdiv import atomic
from affdiv.atomic import atomic_write, check_writable_file, check_writable_folder

SIZE = 1 << 16  # big enough that a write takes several system calls' worth of time


def _payload(writer: int, version: int) -> bytes:
    head = f"{writer}:{version}:".encode()
    return head + bytes([(writer * 7 + version) % 251]) * (SIZE - len(head))


def _is_whole(data: bytes) -> bool:
    try:
        writer, version, _ = data.split(b":", 2)
        return data == _payload(int(writer), int(version))
    except ValueError:  # empty or cut inside the header
        return False


def test_concurrent_writers_never_tear_a_file(tmp_path):
    # Two writers replace the same file 400 times each while a reader reads it back: with one
    # fixed temporary name the writers wrote into each other's temporary file (torn reads).
    path = tmp_path / "result.json"
    atomic_write(path, _payload(9, 0))
    writes, reads, torn = 400, [0], []
    done = threading.Event()

    errors = []

    def write(writer):
        try:
            for version in range(writes):
                atomic_write(path, _payload(writer, version))
        except Exception as error:  # a writer whose temporary file the other renamed away
            errors.append(repr(error))

    def read():
        while not done.is_set():
            data = path.read_bytes()
            reads[0] += 1
            if not _is_whole(data):
                torn.append(data[:40])

    writers = [threading.Thread(target=write, args=(w,)) for w in (1, 2)]
    reader = threading.Thread(target=read)
    reader.start()
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    reader.join()
    assert not errors, errors
    assert not torn, f"{len(torn)} torn reads of {reads[0]}, e.g. {torn[0]!r}"
    assert reads[0] > 0 and _is_whole(path.read_bytes())
    assert sorted(os.listdir(tmp_path)) == ["result.json"]  # no temporary file left behind


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    atomic_write(path, "old")

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out.txt"]


def test_text_is_utf8_and_the_mode_follows_the_umask(tmp_path):
    path = atomic_write(tmp_path / "sub" / "é.txt", "ä≤")
    assert path.read_bytes() == "ä≤".encode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~atomic._UMASK  # not mkstemp's 0o600


def test_writable_checks_name_the_option_and_the_path(tmp_path, unwritable):
    folder = check_writable_folder(tmp_path / "a" / "b", "--out")
    assert folder.is_dir() and os.listdir(folder) == []  # the probe file is gone
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"--out {a_file}: exists and is not a folder"):
        check_writable_folder(a_file, "--out")
    with pytest.raises(NotADirectoryError, match="a parent of the folder is a file"):
        check_writable_folder(a_file / "sub", "--out")
    with pytest.raises(IsADirectoryError, match=f"--json {tmp_path}: is a folder"):
        check_writable_file(tmp_path, "--json")
    locked = unwritable(tmp_path / "locked")
    with pytest.raises(PermissionError, match=f"--json {locked / 'x.json'}: cannot write in its folder {locked} "):
        check_writable_file(locked / "x.json", "--json")
    read_only = tmp_path / "ro.json"
    read_only.write_text("{}")
    unwritable(read_only)
    with pytest.raises(PermissionError, match=f"--json {read_only}: the file is read-only"):
        check_writable_file(read_only, "--json")
    assert check_writable_file(tmp_path / "new" / "x.json", "--json") == tmp_path / "new" / "x.json"
