"""Room in the address space (`ulimit -v`, RLIMIT_AS) before loading what cannot fail
cleanly without it.

OpenBLAS (numpy's BLAS) maps 32 MiB buffers when numpy loads and on a first matrix call
(matplotlib makes one); when the mapping fails it calls exit(1) from C: no exception, no
cleanup, and 1 is --fail-above's code. So before numpy or matplotlib loads, the room left
under the limit is checked, and a MemoryError (one line, exit 5) says what is missing.
This module imports nothing that the interpreter has not loaded (start-up time), but
`resource`: __main__ loads this module before anything that can run out of memory, so that
telling an out-of-memory failure apart needs no import when memory is short (an import can
fail then: seen at `prlimit --as` 16,000 KiB, where a failed `import resource` read as "no
limit set" and the compiler's ValueError came out as a traceback).
"""

import errno
import os

try:
    import resource
except ImportError:  # not on Unix
    resource = None  # type: ignore[assignment]

# Measured with numpy 2 and scipy-openblas (82 MiB), plus a margin for other builds.
NUMPY_BYTES = 96 << 20
# The HDF5 library dereferences a failed allocation while it opens a file (SIGSEGV under
# `ulimit -v`, seen 1 MiB above the smallest limit that works); its caches take a few MiB.
HDF5_BYTES = 16 << 20
# matplotlib, a figure and OpenBLAS's matrix buffer (measured ~80 MiB), plus a margin.
PLOT_BYTES = 112 << 20


def check_room(needed: int, what: str) -> None:
    """Raise MemoryError if the address-space limit leaves less than `needed` bytes."""
    if resource is None:
        return
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return
    try:
        with open(f"/proc/{os.getpid()}/status", "rb") as status:
            fields = dict(line.split(b":", 1) for line in status if b":" in line)
        used = int(fields[b"VmSize"].split()[0]) << 10
    except (OSError, KeyError, ValueError):  # no /proc: let the library try
        return
    problem = room_problem(limit, used, needed, what)
    if problem is not None:
        raise MemoryError(problem)


def has_room(needed: int) -> bool:
    """Whether the address-space limit, if any, leaves `needed` bytes (True where there is
    no limit or it cannot be told)."""
    try:
        check_room(needed, "")
    except MemoryError:
        return False
    return True


def _limited() -> bool:
    """Whether an address-space (or data segment) limit is set for this process."""
    if resource is None:
        return False
    limits = (resource.getrlimit(kind)[0] for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA))
    return any(limit != resource.RLIM_INFINITY for limit in limits)


def room_problem(limit: int, used: int, needed: int, what: str) -> str | None:
    """What is missing when `limit` bytes of address space, `used` of them taken, leave
    less than `needed`; None when exactly `needed` or more are left."""
    if limit - used >= needed:
        return None
    return (
        f"the address-space limit (ulimit -v) of {limit >> 20} MiB leaves "
        f"{max(0, limit - used) >> 20} MiB; {what} needs about {needed >> 20} MiB"
    )


# What CPython says when a C function returned NULL without an exception set: seen when
# an allocation fails under RLIMIT_AS inside a C call (3.11's eval loop, building the
# objects of a large pickle), where a MemoryError could not be raised.
_NULL_WITHOUT_EXCEPTION = (
    "error return without exception set",
    "returned NULL without setting an exception",
)


def _node_lost(text: str) -> bool:
    """Whether `text` is CPython's compiler checking a syntax tree whose node it could not
    allocate: "field 'target' is required for AnnAssign" (compile() of clipcli's own, valid
    source at `prlimit --as` 15 MiB, no bytecode cached). No regex: `re` is not loaded at
    start-up."""
    field, _, node = text.removeprefix("field '").partition("' is required for ")
    return text.startswith("field '") and field.isidentifier() and node.isidentifier()


def refused_memory(exc: BaseException) -> bool:
    """Whether `exc` is the address space running out: MemoryError, the dynamic loader
    failing to map an extension module (ImportError "failed to map segment"), or, while
    an address-space limit is set (without one, an allocation does not fail: the kernel
    ends the process), CPython's SystemError for a C call that failed without an
    exception, or its compiler's ValueError for a syntax-tree node lost the same way; and
    a system call's ENOMEM (importlib listing a folder at `prlimit --as` 13 MiB)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    text = str(exc)
    if isinstance(exc, SystemError):
        return any(marker in text for marker in _NULL_WITHOUT_EXCEPTION) and _limited()
    if isinstance(exc, ValueError):
        return _node_lost(text) and _limited()
    return isinstance(exc, ImportError) and (
        "failed to map segment" in text or "Cannot allocate memory" in text
    )


def memory_detail(exc: BaseException) -> str:
    """What to add to "out of memory" for `exc`: its own words where they say something a
    user can act on (a MemoryError's, such as room_problem's), nothing for CPython's
    SystemError or compiler ValueError, nor for an ENOMEM's "Cannot allocate memory"."""
    if isinstance(exc, (SystemError, ValueError, OSError)):
        return ""
    try:
        text = str(exc)
    except MemoryError:
        return ""
    return f": {text}" if text else ""
