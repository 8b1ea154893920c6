"""Containment primitives, on real processes.

confine() and become_subreaper() change the process that calls them for good, so each
test runs a script in a fresh Python process. The script loads containment.py on its own
(it is pure stdlib: no torch import, so it starts fast) and prints JSON to assert on.
"""

import json
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from kforge.harness import containment
from kforge.harness.containment import Confinement

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def kernel_landlock_abi() -> int:
    """Asked without containment.py, so that a broken landlock_abi() fails these tests
    instead of skipping them."""
    if not sys.platform.startswith("linux"):
        return 0
    if os.uname().machine not in ("x86_64", "aarch64", "riscv64"):
        return 0
    syscall = ctypes.CDLL(None).syscall  # landlock_create_ruleset(NULL, 0, VERSION)
    return max(syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1)), 0)


ABI = kernel_landlock_abi()
needs_landlock = pytest.mark.skipif(ABI < 1, reason="this kernel has no Landlock")
DENIED = ("EACCES", "EPERM")

PRELUDE = f"""
import atexit, errno, importlib.util, json, os, signal, stat, subprocess, sys, threading, time
import warnings
from pathlib import Path

spec = importlib.util.spec_from_file_location("containment", {str(containment.__file__)!r})
c = importlib.util.module_from_spec(spec)
sys.modules["containment"] = c
spec.loader.exec_module(c)

@atexit.register
def kill_leftovers():  # when a script fails half-way
    c.signal_all(c._tree(os.getpid()), signal.SIGKILL)

def attempt(action):
    try:
        action()
    except OSError as error:
        return errno.errorcode[error.errno]
    return "ok"

def until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.002)
"""

# A worker that leaves a daemon behind: its child starts a new session, forks the daemon,
# reports "<daemon pid> <its own pid>" on the pipe and exits. The worker then exits or
# stays, as argv[2] says.
WORKER = """
import os, sys, time
w = int(sys.argv[1])
if os.fork() == 0:
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        time.sleep(60)
    else:
        os.write(w, f"{daemon} {os.getpid()}\\n".encode())
    os._exit(0)
os.close(w)
if sys.argv[2] == "stay":
    time.sleep(60)
"""

START_WORKER = f"""
def start_worker(mode):
    r, w = os.pipe()
    worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}, str(w), mode], pass_fds=[w])
    os.close(w)
    with os.fdopen(r) as pipe:
        daemon, first_parent = map(int, pipe.readline().split())
    until(lambda: c._stat(daemon)[1] != first_parent)  # re-parented: its parent has exited
    return worker, daemon
"""


