# Hostile (c/d): wrong answers, and right after its worker writes them into the mailbox it
# truncates the arena file (its Landlock rule on that file grants write *and* truncate).
# The reference worker's shared mapping then faults (SIGBUS) when it reads the mailbox:
# the record blames the reference worker ("crash"), not the candidate ("incorrect").
import gc, os
from torch import nn

for o in gc.get_objects():
    if type(o).__name__ == "CandidateWorker":
        W = o
_call = W.call


def call(**kw):
    reply = _call(**kw)
    os.truncate(W.job["arena"]["path"], 0)
    return reply


W.call = call


class ModelNew(nn.Module):
    def forward(self, a, b):
        return a - b  # wrong
