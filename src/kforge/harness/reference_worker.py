"""The reference's worker: the trusted half of an evaluation.

    python -m kforge.harness.reference_worker      (started by the judge, never by hand)

It imports the problem file and never the candidate's. It draws every input set (from
seeds only the judge knows), runs and times the reference, and compares the candidate's
outputs, which it reads from the shared mailbox. It starts before the candidate's
worker, in a process that worker cannot signal, trace or write into, so the reference
runs in the state it would have without the candidate: `state()` fingerprints that
state (torch's flags and mode stacks, hooks, default dtype, threads, the reference's
parameters) and the judge checks it after every stage.

Commands (JSON lines; see judge.py for the order they come in):

    setup     load the problem, build the reference, lay out and create the arena
    draw      a fresh input set: the candidate's copy into the arena, poisoned mailbox
    reference run the reference on its own copy (gate 1)
    compare   the candidate's claimed outputs and a mailbox against the reference's
    warm      warm the reference up; its host time sizes the GPU's rest before each call
    prepare   the round's inputs into this worker's own buffers; the device idle
    restore   the round's inputs into the arena again (a reference that changes its inputs in
              place: the candidate's second call of a round runs on them as drawn)
    time      one timed call of the reference on them, or of nothing ("null")
    state     the fingerprint, compared with the one taken at setup
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kforge.errors import KforgeError, ProblemError
from kforge.harness.channel import WorkerEnd, serve
from kforge.harness.correctness import (Comparison, arguments_equal, clone_arguments, compare_claimed,
                                        compare_inputs, outputs_finite)
from kforge.harness.defences import poison
from kforge.harness.loading import call_user, fp32_means_fp32, synchronize
from kforge.harness.problem import flatten_outputs, load_problem
from kforge.harness.shared import Arena, Layout, SharedError, describe, digest, rebuild, tensor_leaves, write_values
from kforge.harness.timing import call_timer, null_call, wake_host


MAILBOXES = 2  # the candidate's calls a round (judge.Judge._gate2)


class ReferenceWorker:
    def __init__(self, job: dict):
        from kforge.device import current_device

        self.job = job
        self.device = current_device(job["device"])
        self.dev = self.device.torch_device
        self.timer = None
        self.fingerprint: dict | None = None

    # --- setup -----------------------------------------------------------------------------

    def setup(self, init_seed: int, probe_seed: int) -> dict:
        job = self.job
        problem = self.problem = load_problem(job["problem"], job["size"])
        init_inputs = problem.init_inputs(init_seed, self.dev)
        model = problem.build_reference(init_inputs, init_seed, self.dev)
        self.model = model
        if job["baseline"] == "compile":
            self.model = call_user(torch.compile, model, error=ProblemError,
                                   stage="torch.compile of the reference failed", user_file=problem.path)
        with torch.no_grad():
            probe_inputs = problem.make_inputs(probe_seed, self.dev)
            probe_copy = clone_arguments(probe_inputs)
            probe_out = problem.run_reference(self.model, probe_copy)
        synchronize(self.dev)
        # Does the reference change its inputs in place? Then the candidate's worker must be
        # called on the arena's views, where the reference worker can see what it left.
        self.mutates_inputs = not arguments_equal(probe_copy, probe_inputs)
        del probe_copy

        layout = Layout()
        self.init_desc = describe(list(init_inputs), layout.place)
        self.input_desc = describe(list(probe_inputs), layout.place)
        mailbox = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in flatten_outputs(probe_out)
                   if isinstance(t, torch.Tensor)]
        # Two mailboxes: the candidate is timed twice a round, and either call's outputs may
        # be re-checked once the round is over.
        self.mailbox_descs = [describe(mailbox, layout.place) for _ in range(MAILBOXES)]
        self.arena = Arena.create(layout.size, self.dev, Path(job["arena_file"]))
        write_values(list(init_inputs), self.arena, self.init_desc)
        self.mailboxes = [[self.arena.view(spec) for spec in tensor_leaves(desc)] for desc in self.mailbox_descs]
        self.slot = rebuild(self.input_desc, self.arena)  # the candidate's copy of each input set
        # Each timed call's outputs are copied here, as the candidate's worker copies its own
        # into a mailbox: the two workers' protocols cost the judge's clock the same.
        self.twin = [torch.empty_like(m) for m in self.mailboxes[0]]

        flops = problem.count_flops(probe_inputs)
        nbytes = problem.count_bytes(probe_inputs, probe_out, model)
        self.timer = call_timer(self.device, flush_l2=False, judged=True)  # the judge flushes (judge.Judge._rest)
        self.fingerprint = self._fingerprint()
        return dict(
            problem={"name": problem.name, "size": problem.size, "tags": problem.tags},
            init=self.init_desc, inputs=self.input_desc, mailboxes=self.mailbox_descs, arena=self.arena.handle,
            flops=flops, bytes=nbytes, compute_dtype=problem.compute_dtype_for(probe_inputs),
            forbidden_ops=problem.forbidden_ops, tolerance=list(problem.tolerance_for(_first_dtype(probe_out))),
            rel_l2_bound=problem.rel_l2_for(_first_dtype(probe_out)), exposed_trials=problem.exposed_trials,
            mutates_inputs=self.mutates_inputs,
            cache_bytes=self.device.cache_bytes,
        )

    # --- one input set ---------------------------------------------------------------------

    def draw(self, seed: int, exposed: bool = False) -> dict:
        """A fresh input set under `seed` (an exposing one: problem.expose): pristine and own
        copies here, the candidate's in the arena."""
        inputs = self.problem.make_inputs(seed, self.dev, exposed=exposed)
        self.exposed = exposed
        try:
            described = describe(list(inputs), Layout().place)
        except SharedError as exc:
            raise ProblemError(f"get_inputs() returned what cannot be shared: {exc}") from None
        if described != self.input_desc:
            raise ProblemError("get_inputs() returned inputs of other shapes, dtypes or kinds than its first set")
        self.pristine = inputs
        self.mine = clone_arguments(inputs)
        self.left = None  # the arena's inputs as a candidate call left them, kept by `restore`
        write_values(list(inputs), self.arena, self.input_desc)
        for mailbox in self.mailboxes:  # an output the candidate never exports shows as poison
            poison(mailbox)
        self.out = None
        synchronize(self.dev)
        return {}

    def reference(self) -> dict:
        """Run the reference; `finite` says whether all its outputs are (an exposing draw
        on which they are not is outside the problem's domain)."""
        with torch.no_grad():
            self.out = self.problem.run_reference(self.model, self.mine)
        synchronize(self.dev)
        return {"finite": outputs_finite(self.out)}

    def compare(self, claims, digests, box: int = 0, restored: bool = False) -> dict:
        """The candidate's outputs (its claims about them, the values in mailbox `box`) and
        its inputs (the arena's copy must be as the reference left its own: the judge asks
        after the candidate's last call on them, or, with `restored`, of the copy `restore`
        kept of them before writing them back) checked here. The mailbox must still hold
        what the worker digested when it replied."""
        mailbox = self.mailboxes[box] if type(box) is int and box in range(MAILBOXES) else None
        if not (mailbox is not None and isinstance(digests, list) and len(digests) == len(mailbox)
                and all(type(d) is int for d in digests)):
            result = Comparison(ok=False, failure="structure",
                                reason="the candidate's worker did not say what its mailbox holds")
        elif restored and self.left is None:
            result = Comparison(ok=False, failure="structure", reason="no inputs were kept by a restore this round")
        elif digests != [digest(slot) for slot in mailbox]:
            result = Comparison(ok=False, failure="late_output", reason="the mailbox changed after the candidate's "
                                "worker replied: its outputs were written by work on no clock")
        else:
            left = self.left if restored else self.slot
            result = (compare_inputs(self.pristine, self.mine, left, self.problem, self.exposed)
                      or compare_claimed(self.out, claims, mailbox, self.problem, self.exposed))
        return {"comparison": result.to_dict()}

    # --- timing ------------------------------------------------------------------------------

    def warm(self, min_calls: int, seconds: float) -> dict:
        host_ms, count, started = [], 0, None
        with torch.no_grad():
            while True:
                self.mine = clone_arguments(self.pristine)
                host_ms.append(self.timer.run_untimed(lambda _: self.problem.run_reference(self.model, self.mine), ()))
                count += 1
                if started is None:  # the first call compiles; the warm-up clock starts after it
                    started = time.perf_counter()
                elif (count >= min_calls and time.perf_counter() - started >= seconds) or count >= 1000:
                    break
        self.mine = clone_arguments(self.pristine)
        return {"calls": count, "host_ms": statistics.median(host_ms[1:] or host_ms)}

    def prepare(self) -> dict:
        """Before each timed call, as the candidate's worker does: the round's inputs copied
        afresh into this worker's buffers (the A/A call runs on the same draw, and a
        reference may change its inputs in place), and the device idle."""
        for mine, pristine in zip(self.mine, self.pristine):
            if isinstance(mine, torch.Tensor):
                mine.copy_(pristine)
        synchronize(self.dev)
        return {}

    def restore(self) -> dict:
        """The round's inputs written into the arena again, as `draw` left them; what the
        candidate's call left there is kept first, for `compare(restored=True)`: else the
        in-place result of a round's first call would go unchecked, and a candidate that
        counts its calls could skip that write on every first call."""
        self.left = clone_arguments(self.slot)
        write_values(list(self.pristine), self.arena, self.input_desc)
        synchronize(self.dev)
        return {}

    def time(self, null: bool = False) -> dict:
        with torch.no_grad():
            if null:
                clocks, _ = self.timer.time_call(null_call, ())
            else:
                wake_host()
                clocks, self.out = self.timer.time_call(lambda _: self.model(*self.mine), ())
                for twin, t in zip(self.twin, [t for t in flatten_outputs(self.out) if isinstance(t, torch.Tensor)]):
                    twin.copy_(t)
                [digest(twin) for twin in self.twin]  # noqa: B018  (the candidate's worker digests its mailbox)
                synchronize(self.dev)
        return {"clocks": list(clocks)}

    # --- the reference's own state ---------------------------------------------------------

    def state(self) -> dict:
        now = self._fingerprint()
        changed = sorted(k for k in now if now[k] != self.fingerprint.get(k))
        return {"changed": changed}

    def _fingerprint(self) -> dict:
        cuda = torch.backends.cuda.matmul
        state = {
            "grad_enabled": torch.is_grad_enabled(),
            "default_dtype": str(torch.get_default_dtype()),
            "threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "matmul.allow_tf32": cuda.allow_tf32,
            "matmul.fp16_reduced": cuda.allow_fp16_reduced_precision_reduction,
            "matmul.bf16_reduced": cuda.allow_bf16_reduced_precision_reduction,
            "cudnn": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                      torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "torch_function_modes": torch._C._len_torch_function_stack(),
            "dispatch_modes": torch._C._len_torch_dispatch_stack(),
            "profile_hook": sys.getprofile() is not None,
            "trace_hook": sys.gettrace() is not None,
            # parameters, not buffers: a forward may update its buffers itself (BatchNorm's
            # running statistics in training mode)
            "parameters": _checksum(list(self.model.parameters()))
            if isinstance(self.model, torch.nn.Module) else None,
        }
        return {k: json.dumps(v) for k, v in state.items()}