def run(body: str, *args: object) -> dict:
    # Files, not pipes: a process the script leaves behind must not hold the test up
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, "-c", PRELUDE + START_WORKER + textwrap.dedent(body),
                               *map(str, args)], stdout=out, stderr=err, timeout=30)
        out.seek(0)
        err.seek(0)
        assert proc.returncode == 0, err.read()
        return json.loads(out.read().splitlines()[-1])


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def sleeper():
    """A process outside any domain the tests create."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def folders(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "existing.txt").write_text("before")
    return allowed, outside


def test_missing_names_what_is_not_contained():
    assert Confinement(7, True, True, True).missing() == []
    assert Confinement(5, True, False, True).missing() == ["signals"]
    assert Confinement(0, False, False, False).missing() == [
        "filesystem writes", "signals", "ptrace"]
    assert Confinement(5, True, False, True).to_dict() == {
        "landlock_abi": 5, "filesystem": True, "signals": False, "ptrace": True}


@needs_landlock
def test_landlock_abi():
    assert containment.landlock_abi() == ABI
    assert run("print(json.dumps(c.landlock_abi()))") == ABI


@needs_landlock
def test_confine_allows_writes_only_beneath_the_allowed_folder(folders):
    allowed, outside = folders
    result = run("""
        allowed, outside = Path(sys.argv[1]), Path(sys.argv[2])
        existing = outside / "existing.txt"
        device = lambda name: os.mknod(allowed / name, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        result = {"mknod_before": attempt(lambda: device("null-before"))}
        result["confinement"] = c.confine([allowed]).to_dict()
        result.update(
            create_inside=attempt(lambda: (allowed / "new.txt").write_text("new")),
            mkdir_inside=attempt(lambda: (allowed / "sub").mkdir()),
            remove_inside=attempt(lambda: (allowed / "sub").rmdir()),
            read_outside=attempt(lambda: existing.read_text()),
            create_outside=attempt(lambda: (outside / "new.txt").write_text("new")),
            append_outside=attempt(lambda: open(existing, "a").close()),
            truncate_outside=attempt(lambda: os.truncate(existing, 0)),
            remove_outside=attempt(lambda: existing.unlink()),
            move_out=attempt(lambda: os.rename(allowed / "new.txt", outside / "moved.txt")),
            hardlink_in=attempt(lambda: os.link(existing, allowed / "link.txt")),
            through_symlink=attempt(lambda: (os.symlink(existing, allowed / "symlink.txt"),
                                             open(allowed / "symlink.txt", "a").close())),
            mknod_after=attempt(lambda: device("null-after")),
        )
        print(json.dumps(result))
    """, allowed, outside)
    assert result["confinement"] == {"landlock_abi": ABI, "filesystem": ABI >= 3,
                                     "signals": ABI >= 6, "ptrace": True}
    for name in ("create_inside", "mkdir_inside", "remove_inside", "read_outside"):
        assert result[name] == "ok", name
    for name in ("create_outside", "append_outside", "remove_outside", "move_out",
                 "through_symlink"):
        assert result[name] in DENIED, name
    assert result["hardlink_in"] in (*DENIED, "EXDEV")  # ABI >= 2 refuses to gain rights
    if ABI >= 3:
        assert result["truncate_outside"] in DENIED
    assert (outside / "existing.txt").read_text() == "before"
    assert sorted(p.name for p in outside.iterdir()) == ["existing.txt"]
    assert (allowed / "new.txt").read_text() == "new"
    if result["mknod_before"] == "ok":  # root: a device node would reach the raw disk
        assert result["mknod_after"] in DENIED
        assert not (allowed / "null-after").exists()


@needs_landlock
def test_confine_to_a_single_file(folders):
    allowed, _ = folders
    target = allowed / "log.txt"
    target.write_text("start\n")
    result = run("""
        target = Path(sys.argv[1])
        conf = c.confine([target, "/no/such/folder"])
        print(json.dumps({
            "confinement": conf.to_dict(),
            "append": attempt(lambda: target.open("a").write("more\\n")),
            "sibling": attempt(lambda: (target.parent / "other.txt").write_text("x")),
        }))
    """, target)
    assert result["confinement"]["filesystem"] == (ABI >= 3)
    assert result["append"] == "ok"
    assert result["sibling"] in DENIED
    assert target.read_text() == "start\nmore\n"


@needs_landlock
def test_confined_process_cannot_signal_outside_its_domain(sleeper):
    if ABI < 6:
        pytest.skip(f"Landlock ABI {ABI} has no signal scoping (needs 6)")
    result = run("""
        helper = int(sys.argv[1])
        result = {"probe_before": attempt(lambda: os.kill(helper, 0))}
        result["confinement"] = c.confine([]).to_dict()
        result["stop_helper"] = attempt(lambda: os.kill(helper, signal.SIGSTOP))
        result["probe_parent"] = attempt(lambda: os.kill(os.getppid(), 0))
        own = subprocess.Popen(["sleep", "60"])  # started inside the domain
        result["kill_own_child"] = attempt(lambda: os.kill(own.pid, signal.SIGKILL))
        own.wait(timeout=5)
        print(json.dumps(result))
    """, sleeper.pid)
    assert result["probe_before"] == "ok"
    assert result["confinement"]["signals"] is True
    assert result["stop_helper"] in DENIED
    assert result["probe_parent"] in DENIED
    assert result["kill_own_child"] == "ok"
    deadline = time.monotonic() + 0.1  # a stop, had it been sent, would show by then
    while time.monotonic() < deadline:
        assert state(sleeper.pid) != "T"
        time.sleep(0.005)


@needs_landlock
def test_confined_process_cannot_read_memory_outside_its_domain(sleeper):
    secret = ctypes.create_string_buffer(b"kforge-secret")
    result = run("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        def ptrace_attach(pid):
            if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
                raise OSError(ctypes.get_errno(), "ptrace")
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]
        def read_parent(address, length=13):
            buffer = ctypes.create_string_buffer(length)
            local = IoVec(ctypes.addressof(buffer), length)
            remote = IoVec(address, length)
            parent = os.getppid()
            if libc.process_vm_readv(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) < 0:
                raise OSError(ctypes.get_errno(), "process_vm_readv")
            seen.append(buffer.raw.decode())
        helper, address, seen = int(sys.argv[1]), int(sys.argv[2]), []
        mem = lambda pid: open(f"/proc/{pid}/mem", "rb").close()
        result = {"helper_before": attempt(lambda: mem(helper)),
                  "read_before": attempt(lambda: read_parent(address))}
        result["confinement"] = c.confine([]).to_dict()
        result["read_after"] = attempt(lambda: read_parent(address))
        result["helper_after"] = attempt(lambda: mem(helper))
        result["parent_after"] = attempt(lambda: mem(os.getppid()))
        result["fd_after"] = attempt(lambda: open(f"/proc/{helper}/fd/1", "rb").close())
        result["ptrace_after"] = attempt(lambda: ptrace_attach(helper))
        result["self_after"] = attempt(lambda: mem("self"))
        result["seen"] = seen
        print(json.dumps(result))
    """, sleeper.pid, ctypes.addressof(secret))
    if os.geteuid() == 0:  # root may read them unconfined: the change is confine's
        assert result["helper_before"] == result["read_before"] == "ok"
        assert result["seen"] == ["kforge-secret"]  # read before confine, not after
    assert result["confinement"]["ptrace"] is True
    for name in ("read_after", "helper_after", "parent_after", "fd_after", "ptrace_after"):
        assert result[name] in DENIED, name
    assert result["self_after"] == "ok"


