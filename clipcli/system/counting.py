"""Bit-pattern counts of 8/16-bit float chunks made in helper processes.

clip's measuring pass counts the bit patterns of every 8/16-bit float chunk a clip may
scale (np.bincount, ~1.2 ns an element), and np.bincount holds the GIL for about a third
of each call (its min/max scan): threads count at most ~1.4x as fast as one on two cores
and stop near ~2.7x on any number (benchmarks/RESULTS.md, sessions 40 and 45). Processes
each have their own GIL. Each helper is forked once, before the pass, and serves one
request at a time over its own socket: the parent sends a chunk's place in a file with the
file's descriptor (SCM_RIGHTS: the helper reads the very file the reader opened, through a
duplicate it closes after the read), the helper preads the bytes and counts them with the
function it was given (the parent's own, so the counts are the same by construction), and
leaves them in a shared page for the parent to copy out: only 24 bytes and a descriptor
cross per 2 MiB chunk, and the counts.

Nothing here can change a result. A helper that cannot read the whole range (the file
shrank), fails in any way, or is gone (killed, out of memory) answers nothing usable, and
the caller then reads and counts the chunk itself, as it would without helpers, so the
reader's own checks and messages apply. Where no helper can be forked (RLIMIT_NPROC, no
fork on this platform) there are none. Helpers ignore SIGINT (the parent acts on it, then
closes them) and take other signals' default actions; their stdin, stdout and stderr are
/dev/null and they hold no other descriptor of the parent's, and they dump no core.
close() kills and reaps them, so none outlives the pass, and one whose parent dies is
killed with it (PR_SET_PDEATHSIG), stopped or not.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import resource
import select
import signal
import socket
import struct
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from clipcli.system import interrupts
from clipcli.system.file_map import map_shared
from clipcli.system.inputs import pread_into

if TYPE_CHECKING:
    import numpy as np


class FileRange(Protocol):
    """Where a chunk lies (formats.base.FileRange): the bytes [start, stop) of the file
    whose descriptor in_use() yields and holds open."""

    @property
    def start(self) -> int: ...

    @property
    def stop(self) -> int: ...

    @property
    def in_use(self) -> Callable[[], AbstractContextManager[int]]: ...


# A request: the range's start and length, and the itemsize (1 or 2) to count it as.
_REQUEST = struct.Struct("<QQQ")
_COUNTED, _NOT_COUNTED = b"K", b"N"
# The largest table of counts: one per pattern of a 16-bit float.
_MAX_COUNTS = 1 << 16
# How often a thread waiting for a helper's answer looks whether the helper was stopped
# on its own (SIGSTOP to it alone): it then never answers, and the thread would wait for
# good. The decision is the helper's state, not the time it took.
_LOOK_EVERY_MS = 500
# The knob that turns the helpers off (a developer's, for benchmarks and tests): "0".
KNOB = "CLIPCLI_COUNTING_PROCESSES"


def available() -> bool:
    """Whether this platform can fork helpers and pass them descriptors: Linux only (macOS
    forks, but a forked child of a process with some frameworks loaded may be killed)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


class _Helper:
    """One forked helper: its socket, its shared page of counts, its process id; `alive`
    turns False once it stops answering (and stays so)."""

    def __init__(
        self,
        count: Callable[[np.ndarray], np.ndarray],
        die_with_parent: Callable[[], None] | None,
    ) -> None:
        self.page = map_shared(_MAX_COUNTS * 8)  # seen by both processes
        parent = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a process with threads may deadlock the
            # child; the helper touches no lock another thread may hold (see _serve).
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                pid = os.fork()
            except BaseException:
                ours.close()
                theirs.close()
                self.page.close()
                raise
        if pid == 0:  # the helper: never returns
            _serve(theirs, self.page, count, parent, die_with_parent)
        theirs.close()
        self.socket, self.pid, self.alive = ours, pid, True

    def close(self) -> None:
        self.alive = False
        self.socket.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        # ECHILD: SIGCHLD ignored (inherited so), and the kernel reaped it already.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(BufferError):  # a view of it still held: freed with it
            self.page.close()


def _answer(helper: _Helper) -> bytes:
    """The helper's one-byte answer to the request just sent; b"" where it is stopped on
    its own, or gone (its state unreadable): the caller then counts the chunk itself. A
    helper stopped with clipcli (Ctrl-Z stops the whole group) is running again once
    clipcli is, and answers."""
    poller = select.poll()
    poller.register(helper.socket, select.POLLIN)
    while not poller.poll(_LOOK_EVERY_MS):
        if _stopped(helper.pid):
            return b""
    return helper.socket.recv(1)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T, or t: stopped by a tracer) or cannot be
    looked at any more (gone), from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return not fields or fields[0] in (b"T", b"t")