def _checksum(tensors) -> str:
    """Where each tensor lives, its shape and the digest of its bits: zeroing, scaling or
    moving a weight changes it, and no temporary larger than the tensor is made."""
    text = ";".join(f"{t.data_ptr()}:{tuple(t.shape)}:{digest(t.detach().contiguous())}" for t in tensors)
    return hashlib.sha256(text.encode()).hexdigest()


def _first_dtype(out) -> torch.dtype:
    first = next((t for t in flatten_outputs(out) if isinstance(t, torch.Tensor)), None)
    return first.dtype if first is not None else torch.float32


def error_reply(exc: Exception) -> dict:
    if isinstance(exc, KforgeError):
        return {"error": {"kind": "problem_error", "reason": exc.reason, "details": exc.details or None}}
    from kforge.errors import describe_exception, error_kind

    if error_kind(exc) == "oom":  # not a bug: the judge holds several copies of the inputs and outputs
        summary, details = describe_exception(exc)
        return {"error": {"kind": "oom", "reason": "the reference worker ran out of memory holding the problem's "
                                                   f"inputs and outputs (docs/harness.md): {summary}",
                          "details": details}}
    import traceback

    return {"error": {"kind": "crash", "reason": f"the reference worker failed inside kforge (a bug): "
                                                 f"{type(exc).__name__}: {exc}", "details": traceback.format_exc()}}


