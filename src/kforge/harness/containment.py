"""OS-level containment of the worker that runs untrusted candidate code.

The warden (warden.py: the parent of the candidate's worker) and the worker use these
primitives so that whatever the candidate starts can be found and killed, and so that it
cannot write outside its folders or reach into the judge; the judge walks the tree with
`descendants` to stop it between calls.

    become_subreaper  warden  orphans of the worker (a daemon made with setsid + fork) are
                              re-parented to the warden instead of init, so kill_tree still
                              finds them. They become the warden's zombies: kill_tree reaps
                              those it kills.
    make_undumpable   warden, processes of the same user without CAP_SYS_PTRACE can neither
                      reference  ptrace it nor read its memory through /proc. A root
                              worker keeps CAP_SYS_PTRACE: only confine() stops that one.
    die_with_parent   worker  the kernel SIGKILLs the worker when the *thread* that started
                              it exits (start workers from a thread that outlives them). Not
                              inherited by the worker's own children.
    descendants       judge   every live process below a pid, read from /proc.
    pin               judge   hold every thread of given processes (and all they start) to a
                              CPU set.
    lock_affinity     workers a seccomp filter: sched_setaffinity fails (EPERM) for every
                              thread of the process and all it starts, so a worker can move
                              neither itself nor the other off the CPU the judge gives both.
    strays            judge   the threads of given processes not held to a CPU set (both
                              workers are pinned to the same CPU on a GPU: the judge checks
                              that neither was moved, sched_setaffinity being open to all).
    kill_tree         warden  SIGKILL the worker, everything below it and (as a subreaper)
                              every orphan re-parented to the warden, until none is left.
    confine           worker  no_new_privs and a Landlock domain on itself and all it starts:
                              - creating, writing, truncating, removing, renaming, linking
                                only beneath the folders (or files) it is given; device
                                nodes (mknod) nowhere, not even there;
                              - no ptrace of processes outside the domain (the judge,
                                other workers): no reading or writing their memory
                                (/proc/<pid>/mem, process_vm_readv), no opening their
                                /proc/<pid>/fd/*, cwd, root or exe, no pidfd_getfd;
                              - Landlock ABI >= 6: no signals to processes outside the
                                domain, no connecting to abstract unix sockets bound outside.

What these do not stop:

    - reads and exec: both stay allowed everywhere (keep secrets off the machine);
    - /proc/<pid>/environ, maps, auxv, cmdline and status of every process, the judge's
      included, stay readable to a confined root worker (measured on Linux 6.18, Landlock
      ABI 7), undumpable or not: keep secrets out of the judge's environment;
    - file metadata: chmod, chown, utimes and xattrs are outside Landlock's reach;
    - the network, and pathname unix sockets: a daemon's control socket (docker, systemd)
      can start processes that are no descendant of the judge, out of kill_tree's reach;
    - file descriptors the worker inherits (pipes, stdout) keep working;
    - a root worker's capabilities that Landlock does not govern (loading kernel modules,
      raw sockets, reboot, other processes' priorities...): run the worker as an
      unprivileged user, or without capabilities, where that matters;
    - threads that exist before confine() stay outside the domain (below Landlock ABI 8,
      whose TSYNC flag confines them all), and a thread of the same address space can be
      hijacked: confine() then reports nothing contained. Importing torch starts one;
    - Landlock ABI < 3 does not govern truncate(2): filesystem is then reported False;
    - fork bombs and processes stuck in uninterruptible sleep (kill_tree reports the
      latter after its timeout); a cgroup would hold those, and is not used here;
    - pid reuse: a pid read from /proc may, in a tiny window, belong to a new process by
      the time it is signalled.

Linux only. Elsewhere every function degrades to doing nothing (returns False, [] or an
empty Confinement); kill_tree then only kills `root`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

_LINUX = sys.platform.startswith("linux")

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38

# Syscalls added since Linux 5.1 share their numbers on these architectures; on others
# (mips, alpha) 444 is something else, so Landlock is not tried there.
_LANDLOCK_MACHINES = frozenset({"x86_64", "aarch64", "riscv64"})
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8: the domain covers every thread of the process

_WRITE_FILE = 1 << 1
_REMOVE_DIR = 1 << 4
_REMOVE_FILE = 1 << 5
_MAKE_CHAR = 1 << 6
_MAKE_DIR = 1 << 7
_MAKE_REG = 1 << 8
_MAKE_SOCK = 1 << 9
_MAKE_FIFO = 1 << 10
_MAKE_BLOCK = 1 << 11
_MAKE_SYM = 1 << 12
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3
_WRITE_RIGHTS_V1 = (_WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG
                    | _MAKE_SOCK | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM)
_FILE_RIGHTS = _WRITE_FILE | _TRUNCATE  # the only write rights a rule on a non-folder may hold
# Handled but granted nowhere: a root worker could mknod the disk's block device in its
# own folder and write the raw disk through it.
_DEVICE_RIGHTS = _MAKE_CHAR | _MAKE_BLOCK

_SCOPE_ABSTRACT_UNIX_SOCKET = 1  # ABI 6
_SCOPE_SIGNAL = 2  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64),
                ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@cache
def _libc() -> ctypes.CDLL | None:
    if not _LINUX:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None
    return libc


def _prctl(option: int, value: int) -> bool:
    libc = _libc()
    if libc is None:
        return False
    zero = ctypes.c_ulong(0)
    return libc.prctl(option, ctypes.c_ulong(value), zero, zero, zero) == 0


def _syscall(number: int, *args: object) -> int:
    """Landlock's syscalls; the caller has checked that _libc() exists."""
    return _libc().syscall(ctypes.c_long(number), *args)


