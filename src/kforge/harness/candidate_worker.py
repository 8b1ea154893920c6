"""The candidate's worker: the untrusted half of an evaluation.

    started by the warden (warden.py), confined before this module runs, never by hand

It imports the candidate file and nothing of the problem's: it learns the constructor's
arguments and each input set only as views into the arena the reference worker lends it
(shared.py), and hands its outputs back by copying them into the arena's mailbox. Every
reply it sends is a claim. The judge believes none of them about correctness (the
reference worker compares the mailbox) and checks its timings against its own clock.

Commands (JSON lines; judge.py sends them):

    load      import the candidate, build ModelNew under the reference's init seed
    call      one untimed call on the current inputs; outputs into the mailbox (gate 1)
    warm      untimed calls until warm (compilation and autotuning happen here)
    prepare   the round's inputs into the worker's own buffers; the device idle
    time      one timed call on them; its clocks, then its outputs into the mailbox the judge
              names (the candidate is timed twice a round, one mailbox a call)
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from contextlib import nullcontext

import torch

from kforge.errors import KforgeError
from kforge.harness.channel import WorkerEnd, serve
from kforge.harness.correctness import clone_arguments, describe_output
from kforge.harness.defences import OpRecorder
from kforge.harness.loading import fp32_means_fp32, synchronize
from kforge.harness.problem import flatten_outputs
from kforge.harness.shared import Arena, digest, rebuild, tensor_leaves
from kforge.harness.timing import wake_host


class CandidateWorker:
    def __init__(self, job: dict):
        from kforge.device import current_device

        self.job = job
        self.device = current_device(job["device"])
        self.dev = self.device.torch_device
        self.arena = Arena.open(job["arena"], self.dev)
        self.inputs = rebuild(job["inputs"], self.arena)
        self.mailboxes = [[self.arena.view(spec) for spec in tensor_leaves(desc)] for desc in job["mailboxes"]]
        self.mailbox = self.mailboxes[0]  # the one the next outputs go to
        self.timer = None
        self.own = None  # the worker's own copy of the inputs (prepare); the timed calls' unless own_inputs is off

    def load(self) -> dict:
        from kforge.harness.candidate import load_candidate
        from kforge.harness.timing import call_timer

        self.candidate = load_candidate(self.job["candidate"])
        init = clone_arguments(rebuild(self.job["init"], self.arena))  # its own copies, not the arena's
        self.model = self.candidate.build(init, self.job["init_seed"], self.dev)
        self.timer = call_timer(self.device, flush_l2=False, judged=True)  # the judge flushes (judge.Judge._rest)
        return {}

    def _run(self):
        return self.candidate.run(self.model, self.inputs, self.dev)

    def call(self) -> dict:
        self.mailbox = self.mailboxes[0]
        recorder = OpRecorder() if self.job["forbidden_ops"] else nullcontext()
        with torch.no_grad(), recorder:
            out = self._run()
        return {**self._export(out), "ops": sorted(recorder.ops) if self.job["forbidden_ops"] else []}

    def warm(self, min_calls: int, seconds: float) -> dict:
        count, started = 0, None
        self.prepare()
        with torch.no_grad():
            while True:
                self.timer.run_untimed(lambda _: self.candidate.run(self.model, self._feed(), self.dev), ())
                count += 1
                if started is None:
                    started = time.perf_counter()
                elif (count >= min_calls and time.perf_counter() - started >= seconds) or count >= 1000:
                    return {"calls": count}

    def prepare(self) -> dict:
        """Before each timed call (a command of its own, so the judge can start its sleep
        after it): the round's inputs copied from the arena into the worker's own buffers
        (allocated once), and the device idle. The arena's memory is the reference worker's,
        mapped here, and a 1 GiB stream read from it ran 1.3% slower than from memory of the
        worker's own (H100). A problem whose reference changes its inputs in place
        (`own_inputs` off) is called on the arena's views, so the reference worker sees
        what the call left there; the copy is made all the same, as the reference worker's
        `prepare` makes its own. On a GPU the device work here decides when the timed
        window opens against the judge's cover: with none, it opened inside a 1 ms cover,
        and an honest claim took in ~0.65 ms of it (H200, 2026-11-29)."""
        if self.own is None:
            self.own = clone_arguments(self.inputs)
        else:
            for mine, shared in zip(self.own, self.inputs):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(shared)
        synchronize(self.dev)
        return {}

    def time(self, box: int = 0) -> dict:
        """One timed call on what `prepare` left; its outputs into mailbox `box`."""
        self.mailbox = self.mailboxes[box]
        feed = self._feed()
        wake_host()
        with torch.no_grad():
            clocks, out = self.timer.time_call(lambda _: self.model(*feed), ())
        return {"clocks": list(clocks), **self._export(out)}

    def _feed(self) -> list:
        return self.own if self.job.get("own_inputs", True) else self.inputs

    def _export(self, out) -> dict:
        """Copy each output tensor into its mailbox slot (when its shape and dtype fit),
        describe the output and digest the mailbox; the device is synchronized, so the copy
        is whole when we reply."""
        tensors = [t for t in flatten_outputs(out) if isinstance(t, torch.Tensor)]
        for slot, t in zip(self.mailbox, tensors):
            if t.shape == slot.shape and t.dtype == slot.dtype:
                slot.copy_(t.detach())
        digests = [digest(slot) for slot in self.mailbox]
        synchronize(self.dev)
        return {"outputs": describe_output(out), "digests": digests}


def error_reply(exc: Exception) -> dict:
    if isinstance(exc, KforgeError):
        kind = {"oom": "oom", "cuda_error": "cuda_error"}.get(exc.kind, "candidate_error")
        return {"error": {"kind": kind, "reason": exc.reason, "details": exc.details or None}}
    from kforge.errors import describe_exception, error_kind

    summary, details = describe_exception(exc)
    kind = {"oom": "oom", "cuda_error": "cuda_error"}.get(error_kind(exc), "candidate_error")
    return {"error": {"kind": kind, "reason": f"the candidate's worker failed: {summary}", "details": details}}


def main() -> int:
    faulthandler.enable()  # a crash leaves its Python traceback in the log the judge keeps
    fds = json.loads(sys.stdin.readline())
    end = WorkerEnd(fds["command_fd"], fds["reply_fd"])
    import kforge  # noqa: F401  (chooses Triton's mode before anything imports triton)
    from kforge.runtime.interpreter import interpreter_active, mend_interpreter

    end.reply(hello=True)  # booted: torch is imported while the reference worker sets up
    worker = None

    def setup(**job) -> dict:
        nonlocal worker
        worker = CandidateWorker(job)
        fp32_means_fp32()  # the reference worker's defaults: the candidate may change its own
        if not worker.device.is_cuda:
            # Two workers and the judge share the CPU: an OpenMP pool waiting for a busy core
            # costs milliseconds a call, so each worker computes on one thread.
            torch.set_num_threads(1)
            if interpreter_active():
                mend_interpreter()
        return {}

    def bound(name):
        return lambda **fields: getattr(worker, name)(**fields)

    serve(end, {"setup": setup, **{name: bound(name) for name in ("load", "call", "warm", "prepare", "time")}},
          error_reply)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not sys.exit: a thread the candidate left running must not hold the exit