@needs_landlock
def test_confine_reports_nothing_contained_when_other_threads_run(folders):
    allowed, outside = folders
    result = run("""
        allowed, outside = Path(sys.argv[1]), Path(sys.argv[2])
        release = threading.Event()
        threading.Thread(target=release.wait).start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            conf = c.confine([allowed])
        release.set()
        print(json.dumps({
            "confinement": conf.to_dict(),
            "warnings": [str(w.message) for w in caught],
            "create_outside": attempt(lambda: (outside / "new.txt").write_text("x")),
        }))
    """, allowed, outside)
    assert result["create_outside"] in DENIED  # this thread is confined all the same
    if ABI >= 8:  # TSYNC confines the other thread too
        assert result["confinement"]["filesystem"] is True
        assert result["warnings"] == []
    else:
        assert result["confinement"] == {"landlock_abi": ABI, "filesystem": False,
                                         "signals": False, "ptrace": False}
        assert "other thread" in result["warnings"][0]


def test_confine_without_landlock_confines_nothing(folders):
    allowed, outside = folders
    result = run("""
        c.landlock_abi = lambda: 0
        conf = c.confine([sys.argv[1]])
        print(json.dumps({
            "confinement": conf.to_dict(),
            "missing": conf.missing(),
            "create_outside": attempt(lambda: (Path(sys.argv[2]) / "new.txt").write_text("x")),
        }))
    """, allowed, outside)
    assert result["confinement"] == {"landlock_abi": 0, "filesystem": False,
                                     "signals": False, "ptrace": False}
    assert result["missing"] == ["filesystem writes", "signals", "ptrace"]
    assert result["create_outside"] == "ok"


