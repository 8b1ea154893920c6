"""The warden: the candidate's worker's parent, and the reaper of all it starts.

    python .../kforge/harness/warden.py      (run by path, by the judge; standard library only)

It makes itself a child subreaper, so every process the candidate starts, daemons that
leave their session included, stays its descendant; starts the candidate's worker,
confined (containment.confine: writes only in its own folders, no signals, traces or
memory reads outside its domain; with `lock_affinity`, unable to change any process's
CPU affinity) between fork and exec, when the warden has one thread;
and on "kill" (or when the judge goes away) kills that whole tree, reaps it and tells
the judge who survived. It never imports torch or kforge: it starts in milliseconds and
holds nothing worth attacking.

Job (first line on stdin, JSON): argv, env, writable and fixed_size (containment.confine),
pass_fds, log (the worker's stdout and stderr), lock_affinity (no process of the worker's may change a CPU
affinity). Replies on stdout:
{"spawned": pid, "confinement": {...}, "affinity_locked": bool} once, then
{"survivors": [...], "exit": status} after each {"op": "kill"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import containment  # this folder, imported as a plain module: no package, no torch


def main() -> int:
    containment.become_subreaper()
    containment.make_undumpable()
    containment.die_with_parent()
    job = json.loads(sys.stdin.readline())
    report_read, report_write = os.pipe()

    def confine_child() -> None:  # runs in the forked child, before exec
        os.close(report_read)
        locked = bool(job.get("lock_affinity")) and containment.lock_affinity()
        result = containment.confine(job["writable"], job.get("fixed_size", ()))
        os.write(report_write, json.dumps({**result.to_dict(), "affinity_locked": locked}).encode())
        os.close(report_write)
        containment.die_with_parent()

    with open(job["log"], "ab") as log:
        worker = subprocess.Popen(job["argv"], env=job["env"], pass_fds=job["pass_fds"], stdin=subprocess.PIPE,
                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=confine_child,
                                  start_new_session=True)
    os.close(report_write)
    confinement = json.loads(os.read(report_read, 1 << 16) or b"null")
    locked = bool(confinement and confinement.pop("affinity_locked", False))
    os.close(report_read)
    for fd in job["pass_fds"]:
        os.close(fd)
    worker.stdin.write((json.dumps(job["worker_job"]) + "\n").encode())
    worker.stdin.close()
    reply({"spawned": worker.pid, "confinement": confinement, "affinity_locked": locked})

    for line in sys.stdin:
        if json.loads(line).get("op") == "kill":
            survivors = containment.kill_tree(worker.pid)
            reply({"survivors": survivors, "exit": worker.wait()})
    containment.kill_tree(worker.pid)
    worker.wait()
    return 0


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