def main() -> int:
    from kforge.harness.containment import die_with_parent, lock_affinity, make_undumpable

    die_with_parent()
    make_undumpable()
    job = json.loads(sys.stdin.readline())
    if job.get("lock_affinity"):  # as the candidate's worker is: both sides' system calls cost the same
        lock_affinity()
    end = WorkerEnd(job["command_fd"], job["reply_fd"])
    import kforge  # noqa: F401  (chooses Triton's mode before anything imports triton)
    from kforge.device import library_versions
    from kforge.runtime.interpreter import interpreter_active, mend_interpreter

    worker = ReferenceWorker(job)
    fp32_means_fp32()
    if not worker.device.is_cuda:
        # Two workers and the judge share the CPU: an OpenMP pool waiting for a busy core
        # costs milliseconds a call, so each worker computes on one thread.
        torch.set_num_threads(1)
        if interpreter_active():
            mend_interpreter()
    end.reply(hello={"device": worker.device.to_dict(), "versions": library_versions()})
    serve(end, {name: getattr(worker, name) for name in
                ("setup", "draw", "reference", "compare", "warm", "prepare", "restore", "time", "state")},
          error_reply)
    return 0


if __name__ == "__main__":
    import os

    status = main()
    sys.stdout.flush()
    os._exit(status)