@pytest.mark.parametrize("subreaper, worker_mode", [
    (True, "exit"),  # the daemon outlives its worker
    (True, "stay"),  # the worker is killed too, and its Popen still gets the status
    (False, "exit"),  # control: without a subreaper the daemon escapes to init
])
def test_kill_tree_kills_a_double_forked_daemon(subreaper, worker_mode):
    result = run("""
        subreaper = sys.argv[1] == "True" and c.become_subreaper()
        worker, daemon = start_worker(sys.argv[2])
        found = daemon in c.descendants()
        if sys.argv[2] == "exit":
            worker.wait(timeout=5)
        left = c.kill_tree(worker.pid)
        result = {
            "subreaper": subreaper, "found": found, "left": left,
            "returncode": worker.wait(timeout=5),
            "daemon_alive": c.alive(daemon),
            "daemon_reaped": not os.path.exists(f"/proc/{daemon}"),
            "zombies": [pid for pid in c._tree(os.getpid()) if c._stat(pid)[0] == "Z"],
        }
        if result["daemon_alive"]:
            os.kill(daemon, signal.SIGKILL)
        print(json.dumps(result))
    """, subreaper, worker_mode)
    assert result["subreaper"] is subreaper
    assert result["found"] is subreaper
    assert result["left"] == []
    assert result["returncode"] == (-9 if worker_mode == "stay" else 0)
    assert result["daemon_alive"] is not subreaper
    if subreaper:
        assert result["daemon_reaped"]
        assert result["zombies"] == []


def test_kill_tree_spares_excluded_processes():
    result = run("""
        c.become_subreaper()
        keep = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
        keep_child = int(keep.stdout.readline())
        finished = subprocess.Popen(["sh", "-c", "exit 3"])
        until(lambda: c._stat(finished.pid)[0] == "Z")
        worker, daemon = start_worker("stay")
        left = c.kill_tree(worker.pid, exclude=[keep.pid, finished.pid])
        result = {
            "left": left, "worker": worker.wait(timeout=5), "daemon_alive": c.alive(daemon),
            "keep_running": keep.poll() is None, "keep_child_alive": c.alive(keep_child),
            "finished": finished.wait(timeout=5),
        }
        keep.kill()
        result["keep"] = keep.wait(timeout=5)
        result["cleanup_left"] = c.kill_tree(keep_child)
        print(json.dumps(result))
    """)
    assert result["left"] == []
    assert result["worker"] == -9
    assert result["daemon_alive"] is False
    assert result["keep_running"] and result["keep_child_alive"]
    assert result["finished"] == 3  # its exit status was left to its Popen
    assert result["keep"] == -9
    assert result["cleanup_left"] == []


def test_descendants_with_and_without_children_files():
    result = run("""
        plain = subprocess.Popen(["sleep", "60"])
        shell = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
        grandchild = int(shell.stdout.readline())
        started, release = {}, threading.Event()
        def start():  # a child of this thread, listed under its own task
            started["proc"] = subprocess.Popen(["sleep", "60"])
            release.wait()
        threading.Thread(target=start).start()
        until(lambda: "proc" in started)
        expected = sorted([plain.pid, shell.pid, grandchild, started["proc"].pid])
        result = {
            "expected": expected,
            "files": c._has_children_files(),
            "with_files": sorted(c.descendants()),
            "of_shell": c.descendants(shell.pid),
            "grandchild": grandchild,
        }
        c._has_children_files = lambda: False
        result["by_scan"] = sorted(c.descendants(os.getpid()))
        result["left"] = c.kill_tree(plain.pid)
        release.set()
        print(json.dumps(result))
    """)
    assert result["files"]  # Linux >= 3.5 with CONFIG_PROC_CHILDREN, as everywhere
    assert result["with_files"] == result["expected"]
    assert result["by_scan"] == result["expected"]
    assert result["of_shell"] == [result["grandchild"]]
    assert result["left"] == []


def test_alive_and_kill_tree_see_through_zombie_leaders():
    # A process whose main thread exited shows state Z while another thread runs on
    result = run("""
        finished = subprocess.Popen(["true"])
        until(lambda: c._stat(finished.pid)[0] == "Z")
        headless = subprocess.Popen([sys.executable, "-c", "import ctypes, threading, time; "
                                     "threading.Thread(target=time.sleep, args=(60,)).start(); "
                                     "ctypes.CDLL(None).pthread_exit(None)"])
        until(lambda: c._stat(headless.pid)[0] == "Z")
        result = {"zombie": c.alive(finished.pid), "headless": c.alive(headless.pid)}
        result["left"] = c.kill_tree(headless.pid, also_orphans=False)
        result["returncode"] = headless.wait(timeout=5)
        finished.wait()
        result["reaped"] = c.alive(finished.pid)
        print(json.dumps(result))
    """)
    assert result == {"zombie": False, "headless": True, "left": [], "returncode": -9,
                      "reaped": False}