# --- the judge's side: finding and killing what a worker started ------------------------

def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process, not init. True if set."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def make_undumpable() -> None:
    """Non-root processes of this user can no longer ptrace this one or read its memory."""
    _prctl(_PR_SET_DUMPABLE, 0)


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits.

    If the parent died already, the process has been re-parented to init and exits now.
    Re-parenting to a subreaper instead of init is not detected."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name, in parentheses, may itself hold spaces and parentheses
    state, ppid = data[data.rindex(b")") + 2:].split()[:2]
    return state.decode(), int(ppid)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    found = _stat(pid)
    if found is None:
        return False
    if found[0] not in "ZX":
        return True
    # A leader whose main thread exited shows Z while its other threads run on
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


@cache
def _has_children_files() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _children_from_tasks(pid: int) -> list[int]:
    # A child belongs to the thread that forked it, so every task's list is read
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return children


def _children_by_scan() -> Callable[[int], list[int]]:
    by_parent: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (found := _stat(int(name))) is not None:
            by_parent.setdefault(found[1], []).append(int(name))
    return lambda pid: by_parent.get(pid, [])


def _tree(pid: int) -> list[int]:
    """Every descendant of `pid`, zombies included."""
    if not _LINUX:
        return []
    children = _children_from_tasks if _has_children_files() else _children_by_scan()
    seen, found, todo = {pid}, [], [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in seen:  # a reused pid could otherwise make a loop
                seen.add(child)
                found.append(child)
                todo.append(child)
    return found


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of `pid` (default: this process), never `pid` itself."""
    return [child for child in _tree(os.getpid() if pid is None else pid) if alive(child)]


def _threads(pids: Iterable[int]) -> list[int]:
    """The thread ids of `pids`; a process that has exited has none."""
    found = []
    for pid in pids:
        try:
            found += [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            pass
    return found


def pin(pids: Iterable[int], cpus: Collection[int]) -> None:
    """Hold every thread of `pids`, and so all they start, to `cpus` (stop them first: a
    thread started while they are walked could be missed)."""
    for tid in _threads(pids):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


# (audit arch, sched_setaffinity's number, mask on the number) for each ABI a process of this
# machine can make system calls in: x86-64 (the mask folds x32's 0x40000000 bit in) and its
# i386 compat; aarch64 and its arm32 compat.
_AFFINITY_CALLS = {"x86_64": [(0xC000003E, 203, 0xBFFFFFFF), (0x40000003, 241, 0xFFFFFFFF)],
                   "aarch64": [(0xC00000B7, 122, 0xFFFFFFFF), (0x40000028, 241, 0xFFFFFFFF)]}
_BPF_LD_ABS, _BPF_JEQ, _BPF_AND, _BPF_RET = 0x20, 0x15, 0x54, 0x06
_SECCOMP_RET_ALLOW, _SECCOMP_RET_EPERM = 0x7FFF0000, 0x00050000 | 1
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1


def lock_affinity() -> bool:
    """Make sched_setaffinity fail with EPERM in every thread of this process and everything
    it starts (a seccomp filter, synchronized to the threads already running, kept across
    fork and exec); True once installed. Every other system call is untouched."""
    calls = _AFFINITY_CALLS.get(os.uname().machine)
    libc = _libc()
    if not calls or libc is None or not _prctl(_PR_SET_NO_NEW_PRIVS, 1):
        return False
    program: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k); jumps resolved below
    for arch, number, mask in calls:
        program += [(_BPF_LD_ABS, 0, 0, 4),  # seccomp_data.arch
                    (_BPF_JEQ, 0, 3, arch),  # another ABI: on to the next block
                    (_BPF_LD_ABS, 0, 0, 0),  # seccomp_data.nr
                    (_BPF_AND, 0, 0, mask),
                    (_BPF_JEQ, -1, -2, number)]  # -1: to the EPERM return, -2: to the allow return
    allow, deny = len(program), len(program) + 1
    resolved = [(code, deny - i - 1 if jt == -1 else jt, allow - i - 1 if jf == -2 else jf, k)
                for i, (code, jt, jf, k) in enumerate(program)]
    resolved += [(_BPF_RET, 0, 0, _SECCOMP_RET_ALLOW), (_BPF_RET, 0, 0, _SECCOMP_RET_EPERM)]
    filters = (_SockFilter * len(resolved))(*[_SockFilter(*insn) for insn in resolved])
    prog = _SockFprog(len(resolved), filters)
    # seccomp(2) with TSYNC puts the filter on every thread (torch starts some at import);
    # prctl, the fallback where seccomp(2) is missing, only on the calling one.
    result = _syscall(_SYS_SECCOMP[os.uname().machine], ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
                      ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog))
    if result == 0:
        return True
    if ctypes.get_errno() != errno.ENOSYS:
        return False
    zero = ctypes.c_ulong(0)
    return libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog), zero, zero) == 0


def strays(pids: Iterable[int], cpus: Collection[int]) -> list[int]:
    """The threads of `pids` whose CPU affinity is not exactly `cpus`."""
    wanted = set(cpus)
    found = []
    for tid in _threads(pids):
        try:
            if os.sched_getaffinity(tid) != wanted:
                found.append(tid)
        except OSError:  # exited since
            pass
    return found


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(root: int, *, also_orphans: bool = True, exclude: Collection[int] = (),
              timeout_s: float = 5.0) -> list[int]:
    """SIGKILL `root` and all its descendants; return the pids still alive after
    `timeout_s` (empty: contained).

    With `also_orphans` (meant for a subreaper), every other descendant of this process
    is killed too, except those in `exclude` and their descendants: a daemon that left
    the worker's tree was re-parented here. Every child of this process that is neither
    `root` nor protected by `exclude` counts as such an orphan, so list in `exclude` the
    other workers and helpers this process still needs. Without it, a process forked
    while its parent was being killed can escape.

    The walk and the kill repeat until a walk finds nothing alive: a dying process's
    children appear here only once it is dead. Killed children of this process are
    reaped, each by its own pid; `root` never is, so a Popen holding it still waits
    for it (call this before reaping `root`, whose pid could be reused after). `root`'s
    own tree is killed whatever `exclude` says."""
    if not _LINUX:
        signal_all([root], signal.SIGKILL)
        return []
    me = os.getpid()
    deadline = time.monotonic() + timeout_s
    killed: set[int] = set()
    pause = 0.001
    while True:
        targets = [root, *_tree(root)]
        if also_orphans:
            protected = set(exclude)
            for pid in exclude:
                protected.update(_tree(pid))
            targets += [pid for pid in _tree(me) if pid not in protected]
        targets = [pid for pid in dict.fromkeys(targets) if pid != me]
        live = [pid for pid in targets if alive(pid)]
        signal_all(live, signal.SIGKILL)
        killed.update(live)
        for pid in killed.union(targets):
            found = _stat(pid)
            if pid != root and found is not None and found[1] == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        if not live or time.monotonic() >= deadline:
            return sorted(pid for pid in killed.union(live) if alive(pid))
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


# --- the worker's side: confining itself -------------------------------------------------

@dataclass(frozen=True)
class Confinement:
    """What confine() contained."""

    landlock_abi: int  # 0: Landlock unavailable
    filesystem: bool  # writes confined to the allowed folders
    signals: bool  # cannot signal processes outside its domain (Landlock ABI >= 6)
    ptrace: bool  # cannot ptrace, or read the memory of, processes outside its domain

    def missing(self) -> list[str]:
        names = {"filesystem": "filesystem writes", "signals": "signals", "ptrace": "ptrace"}
        return [name for field, name in names.items() if not getattr(self, field)]

    def to_dict(self) -> dict:
        return asdict(self)


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version; 0 where there is none."""
    if _libc() is None or os.uname().machine not in _LANDLOCK_MACHINES:
        return 0
    version = _syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(version, 0)


def _allow(ruleset: int, path: Path, handled: int, fixed_size: bool = False) -> bool:
    """Grant the write rights beneath `path` (a file of `fixed_size`: its bytes, never its
    length); True also when there is nothing there."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            rights = handled & ~_DEVICE_RIGHTS
        else:
            rights = handled & (_WRITE_FILE if fixed_size else _FILE_RIGHTS)
        rule = _PathBeneath(rights, fd)
        return _syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset),
                        ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule),
                        ctypes.c_uint32(0)) == 0
    finally:
        os.close(fd)


def confine(writable: Sequence[str | Path], fixed_size: Sequence[str | Path] = ()) -> Confinement:
    """Confine this process and all it will start: writes only beneath `writable` (paths
    that do not exist are skipped), and to the bytes of the files in `fixed_size`, which it
    cannot truncate or extend (from Landlock ABI 3; a file another process maps, cut short,
    kills that process with SIGBUS); no signals or ptrace outside. Irreversible. Call it
    before importing untrusted code, and before any other thread starts.

    Returns what was contained: nothing if a step failed (no domain is installed then),
    nor while other threads run (this thread and its children are confined all the same)."""
    nothing = Confinement(0, False, False, False)
    # Landlock requires it of a process without CAP_SYS_ADMIN; it also stops setuid
    # programs from granting privileges.
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    abi = landlock_abi()
    if abi < 1:
        return nothing
    handled = _WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    scoped = (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(handled, 0, scoped)
    # No larger than what is filled: a kernel accepts a struct larger than the one it
    # knows only if the extra bytes are zero, so `scoped` is sent only from ABI 6 on
    size = ctypes.sizeof(_RulesetAttr) if scoped else _RulesetAttr.scoped.offset
    ruleset = _syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                       ctypes.c_uint32(0))
    if ruleset < 0:
        return nothing
    try:
        rules = [(path, False) for path in writable] + [(path, True) for path in fixed_size]
        if not all(_allow(ruleset, Path(path), handled, fixed) for path, fixed in rules):
            return nothing
        threads = len(os.listdir("/proc/self/task"))
        all_threads = abi >= 8
        flags = _RESTRICT_SELF_TSYNC if all_threads else 0
        if _syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset),
                    ctypes.c_uint32(flags)) != 0:
            return nothing
    finally:
        os.close(ruleset)
    if threads > 1 and not all_threads:
        warnings.warn(f"confine() ran with {threads - 1} other thread(s), which stay outside "
                      f"the Landlock domain (ABI {abi} < 8)", RuntimeWarning, stacklevel=2)
        return Confinement(abi, False, False, False)
    return Confinement(abi, filesystem=abi >= 3, signals=bool(scoped), ptrace=True)
