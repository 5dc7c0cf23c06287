"""Writing outputs so that nothing is lost or half-written: destination checks, temporary names, commit, leftovers.

Every command that writes a folder or file writes it under a temporary name next to its
destination, `.NAME.partial-PID` (folders) or `.NAME.tmp-PID` (files), and renames it into place
when it is complete. A process killed with SIGKILL cannot remove its temporary name; the next run
for the same destination finds the names whose process is gone (`leftovers`) and removes them
(`recover`) before it checks free space, so their bytes count as free.

Replacing an existing folder (`commit`) never leaves the destination absent: on Linux the new
folder and the old one swap places in one `renameat2(RENAME_EXCHANGE)` call; where that is not
available the old folder is first renamed to `.NAME.old-PID`, and a kill between the two renames
is repaired by `recover`, which puts the old folder back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from gptoss_cli.errors import CheckpointError, FileSystemError, UsageError, describe_os_error, file_system_error

PARTIAL, OLD, TMP = "partial", "old", "tmp"
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old|tmp)-(?P<pid>\d+)$")


@contextlib.contextmanager
def naming(path: Path):
    """Attach `path` to an OSError that lacks it (write() and close() errors name no file, e.g. ENOSPC)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def write_text(path: Path, text: str) -> None:
    with naming(path):
        Path(path).write_text(text)