def _serve(
    sock: socket.socket,
    page: mmap.mmap,
    count: Callable[[np.ndarray], np.ndarray],
    parent: int,
    die_with_parent: Callable[[], None] | None,
) -> None:
    """The helper's whole life: answer requests until the parent's end of the socket is
    gone, then exit without running any of the parent's exit handlers. It uses only system
    calls, numpy and `count`, none of which takes a lock another thread of the parent may
    have held when it forked (Python's own are reset by fork)."""
    try:
        import fcntl  # POSIX, as fork is

        import numpy as np

        # The parent's handlers (system.interrupts) back to the default actions (one
        # ignored from the start, as under nohup, stays so), SIGINT ignored: Ctrl-C
        # reaches the whole group, and the parent finishes its chunk, then closes us.
        for number in interrupts.HANDLED:
            if signal.getsignal(number) not in (signal.SIG_IGN, signal.SIG_DFL):
                signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the parent gone: end here
        if sock.fileno() <= 2:  # the parent runs with stdin/out/err closed: move it up
            high = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD, 3)
            sock.detach()
            sock = socket.socket(fileno=high)
        null = os.open(os.devnull, os.O_RDWR)
        for standard in (0, 1, 2):
            if null != standard:
                os.dup2(null, standard)
        _close_all_but(sock.fileno())  # null among them, when it is not 0-2
        # No core file from a helper (SIGQUIT, Ctrl-\, dumps core by default: a helper's
        # memory left in the working directory), and none left behind stopped if the
        # parent dies (SIGKILL, which ends even a stopped process).
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if die_with_parent is not None:
            die_with_parent()
        if os.getppid() != parent:  # it died before that took effect
            return
        counts_out = np.frombuffer(page, np.int64, _MAX_COUNTS)
        buffer = np.empty(0, np.uint8)
        while True:
            message, fds, _, _ = socket.recv_fds(sock, _REQUEST.size, 1)
            if len(message) != _REQUEST.size or len(fds) != 1:
                break  # the parent closed its end (or sent what it never sends)
            try:
                start, length, itemsize = _REQUEST.unpack(message)
                if buffer.size < length:
                    buffer = np.empty(length, np.uint8)
                raw = buffer[:length]
                # Fewer bytes where the file ends first: the reader's own read blames it.
                whole = pread_into(fds[0], memoryview(raw), start) == length  # type: ignore[arg-type]
            except Exception:  # any failure: the parent reads and counts it itself
                whole = False
            finally:
                os.close(fds[0])  # before answering: the parent's file is never held
            counts = None
            try:
                if whole:
                    counts = count(raw.view(np.uint16 if itemsize == 2 else np.uint8))
                if counts is not None and counts.size <= _MAX_COUNTS:
                    counts_out[: counts.size] = counts
                else:
                    counts = None
            except Exception:
                counts = None
            sock.send(_NOT_COUNTED if counts is None else _COUNTED)
    finally:
        os._exit(0)


def _close_all_but(own: int) -> None:
    """Every descriptor from 3 up closed but `own`: those /proc lists (any number, above
    the soft RLIMIT_NOFILE too: one inherited at 5,000 under a limit of 256 stayed open),
    else up to the hard limit."""
    try:
        listed = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        top = hard if 0 < hard < 1 << 24 else 1 << 24
        os.closerange(3, own)
        os.closerange(own + 1, top)
        return
    for fd in listed:  # the listing's own descriptor among them: closed already
        if fd > 2 and fd != own:
            with contextlib.suppress(OSError):
                os.close(fd)


def _parent_death_signal() -> Callable[[], None] | None:
    """In the parent, before forking: what makes a helper get SIGKILL when its parent
    ends (prctl PR_SET_PDEATHSIG); None where libc cannot be asked."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    set_parent_death_signal = 1  # PR_SET_PDEATHSIG

    def die_with_parent() -> None:
        prctl(set_parent_death_signal, signal.SIGKILL, 0, 0, 0)

    return die_with_parent


class CountingProcesses:
    """Up to `processes` helpers that count 8/16-bit float chunks where they lie in a file
    (see the module). count() may be called from any number of threads at once: each
    request takes a free helper, waiting for one if all are busy."""

    def __init__(self, count: Callable[[np.ndarray], np.ndarray], processes: int) -> None:
        self._helpers: list[_Helper] = []
        die_with_parent = _parent_death_signal()
        for _ in range(processes):
            try:
                self._helpers.append(_Helper(count, die_with_parent))
            except (OSError, MemoryError):  # EAGAIN (RLIMIT_NPROC), ENOMEM: fewer, or none
                break
        self._free: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
        for helper in self._helpers:
            self._free.put(helper)

    @property
    def size(self) -> int:
        """How many helpers were started."""
        return len(self._helpers)

    def count(self, where: FileRange, itemsize: int) -> np.ndarray | None:
        """The bit-pattern counts (intp) of the range's bytes as `itemsize`-byte codes,
        as `count` gives them; None where no helper counted them (the caller reads and
        counts the chunk itself)."""
        import numpy as np

        if not self._helpers:
            return None
        helper = self._free.get()
        try:
            if not helper.alive:  # put back below, so that no caller ever waits for good
                return None
            request = _REQUEST.pack(where.start, where.stop - where.start, itemsize)
            try:
                with where.in_use() as fd:
                    # MSG_NOSIGNAL: a helper gone is EPIPE here, never a SIGPIPE.
                    socket.send_fds(helper.socket, [request], [fd], socket.MSG_NOSIGNAL)
                    answer = _answer(helper)
            except OSError:  # the helper is gone (EPIPE, ECONNRESET)
                answer = b""
            if answer == _COUNTED:
                size = 256**itemsize
                counts: np.ndarray = np.frombuffer(helper.page, np.int64, size).astype(np.intp)
                return counts
            if answer != _NOT_COUNTED:
                helper.alive = False
            return None
        finally:
            self._free.put(helper)

    def close(self) -> None:
        """Every helper killed and reaped (none is counting: the callers are done)."""
        helpers, self._helpers = self._helpers, []
        for helper in helpers:
            helper.close()
