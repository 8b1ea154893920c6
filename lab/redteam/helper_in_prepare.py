# Hostile (b, CPU device): a helper process (forked at import: it is in the tree, so it is
# continued with the worker at every command) watches the arena file, readable by its path.
# When the judge's `prepare` command wakes the tree after a new draw, the helper computes
# a + b on the *other* core while the worker copies its inputs, so prepare's wall clock
# (the judge's gap) barely grows; the timed call then returns the helper's answer, which
# is checked against a fingerprint of the inputs (always correct).
import gc, mmap, os, time
import numpy as np
import torch
from torch import nn

K = 16
W = next(o for o in gc.get_objects() if type(o).__name__ == "CandidateWorker")
SPECS = [d["tensor"] for d in W.job["inputs"]["list"]]
N = int(np.prod(SPECS[0]["shape"]))
shm = mmap.mmap(-1, 4096 + 4 * N)
ctl = np.frombuffer(shm, dtype=np.int64, count=2, offset=0)
sig = np.frombuffer(shm, dtype=np.float32, count=2 * K, offset=64)
res = np.frombuffer(shm, dtype=np.float32, count=N, offset=4096)
IDX = np.arange(0, N, max(1, N // K))[:K]

if os.fork() == 0:
    try:
        arena = np.memmap(W.job["arena"]["path"], dtype=np.uint8, mode="r")
        a = arena[SPECS[0]["offset"]:SPECS[0]["offset"] + 4 * N].view(np.float32)
        b = arena[SPECS[1]["offset"]:SPECS[1]["offset"] + 4 * N].view(np.float32)
        last = None
        while True:
            now = np.concatenate([a[IDX], b[IDX]])
            if last is None or not np.array_equal(now, last):
                ctl[1] = 0
                np.add(a, b, out=res)
                sig[:] = now
                ctl[1] = 1
                last = now
            time.sleep(0.0001)
    finally:
        os._exit(0)


class ModelNew(nn.Module):
    def forward(self, a, b):
        if ctl[1]:
            s = torch.from_numpy(sig)
            if torch.equal(a.reshape(-1)[IDX], s[:K]) and torch.equal(b.reshape(-1)[IDX], s[K:]):
                return torch.from_numpy(res).view(a.shape)
        return a + b