def replace_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary name, then a rename; an OSError names `path`."""
    path = Path(path)
    tmp = temp_path(path, TMP)
    try:
        with naming(path):
            tmp.write_bytes(data)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_text(path: Path, text: str) -> None:
    """`replace_bytes` of UTF-8 text."""
    replace_bytes(path, text.encode())


def temp_path(dst: Path, kind: str = PARTIAL) -> Path:
    """This process's temporary name for `dst`: `.NAME.partial-PID` (or old / tmp)."""
    return dst.with_name(f".{dst.name}.{kind}-{os.getpid()}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host and is not a zombie (a killed, unreaped child)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):  # no /proc (not Linux): os.kill said it exists
        return True


def tree_bytes(path: Path) -> int:
    """Bytes held by a file or a folder tree (what removing it frees)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class Leftover:
    """A temporary name for a destination whose writing process is gone."""

    path: Path
    kind: str  # partial | old | tmp
    pid: int
    nbytes: int


def leftovers(dst: Path) -> list[Leftover]:
    """Temporary names `.DST.{partial,old,tmp}-PID` next to `dst` whose process no longer runs."""
    parent = dst.parent
    try:
        entries = list(parent.iterdir())
    except OSError:  # no parent yet, or unreadable: nothing of ours can be there
        return []
    found = []
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m and m["name"] == dst.name and not pid_alive(int(m["pid"])):
            found.append(Leftover(entry, m["kind"], int(m["pid"]), tree_bytes(entry)))
    return sorted(found, key=lambda lo: lo.path.name)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def recover(dst: Path) -> list[str]:
    """Clean up after killed runs for `dst`; returns one note per action.

    A `.DST.old-PID` while DST is absent is the previous DST stranded by a kill in the middle of a
    commit: it is moved back. Every other leftover is an incomplete or superseded copy and is removed.
    """
    notes = []
    found = leftovers(dst)
    stranded = [lo for lo in found if lo.kind == OLD]
    if stranded and not os.path.lexists(dst):
        newest = max(stranded, key=lambda lo: lo.path.stat().st_mtime)
        os.rename(newest.path, dst)
        notes.append(f"restored {dst} from {newest.path.name} (process {newest.pid} was killed while replacing it)")
        found.remove(newest)
    for lo in found:
        try:
            _remove(lo.path)
        except OSError as exc:
            raise FileSystemError(describe_os_error(exc, f"cannot remove the leftover {lo.path} of process {lo.pid}"),
                                  hint="remove it by hand") from None
        notes.append(f"removed {lo.path} ({lo.nbytes / 1e6:.1f} MB) left by process {lo.pid}, which is gone")
    return notes


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable_location(path: Path, what: str) -> None:
    """`path` (to be created or replaced) can be written: no file in the way, the existing part writable."""
    base = existing_ancestor(path.parent)
    if not base.is_dir():
        raise UsageError(f"{what} {path}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_fs(base) else "permission denied"
        raise FileSystemError(f"{what} {path}: {base} is not writable ({reason})")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_destination(dst: Path, force: bool) -> None:
    """DST may be absent or an empty folder; a non-empty one only with --force (see `check_replaceable`)."""
    check_writable_location(dst, "DST")
    if os.path.lexists(dst) and not dst.is_dir():
        raise UsageError(f"{dst}: DST exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise UsageError(f"{dst}: DST exists and is not empty", hint="pass --force to replace it")


def check_file_destination(dst: Path, force: bool) -> None:
    """DST, a file to be written (a GGUF), may be absent; an existing file only with --force (the format's
    `replaceable` then says whether it is one gptoss may replace); never a folder."""
    check_writable_location(dst, "DST")
    if dst.is_dir():
        raise UsageError(f"{dst}: DST is a folder; this output is one file", hint="name the file to write")
    if os.path.lexists(dst) and not force:
        raise UsageError(f"{dst}: DST exists", hint="pass --force to replace it")


def check_replaceable(dst: Path, config_name: str, is_ours, kind: str, extra_files: tuple[str, ...] = ()) -> None:
    """--force replaces only an empty folder or a previous gptoss output of the same kind.

    Recognised by its config file (`is_ours(path)` says whether that file is one gptoss writes) and
    by holding nothing else than what gptoss writes there: the config, safetensors shards and index,
    tokenizer files. Anything else (a source checkpoint, notes, another project) is refused.
    """
    if not dst.is_dir() or not any(dst.iterdir()):
        return
    refuse = f"{dst}: --force replaces only an empty folder or a previous gptoss {kind} output"
    config = dst / config_name
    if not config.is_file() or not is_ours(config):
        raise UsageError(f"{refuse}, and it has no gptoss {config_name}",
                         hint="choose another DST, or empty it yourself")
    allowed = {config_name, "model.safetensors.index.json", *extra_files}
    for entry in sorted(dst.iterdir()):
        name = entry.name
        if entry.is_file() and (name in allowed or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", name)):
            continue
        raise UsageError(f"{refuse}; it also holds {name!r}, which gptoss does not write",
                         hint="choose another DST, or move that file out first")


def check_separate(src: Path, dst: Path) -> None:
    """DST may not be SRC, contain SRC, or lie inside SRC (after resolving symlinks)."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if s == d:
        raise UsageError(f"DST {dst} is the source folder {src}", hint="choose a new folder for the output")
    if d in s.parents:
        raise UsageError(f"DST {dst} contains the source {src}", hint="choose a folder outside the source")
    if s in d.parents:
        raise UsageError(f"DST {dst} lies inside the source {src}", hint="choose a folder outside the source")


def check_free_space(dst: Path, needed: int) -> None:
    """Enough free space next to DST for `needed` bytes; run after `recover`, before anything is written."""
    where = existing_ancestor(dst.parent)
    free = shutil.disk_usage(where).free
    if needed > free:
        raise CheckpointError(
            f"{where}: not enough disk space: the output needs {needed / 1e9:.2f} GB, {free / 1e9:.2f} GB are free",
            hint="free space or choose another DST",
        )


def start_folder(dst: Path, needed: int) -> Path:
    """Check the space for `needed` bytes, then create this process's temporary folder next to DST
    (where the output is written before `commit` swaps it in); returns it."""
    check_free_space(dst, needed)
    tmp = temp_path(dst)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise file_system_error(exc, "cannot create the output folder") from None
    return tmp


@contextlib.contextmanager
def removed_on_error(tmp: Path, dst: Path):
    """The body fills `tmp` and commits it to `dst`; if it raises, `tmp` is removed and DST is as
    it was (an OSError becomes one FileSystemError naming DST)."""
    try:
        yield
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise file_system_error(exc, f"writing {dst} failed (nothing was changed at DST)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    import ctypes  # lazy, like socket below: only a replacing commit needs it, not every CLI start

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (or not Linux)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    import ctypes

    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # file system without it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def commit(tmp: Path, dst: Path) -> None:
    """Put the finished `tmp` in place of `dst`; at every instant DST is the old or the new copy.

    With RENAME_EXCHANGE the old copy ends up under tmp's name and is removed (a kill before that
    leaves it as a leftover of a dead process). Without it the old copy is renamed aside first; a
    kill between the two renames leaves `.DST.old-PID`, which `recover` restores.
    """
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    if exchange(tmp, dst):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = temp_path(dst, OLD)
    os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def commit_file(tmp_file: Path, dst: Path, tmp_folder: Path) -> None:
    """Put the finished file `tmp_file` (inside this process's temporary folder `tmp_folder`, next to DST) in place
    of `dst` in one rename, then remove the folder; a kill between leaves the folder, which `recover` removes."""
    os.replace(tmp_file, dst)
    shutil.rmtree(tmp_folder, ignore_errors=True)


class FolderLock:
    """One run at a time in a folder: an exclusive flock on FOLDER/.gptoss.lock, held until `release`.

    The kernel drops a flock when its process ends, however it ends, so the lock of a killed run
    is simply taken over; the file only records who holds it, for the error message. Creating the
    folder and the lock file is also the pre-flight proof that the folder is writable.
    """

    NAME = ".gptoss.lock"

    def __init__(self, folder: str | Path, what: str):
        self.folder = Path(folder)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        import fcntl

        path = self.folder / self.NAME
        try:
            if os.path.lexists(self.folder) and not self.folder.is_dir():
                raise UsageError(f"{self.what} {self.folder} is a file, not a folder")
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise file_system_error(exc, f"{self.what} {self.folder} is not writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UsageError(f"{self.what} {self.folder} is in use by another gptoss run ({owner})",
                             hint="wait for it to finish, or give this run its own folder") from None
        try:
            os.ftruncate(fd, 0)
            import socket

            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise file_system_error(exc, f"{self.what} {self.folder} is not writable") from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a waiter)
            self._fd = None


# The watcher of a ScratchFolder: standard library only, deaf to the signals its owner's terminal and job get,
# it reads its pipe until the owner closes it (by hand or by ending, however it ends), then removes the folder
# unless the owner wrote "keep".
_WATCHER = ("import shutil, signal, sys\n"
            "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n"
            "if sys.stdin.buffer.read() != b'keep': shutil.rmtree(sys.argv[1], ignore_errors=True)\n")


class ScratchFolder:
    """A temporary folder that goes with the process that made it, however that ends.

    `remove()` removes it (the normal way out: success, an error, Ctrl-C or SIGTERM unwinding). A process
    that cannot unwind (a worker's `os._exit` on Ctrl-C, SIGTERM's default action, SIGKILL, the OOM killer)
    is covered by a watcher: a small process in its own session that holds the read end of a pipe whose
    only write end is this process's, and removes the folder when it reads end-of-file. `keep()` leaves
    the folder in place (an engine's log a user must read)."""

    def __init__(self, prefix: str, parent: str | Path | None = None):
        import subprocess
        import sys
        import tempfile

        parent = Path(parent).expanduser() if parent else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)).resolve()
        read_end, self._write_end = os.pipe()  # not inherited by the processes this one starts (O_CLOEXEC)
        try:
            self._watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, str(self.path)],
                                             stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True)
        except OSError:
            os.close(self._write_end)
            self._write_end = None
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            os.close(read_end)

    def _release(self, word: bytes) -> None:
        if self._write_end is None:
            return
        try:
            if word:
                os.write(self._write_end, word)
        finally:
            os.close(self._write_end)
            self._write_end = None
        try:
            self._watcher.wait(timeout=10)
        except Exception:  # noqa: BLE001 - the watcher ends on its own; never hold up the owner
            pass

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._release(b"")

    def keep(self) -> None:
        self._release(b"keep")


__all__ = [
    "FolderLock", "ScratchFolder",
    "temp_path", "pid_alive", "leftovers", "recover", "check_destination", "check_replaceable", "check_separate",
    "check_free_space", "check_writable_location", "commit", "exchange", "existing_ancestor", "Leftover",
]