def test_die_with_parent():
    child_code = PRELUDE + "c.die_with_parent(); print(flush=True); time.sleep(60)"
    result = run("""
        atexit.unregister(kill_leftovers)  # the child must die of this process's exit alone
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
        child.stdout.readline()  # it has asked to die with this process, which exits now
        print(json.dumps({"child": child.pid}))
    """, child_code)
    deadline = time.monotonic() + 5
    while containment.alive(result["child"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    survived = containment.alive(result["child"])
    if survived:
        os.kill(result["child"], signal.SIGKILL)
    assert not survived


def test_make_undumpable():
    result = run("""
        import ctypes
        prctl = ctypes.CDLL(None).prctl
        before = prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        c.make_undumpable()
        print(json.dumps([before, prctl(3, 0, 0, 0, 0)]))
    """)
    assert result == [1, 0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: every thread is on it")
def test_strays_are_the_threads_off_the_given_cpus():
    import threading

    allowed = sorted(os.sched_getaffinity(0))
    parked = threading.Event()
    ids: list[int] = []

    def park():
        ids.append(threading.get_native_id())
        parked.wait(10)

    thread = threading.Thread(target=park)
    thread.start()
    while not ids:
        time.sleep(0.01)
    try:
        assert containment.strays([os.getpid()], allowed) == []
        os.sched_setaffinity(ids[0], allowed[:1])
        assert containment.strays([os.getpid()], allowed) == [ids[0]]
        assert os.getpid() in containment.strays([os.getpid()], allowed[:1]), "the main thread is on all of them"
        assert containment.strays([2**22 + 7], allowed) == [], "a process that is gone has no threads"
    finally:
        parked.set()
        thread.join()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: every thread is on it")
def test_pin_holds_another_processes_threads_and_those_it_starts_after():
    cpu = max(os.sched_getaffinity(0))
    script = textwrap.dedent("""
        import os, sys, threading
        stop = threading.Event()
        threading.Thread(target=stop.wait).start()
        print("ready", flush=True)
        sys.stdin.readline()  # pinned by the test meanwhile
        threading.Thread(target=stop.wait).start()
        print(sorted({tuple(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}),
              len(os.listdir("/proc/self/task")), flush=True)
        stop.set()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert len(containment.strays([child.pid], [cpu])) >= 2, "not pinned yet: its threads are on every CPU"
        containment.pin([child.pid, 2**22 + 7], [cpu])  # a pid that is gone is passed over
        assert containment.strays([child.pid], [cpu]) == []
        child.stdin.write("\n")
        child.stdin.flush()
        held, threads = child.stdout.readline().split(" ")
        assert held == f"[({cpu},)]" and int(threads) >= 3, (held, threads)  # the main thread, early and late
    finally:
        child.kill()
        child.wait()


def test_lock_affinity_refuses_sched_setaffinity_to_the_process_its_threads_and_children():
    script = textwrap.dedent("""
        import os, subprocess, sys, threading
        from kforge.harness import containment
        before = os.sched_getaffinity(0)
        go = threading.Event()
        def move_later():
            go.wait()
            move("earlier thread")
        earlier = threading.Thread(target=move_later); earlier.start()
        print(containment.lock_affinity())
        def move(label):
            try:
                os.sched_setaffinity(0, before)
                print(label, "moved")
            except PermissionError:
                print(label, "EPERM")
        move("self")
        go.set(); earlier.join()
        thread = threading.Thread(target=move, args=("thread",)); thread.start(); thread.join()
        child = "import os\\ntry:\\n os.sched_setaffinity(0, os.sched_getaffinity(0)); print('child moved')\\n" \\
                "except PermissionError: print('child EPERM')"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
        print("read", os.sched_getaffinity(0) == before, "write", open(os.devnull, "w").write("x"))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    if out[0] != "True":
        pytest.skip("no seccomp filter on this machine")
    assert out[1:6] == ["self EPERM", "earlier thread EPERM", "thread EPERM", "child EPERM", "read True write 1"], out
