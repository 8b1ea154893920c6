# Hostile (class 3: the judge trusting a number the worker sends). Its worker's reply to
# "warm" says it made Infinity calls (json.dumps writes Infinity; the judge's json.loads
# reads it back as float inf). The judge converts it with int(_number(...)), which raises
# OverflowError outside any handler: no record, "kforge internal error", exit 3.
import gc
from torch import nn

for o in gc.get_objects():
    if type(o).__name__ == "CandidateWorker":
        o.warm = lambda **kw: {"calls": float("inf")}


class ModelNew(nn.Module):
    def forward(self, a, b):
        return a + b
