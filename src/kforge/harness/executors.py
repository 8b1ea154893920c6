"""Where a suite's pairs are evaluated: this machine's GPUs, or a Ray cluster.

    LocalExecutor(slots=[0, 1])            one worker per local GPU (None: the CPU) at a time
    RayExecutor(address="10.0.0.1:6379")   one judge per slot of the cluster, a pair at a time

Either way each pair is judged by `evaluate_isolated` (isolation.py), in fresh worker
processes with the judge's per-stage deadlines, and each record is handed back to the one
caller that writes the store (suite.py): the executors evaluate, they never write.

A problem that declares `GPUS = N` (problem.py) holds N GPUs of one machine for its pair,
its workers seeing those alone: N local slots taken together, or on Ray a placement group
of N one-GPU bundles packed on one node (`RayExecutor.run`). A pair needing more GPUs than
any one machine has is recorded as a `problem_error` saying so, never left waiting; every
record says how many GPUs its pair held (`device.gpus`, record.gpus_used).

The Ray executor starts one judge per slot of the cluster (a Ray actor holding `resources`,
default one GPU: as many as the nodes' resources hold) and hands each a pair at a time:

- the judge's process runs only kforge's code, as the local executor's threads do; each
  candidate still runs in fresh worker processes of its own, started for its pair. Keeping
  the judge saves each pair a Ray worker's start, torch's import and a CUDA context (about
  2.5 s a pair on an H200 when every pair had its own Ray worker); a judge whose CUDA context
  stops working exits before its next pair, and is replaced;
- ships the problem's and the candidate's files by content, written to a temporary folder
  on the node (no shared filesystem), and keeps the driver's paths in the record;
- refuses a node whose kforge harness differs from the driver's (`harness_fingerprint`)
  or whose device is not the suite's (a suite's speedups compare one kind of device);
- retries a pair whose judge died (the node, or the Ray worker under the judge) once, on a
  new judge; a second death becomes a `crash` record (`oom` when Ray's memory monitor
  killed it).
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kforge.errors import KforgeError
from kforge.harness.record import EvalRecord

RAY_MISSING = "the Ray executor needs ray: pip install 'kforge[ray]'"
RETRIES = 1  # a pair whose task dies is run once more, then recorded as a crash
POLL_S = 0.5  # how often the driver looks for started pairs while it waits for results


@dataclass(frozen=True)
class Placement:
    """Where one attempt at a pair runs: a node (None: this machine), a GPU (None: the CPU),
    and the process the judge runs in (None: the caller's)."""

    gpu: int | None = None
    node: str | None = None
    pid: int | None = None
    attempt: int = 1  # 2: the retry after the first attempt's process died
    gpus: tuple[int, ...] = ()  # every GPU the pair holds, `gpu` first (none on the CPU)

    def __str__(self) -> str:
        where = "the CPU" if self.gpu is None else f"GPU {self.gpu}"
        if len(self.gpus) > 1:
            where = "GPUs " + ", ".join(map(str, self.gpus))
        if self.node is not None:
            where += f" of {self.node}"
        return where + (f" (attempt {self.attempt})" if self.attempt > 1 else "")


@dataclass(frozen=True)
class Job:
    """One pair to evaluate, with the key its record must carry."""

    name: str
    problem: Path
    candidate: Path
    key: str
    gpus: int = 1  # what its problem declares (problem.declared_gpus)


OnStart = Callable[[Job, Placement], None]
OnRecord = Callable[[Job, EvalRecord], None]
Evaluate = Callable[[Path, Path], EvalRecord]


class Executor(ABC):
    """Evaluates jobs and hands each record to `on_record`, in the caller's process."""

    @property
    @abstractmethod
    def device_name(self) -> str:
        """The device the pairs are keyed by (every record's pair key carries it)."""

    @abstractmethod
    def run(self, jobs: Sequence[Job], *, options: dict, device_name: str, on_start: OnStart | None,
            on_record: OnRecord) -> None:
        """Evaluate every job with evaluate_isolated(**options); `on_record` is the only way
        out for a record. An exception from `on_record` (an interrupt) stops the run."""

    @abstractmethod
    def evaluator(self, *, options: dict, device_name: str) -> AbstractContextManager[Evaluate]:
        """For callers that judge pairs as they come (the machine loop): a thread-safe
        evaluate(problem, candidate) -> record, one pair per slot at a time, the slots held
        until the context ends."""

    @property
    @abstractmethod
    def slot_count(self) -> int:
        """How many pairs run at once."""

    def close(self) -> None:
        """Release what the executor holds (a Ray connection it made)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalExecutor(Executor):
    """This machine: one thread per slot, each running one pair at a time on its GPU; a pair
    whose problem declares GPUS = N takes N slots at once (`_Slots`). On the CPU (slots of
    None) there are no GPUs to share out, so every pair takes one slot whatever it declares."""

    def __init__(self, slots: Sequence[int | None], device_name: str | None = None):
        self.slots = list(slots) or [None]
        self._device_name = device_name
        self.on_cpu = self.slots[0] is None
        if any((slot is None) != self.on_cpu for slot in self.slots):
            raise KforgeError(f"a LocalExecutor's slots are GPUs or the CPU (None), not both: {self.slots}")

    @property
    def device_name(self) -> str:
        if self._device_name is None:
            raise KforgeError("LocalExecutor needs the device name of its slots")
        return self._device_name

    def run(self, jobs, *, options, device_name, on_start, on_record) -> None:
        with self.evaluator(options=options, device_name=device_name, on_start=on_start) as evaluate:
            def judge(job: Job) -> None:
                on_record(job, evaluate(job.problem, job.candidate, job))

            with ThreadPoolExecutor(max_workers=len(self.slots)) as pool:
                for future in [pool.submit(judge, job) for job in jobs]:
                    future.result()

    @property
    def slot_count(self) -> int:
        return len(self.slots)

    @contextmanager
    def evaluator(self, *, options: dict, device_name: str, on_start: OnStart | None = None) -> Iterator[Evaluate]:
        from kforge.harness.isolation import evaluate_isolated
        from kforge.harness.problem import declared_gpus

        slots = _Slots(self.slots)

        def evaluate(problem: Path, candidate: Path, job: Job | None = None) -> EvalRecord:
            needed = 1 if self.on_cpu else (job.gpus if job is not None else declared_gpus(problem))
            if needed > len(self.slots):
                have = ", ".join(map(str, self.slots))
                return unplaced_record(problem, candidate, options, device_name, needed,
                                       f"the problem declares GPUS = {needed}, and the suite runs on {len(self.slots)} "
                                       f"GPU(s) of this machine ({have}): give it {needed} (--gpus) where there are")
            held = slots.take(needed)
            gpus = () if self.on_cpu else tuple(held)
            try:
                if on_start and job is not None:
                    on_start(job, Placement(gpu=held[0], gpus=gpus))
                record = evaluate_isolated(problem, candidate, gpu=held[0], gpus=gpus, device_name=device_name,
                                           **options)
            finally:
                slots.give(held)
            record.device["gpus"] = len(gpus)
            return record

        yield evaluate


class _Slots:
    """A LocalExecutor's free slots, taken N at a time in the order the executor lists them
    (so a pair of GPUs 0 and 1 sees them as its devices 0 and 1), first come, first served:
    a pair waiting for N slots holds back the pairs behind it, which would otherwise take each
    slot as it came free and leave it waiting for ever."""

    def __init__(self, slots: Sequence[int | None]):
        self.order = list(slots)
        self.free = list(slots)
        self.queue: deque[object] = deque()  # a token per pair waiting, in arrival order
        self.changed = threading.Condition()

    def take(self, count: int) -> list[int | None]:
        token = object()
        with self.changed:
            self.queue.append(token)
            self.changed.wait_for(lambda: self.queue[0] is token and len(self.free) >= count)
            self.queue.popleft()
            taken = sorted(self.free, key=self.order.index)[:count]
            for slot in taken:
                self.free.remove(slot)
            self.changed.notify_all()  # the next in the queue may fit in what is left
        return taken

    def give(self, slots: Sequence[int | None]) -> None:
        with self.changed:
            self.free.extend(slots)
            self.changed.notify_all()


# --- Ray --------------------------------------------------------------------------------

def parse_resources(text: str) -> dict[str, float]:
    """"GPU=1,CPU=2,h100=1" -> the Ray resources one pair's task holds."""
    resources: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, amount = part.partition("=")
        try:
            value = float(amount) if sep else 1.0
        except ValueError:
            value = -1.0
        if not name.strip() or value <= 0:
            raise KforgeError(f"--ray-resources takes NAME=AMOUNT pairs separated by commas (GPU=1,CPU=2), "
                              f"got {part!r}")
        resources[name.strip()] = value
    if not resources:
        raise KforgeError("--ray-resources is empty: each pair's task must hold something (GPU=1)")
    return resources


def harness_fingerprint(folder: Path | None = None) -> str:
    """A hash of kforge's version and the judge's source files (those of `folder`, default
    kforge's harness): two processes with the same fingerprint judge a pair the same way."""
    from kforge import __version__

    digest = hashlib.sha256(__version__.encode())
    for path in sorted((folder or Path(__file__).parent).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def suite_device(names: dict[str, str], mix_devices: bool) -> str:
    """The device name a suite's pairs are keyed by, from each node's device
    ({node: name}); nodes of different devices only with `mix_devices`."""
    distinct = sorted(set(names.values()))
    if not distinct:
        raise KforgeError("no node of the Ray cluster can run a pair")
    if len(distinct) == 1:
        return distinct[0]
    if not mix_devices:
        where = "; ".join(f"{name}: {', '.join(sorted(n for n, d in names.items() if d == name))}"
                          for name in distinct)
        raise KforgeError(f"the Ray cluster mixes devices ({where}): their speedups do not belong in one fast_p. "
                          "Pin the pairs to one kind with --ray-resources (a custom resource its nodes have), "
                          "or pass --mix-devices")
    return " + ".join(distinct)


@dataclass(frozen=True)
class Shipped:
    """A pair as it travels to a node: both files' names and bytes, and the paths the
    record should name (the driver's)."""

    index: int
    problem_name: str
    problem_bytes: bytes
    candidate_name: str
    candidate_bytes: bytes
    problem_path: str | None
    candidate_path: str | None


@dataclass(frozen=True)
class Refused:
    """What a task returns instead of a record when its node must not judge the pair."""

    node: str
    reason: str


@dataclass(frozen=True)
class Started:
    index: int
    node: str
    gpu: int | None
    pid: int
    gpus: tuple[int, ...] = ()  # all the pair's GPUs, `gpu` first


def visible_device_name() -> str:
    """The device a pair evaluated in this process would run on: the first visible GPU
    (Ray sets CUDA_VISIBLE_DEVICES to the task's), else the CPU."""
    import torch

    from kforge.device import current_device

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else current_device("cpu").name


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _probe_node() -> tuple[str, str, str]:
    """(node, device name, harness fingerprint) of the node this task runs on."""
    return _node_ip(), visible_device_name(), harness_fingerprint()


class PairJudge:
    """A Ray actor: one slot of the cluster, judging the pairs it is handed one after another."""

    def describe(self) -> tuple[str, str, str]:
        """(node, device name, harness fingerprint); also imports torch before the first pair."""
        return _probe_node()

    def judge(self, job: Shipped, options: dict, device_name: str, check_device: bool, fingerprint: str,
              events, leases: Sequence = ()) -> EvalRecord | Refused:
        """`leases`: the GpuLease actors holding the pair's other GPUs, for a pair of several."""
        _exit_if_context_broken()
        return _evaluate_shipped(job, options, device_name, check_device, fingerprint, events, leases)


class GpuLease:
    """A Ray actor on one bundle of a multi-GPU pair's placement group, other than its judge's.
    Ray hands a bundle's GPU to what runs in it, and tells only that process which GPU it
    is: the lease holds the GPU for the pair's judge and says which it is."""

    def gpu(self) -> int | str:
        import ray

        return ray.get_gpu_ids()[0]


def _exit_if_context_broken() -> None:
    """A judge whose CUDA context no longer works (a GPU error its own process saw) must not
    judge another pair: the actor exits, and the driver retries the pair on a new one."""
    import torch

    if not torch.cuda.is_initialized():
        return
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        import ray

        ray.actor.exit_actor()


def _evaluate_shipped(job: Shipped, options: dict, device_name: str, check_device: bool, fingerprint: str,
                      events, leases: Sequence) -> EvalRecord | Refused:
    """The task: write the shipped files on this node, judge them, return the record."""
    import ray

    from kforge.harness.isolation import evaluate_isolated

    node = _node_ip()
    # The judge's own GPU first: its CUDA context is on its process's device 0 (Ray shows it
    # that GPU alone), and the workers' device 0 must be the same GPU.
    gpus = [str(gpu) for gpu in [*ray.get_gpu_ids(), *ray.get([lease.gpu.remote() for lease in leases])]]
    indices = tuple(int(gpu) for gpu in gpus if gpu.isdigit())
    gpu = indices[0] if indices else None
    if events is not None:  # the driver's progress display; it is not needed for the record
        try:
            events.put_nowait(Started(job.index, node, gpu, os.getpid(), indices))
        except Exception:  # noqa: BLE001  (a full or lost queue costs a progress line, not the pair)
            pass
    mine = harness_fingerprint()
    if mine != fingerprint:
        return Refused(node, f"its kforge harness ({mine}) is not the driver's ({fingerprint}): install the same "
                             "kforge on every node")
    device = visible_device_name()
    if check_device and device != device_name:
        return Refused(node, f"its device is {device}, the suite's {device_name}: pin the pairs to one kind of node "
                             "with --ray-resources, or pass --mix-devices")
    folder = Path(tempfile.mkdtemp(prefix="kforge-pair-"))
    try:
        problem, candidate = folder / "problem" / job.problem_name, folder / "candidate" / job.candidate_name
        for path, data in ((problem, job.problem_bytes), (candidate, job.candidate_bytes)):
            path.parent.mkdir()
            path.write_bytes(data)
        # gpu=None: one GPU, the workers inherit CUDA_VISIBLE_DEVICES as Ray set it for this
        # judge; several, they see the judge's and its leases', which Ray set for no process
        record = evaluate_isolated(problem, candidate, gpu=None, gpus=gpus if leases else (),
                                   device_name=device_name, **options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record.device["gpus"] = len(gpus)
    record.problem["path"] = job.problem_path
    record.candidate["path"] = job.candidate_path
    return record


class RayExecutor(Executor):
    """A Ray cluster: one judge per slot, holding `resources` (module docstring).

    `address`: the cluster's ("auto": the one this machine belongs to); None starts a local
    Ray instance for the run. A process already connected to Ray (`ray.init`) uses that
    connection and keeps it. `mix_devices`: allow nodes of different devices in one suite.
    """

    def __init__(self, address: str | None = None, resources: dict[str, float] | None = None,
                 mix_devices: bool = False):
        try:
            import ray
        except ImportError:
            raise KforgeError(RAY_MISSING) from None
        self.ray = ray
        self.address = address
        self.resources = dict(resources or {"GPU": 1.0})
        self.mix_devices = mix_devices
        self._connected_here = False
        self._nodes: dict[str, str] | None = None
        self._judges: list | None = None  # the PairJudge actors, one per slot, while a run needs them
        self.fingerprint = harness_fingerprint()

    # -- the cluster ------------------------------------------------------------------------

    def connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        if self.address is None:
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="warning")
        else:
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level="warning")
            except ConnectionError as exc:  # no cluster there (Ray's message names where it looked)
                raise KforgeError(f"--address {self.address}: no Ray cluster to join ({' '.join(str(exc).split())}); "
                                  "start one with `ray start --head`, or leave --address out for a local one") \
                    from None
        self._connected_here = True

    def close(self) -> None:
        if self.ray.is_initialized():
            self._stop_judges()
        if self._connected_here and self.ray.is_initialized():
            self.ray.shutdown()
        self._connected_here = False

    def _able_nodes(self) -> list[dict]:
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        able = [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in self.resources.items())]
        if not able:
            wanted = ", ".join(f"{k}={v:g}" for k, v in self.resources.items())
            raise KforgeError(f"no node of the Ray cluster has {wanted} for a pair ({_offered(nodes)}); "
                              "on a cluster without GPUs pass --ray-resources CPU=1")
        return able

    def _slots(self, node: dict) -> int:
        """How many pairs' resources this node holds at once."""
        return int(min(node["Resources"].get(k, 0.0) // v for k, v in self.resources.items()))

    def _new_judge(self, node_id: str | None = None):
        options = dict(max_restarts=0, **_actor_options(self.resources))
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return self.ray.remote(**options)(PairJudge).remote()

    def _start_judges(self) -> list:
        if self._judges is None:
            self.connect()
            self._judges = [self._new_judge(n["NodeID"]) for n in self._able_nodes() for _ in range(self._slots(n))]
        return self._judges

    def _replace(self, judge):
        """A new judge for one that died (anywhere with a slot free: its node may be gone)."""
        self.ray.kill(judge)
        self._judges.remove(judge)
        self._judges.append(self._new_judge())
        return self._judges[-1]

    def _stop_judges(self) -> None:
        for judge in self._judges or []:
            self.ray.kill(judge)
        self._judges = None

    # -- pairs of several GPUs --------------------------------------------------------------

    def _gpus_for(self, job: Job) -> int:
        """The GPUs a pair holds: its problem's GPUS, where the judges hold GPUs; on a cluster
        whose judges hold none (--ray-resources CPU=1) every pair runs on a plain judge."""
        return job.gpus if self.resources.get("GPU") else 1

    def _bundle(self) -> dict[str, float]:
        """One GPU of a multi-GPU pair's placement group: a whole GPU, and what a judge holds
        besides (a CPU unless --ray-resources names an amount; the resources pinning pairs to
        nodes), so a pair of N GPUs holds what N single-GPU judges would."""
        return {**self.resources, "GPU": 1.0, "CPU": self.resources.get("CPU", 1.0)}

    def _gang_capacity(self, gpus: int) -> int:
        """How many pairs of `gpus` GPUs the cluster's nodes hold at once, each on one node."""
        bundle = self._bundle()
        return sum(int(min(n["Resources"].get(k, 0.0) // (gpus * v) for k, v in bundle.items()))
                   for n in self.ray.nodes() if n.get("Alive"))

    def _open_gang(self, gpus: int) -> _Seat:
        from ray.util.placement_group import placement_group

        # STRICT_PACK: all the pair's GPUs on one node, where they share NVLink
        seat = _Seat(group=placement_group([self._bundle()] * gpus, strategy="STRICT_PACK"))
        self._seat_gang(seat)
        return seat

    def _seat_gang(self, seat: _Seat) -> None:
        """A judge on the group's first bundle and a lease on each other (Ray runs an actor
        within one bundle: none sees all the group's GPUs by itself)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def on(bundle: int) -> dict:
            return dict(max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                seat.group, placement_group_bundle_index=bundle))

        seat.judge = self.ray.remote(**_actor_options(self._bundle()), **on(0))(PairJudge).remote()
        seat.leases = [self.ray.remote(num_gpus=1, num_cpus=0, **on(bundle))(GpuLease).remote()
                       for bundle in range(1, seat.group.bundle_count)]

    def _reseat(self, seat: _Seat) -> None:
        """New actors for a seat whose judge died: a single GPU's anywhere, a gang's in its
        placement group (which Ray moves to another node if its node was lost)."""
        if seat.group is None:
            seat.judge = self._replace(seat.judge)
            return
        for actor in [seat.judge, *seat.leases]:
            self.ray.kill(actor)
        self._seat_gang(seat)

    def _close_gang(self, seat: _Seat) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in [seat.judge, *seat.leases]:
            self.ray.kill(actor)
        remove_placement_group(seat.group)

    def _unplaceable(self, gpus: int) -> str:
        bundle = ", ".join(f"{k}={v:g}" for k, v in self._bundle().items())
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        return (f"the problem declares GPUS = {gpus}, and no node of the Ray cluster holds {gpus} bundles of "
                f"{bundle} ({_offered(nodes)}): run it on a cluster with a node of {gpus} GPUs")

    def nodes(self) -> dict[str, str]:
        """{node address: device name} of every node able to run a pair, as its judges describe
        it. Refuses a node whose harness is not ours."""
        if self._nodes is None:
            found = {}
            for node, device, fingerprint in self.ray.get([j.describe.remote() for j in self._start_judges()]):
                if fingerprint != self.fingerprint:
                    self._stop_judges()
                    raise KforgeError(f"node {node} runs another kforge harness ({fingerprint}, the driver "
                                      f"{self.fingerprint}): install the same kforge on every node")
                found[node] = device
            self._nodes = found
        return self._nodes

    @property
    def device_name(self) -> str:
        return suite_device(self.nodes(), self.mix_devices)

    @property
    def slot_count(self) -> int:
        return len(self._start_judges())

    @contextmanager
    def evaluator(self, *, options: dict, device_name: str) -> Iterator[Evaluate]:
        """Each call takes a free judge (waiting for one), as `run` hands out pairs; a judge that
        dies under a pair is replaced and the pair tried once more, then recorded as `crash`.
        Single-GPU pairs only: its judges hold every GPU until the context ends."""
        from ray.exceptions import RayError, RayTaskError

        from kforge.harness.problem import declared_gpus

        ray = self.ray
        idle: queue.Queue = queue.Queue()
        for judge in self._start_judges():
            idle.put(judge)
        shared, lock = ray.put(options), threading.Lock()

        def evaluate(problem: Path, candidate: Path) -> EvalRecord:
            job = Job(candidate.name, Path(problem), Path(candidate), key="", gpus=declared_gpus(problem))
            if self._gpus_for(job) > 1:
                raise KforgeError(f"{Path(problem).name} declares GPUS = {job.gpus}: the Ray executor places "
                                  "multi-GPU pairs in a suite (kforge suite), not yet one at a time as they come")
            for attempt in range(1 + RETRIES):
                judge = idle.get()
                try:
                    result = ray.get(judge.judge.remote(ship(attempt, job), shared, device_name, not self.mix_devices,
                                                        self.fingerprint, None))
                except RayTaskError as exc:
                    idle.put(judge)
                    raise _node_error(exc) from exc
                except RayError as exc:
                    with lock:
                        idle.put(self._replace(judge))
                    died = exc
                    continue
                idle.put(judge)
                if isinstance(result, Refused):
                    raise KforgeError(f"node {result.node} cannot judge {job.name}: {result.reason}")
                return result
            return died_record(job, options, device_name, died, _death_status(died), None, 1)

        try:
            yield evaluate
        finally:
            self._stop_judges()

    # -- the run ----------------------------------------------------------------------------

    def run(self, jobs, *, options, device_name, on_start, on_record) -> None:
        """The pairs by how many GPUs each holds, fewest first, each size on judges of its own:
        the single-GPU pairs on the judges the device probe started, one a GPU slot; then,
        for each N > 1, those judges stopped and as many placement groups of N bundles as the
        nodes hold (no more than the pairs), each with its judge, reused for the size's pairs
        and removed after them. A size waits only for GPUs no judge of the run still holds,
        so no pair waits on another's GPUs for ever; the price: GPUs idle while a size's
        last pairs finish. A size no node can hold is recorded, pair by pair, at once."""
        from ray.exceptions import RayError, RayTaskError
        from ray.util.queue import Queue

        ray = self.ray
        events = Queue(actor_options={"num_cpus": 0}) if on_start else None
        shared = ray.put(options)
        by_index = dict(enumerate(jobs))
        by_size: dict[int, list[int]] = {}
        for index, job in by_index.items():
            by_size.setdefault(self._gpus_for(job), []).append(index)
        tries: Counter[int] = Counter()
        starts: Counter[int] = Counter()
        last_node: dict[int, str] = {}

        def drain() -> None:
            while events is not None:
                try:
                    started = events.get_nowait()
                except queue.Empty:
                    return
                except Exception:  # noqa: BLE001  (the queue's actor is gone: no more progress lines)
                    return
                starts[started.index] += 1
                last_node[started.index] = started.node
                on_start(by_index[started.index], Placement(started.gpu, started.node, started.pid,
                                                            starts[started.index], started.gpus))

        def judge_all(indices: list[int], seats: list[_Seat], gpus: int) -> None:
            idle, waiting = list(seats), deque(indices)
            running: dict = {}  # the pair's result -> (its index, the seat running it)
            while waiting or running:
                while waiting and idle:
                    index, seat = waiting.popleft(), idle.pop()
                    tries[index] += 1
                    ref = seat.judge.judge.remote(ship(index, by_index[index]), shared, device_name,
                                                  not self.mix_devices, self.fingerprint, events, seat.leases)
                    running[ref] = (index, seat)
                drain()
                ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
                drain()
                for ref in ready:
                    index, seat = running.pop(ref)
                    job = by_index[index]
                    idle.append(seat)
                    try:
                        result = ray.get(ref)
                    except RayTaskError as exc:  # kforge raised on the node: raised here, as locally
                        raise _node_error(exc) from exc
                    except RayError as exc:  # the judge died under the pair: a new judge, the pair once more
                        self._reseat(seat)
                        if tries[index] <= RETRIES:
                            waiting.appendleft(index)
                            continue
                        result = died_record(job, options, device_name, exc, _death_status(exc),
                                             last_node.get(index), gpus)
                    if isinstance(result, Refused):
                        raise KforgeError(f"node {result.node} cannot judge {job.name}: {result.reason}")
                    on_record(job, result)

        try:
            for gpus, indices in sorted(by_size.items()):
                if gpus == 1:
                    judge_all(indices, [_Seat(judge) for judge in self._start_judges()], 1)
                    continue
                self._stop_judges()  # their GPUs, for the groups
                count = min(self._gang_capacity(gpus), len(indices))
                if not count:
                    for index in indices:
                        job = by_index[index]
                        on_record(job, unplaced_record(job.problem, job.candidate, options, device_name, gpus,
                                                       self._unplaceable(gpus)))
                    continue
                seats = []
                try:
                    seats.extend(self._open_gang(gpus) for _ in range(count))
                    judge_all(indices, seats, gpus)
                finally:
                    for seat in seats:
                        self._close_gang(seat)
        finally:
            # an interrupt, a refusal, or the end: nothing keeps running or holding a GPU for a store no one writes
            self._stop_judges()
            if events is not None:
                events.shutdown()


@dataclass
class _Seat:
    """Where the run hands a pair: a judge, and for a pair of several GPUs the placement group
    holding them and the leases on its GPUs other than the judge's."""

    judge: object = None
    group: object = None
    leases: list = field(default_factory=list)


def _actor_options(resources: dict[str, float]) -> dict:
    """Ray's actor options for a judge holding `resources`."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    options = dict(num_gpus=resources.get("GPU", 0.0))
    if custom:
        options["resources"] = custom
    if "CPU" in resources:
        options["num_cpus"] = resources["CPU"]
    return options


def _offered(nodes: list[dict]) -> str:
    """What each node offers, for an error message."""
    return "; ".join(f"{n['NodeManagerAddress']}: " + ", ".join(
        f"{k}={v:g}" for k, v in sorted(n["Resources"].items())
        if not k.startswith(("node:", "memory", "object_store")))
        for n in nodes) or "no node"


def _death_status(exc: Exception) -> str:
    """A pair's status when its judge died twice: `oom` when Ray's memory monitor ended it (an
    actor's death says so only in words), else `crash`."""
    from ray.exceptions import OutOfMemoryError

    text = str(exc).lower()
    killed = "low on memory" in text or "memory pressure" in text or "out of memory" in text
    return "oom" if isinstance(exc, OutOfMemoryError) or killed else "crash"


def _node_error(exc) -> BaseException:
    """What kforge raised on the node (an unusable file, a bug), to raise here as locally."""
    return exc.cause if isinstance(exc.cause, BaseException) else exc


def ship(index: int, job: Job) -> Shipped:
    from kforge.harness.evaluate import identity

    return Shipped(index, job.problem.name, job.problem.read_bytes(), job.candidate.name, job.candidate.read_bytes(),
                   identity(job.problem)["path"], identity(job.candidate)["path"])


def died_record(job: Job, options: dict, device_name: str, exc: Exception, status: str,
                node: str | None, gpus: int) -> EvalRecord:
    """The record of a pair whose task died on both attempts (the judge could write none)."""
    from kforge.harness.evaluate import identity

    first = str(exc).strip().splitlines()
    where = f" on {node}" if node else ""
    reason = (f"the Ray worker judging this pair died{where} on each of its {1 + RETRIES} attempts "
              f"({type(exc).__name__}: {first[0][:300] if first else 'no reason given'})")
    return EvalRecord(status=status, reason=reason, details=str(exc)[-4000:] or None, problem=identity(job.problem),
                      candidate=identity(job.candidate), device={"kind": "unknown", "name": device_name, "gpus": gpus},
                      versions={}, baseline=options.get("baseline", "eager"), pair_key=job.key or None)


def unplaced_record(problem: Path, candidate: Path, options: dict, device_name: str, gpus: int,
                    reason: str) -> EvalRecord:
    """The record of a pair no machine of the executor can hold (its problem's GPUS): a
    problem_error, as for a problem that cannot run, since the candidate is not at fault.
    Its device names the GPUs it needed (`gpus_needed`), so a later run tries it again
    (`was_placed`): on a bigger machine it may fit."""
    from kforge.harness.evaluate import identity, pair_key

    problem_id, candidate_id = identity(problem), identity(candidate)
    baseline = options.get("baseline", "eager")
    return EvalRecord(status="problem_error", reason=reason, problem=problem_id, candidate=candidate_id,
                      device={"kind": "unknown", "name": device_name, "gpus": 0, "gpus_needed": gpus}, versions={},
                      baseline=baseline, pair_key=pair_key(problem_id["sha256"], candidate_id["sha256"], baseline,
                                                            options.get("size"), device_name))


def was_placed(record: dict) -> bool:
    """Whether a stored record's pair ran (or was meant to): False for `unplaced_record`'s."""
    return "gpus_needed" not in (record.get("device") or {})


__all__ = ["Executor", "GpuLease", "Job", "LocalExecutor", "PairJudge", "Placement", "RayExecutor",
           "harness_fingerprint", "parse_resources", "suite_device", "was_placed"]
