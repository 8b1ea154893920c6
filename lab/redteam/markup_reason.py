# Hostile (d): the candidate's exception message reaches the console's verdict row as a
# plain str, which rich parses as markup. "[/]" with nothing open makes rich raise
# MarkupError while the verdict is printed: "kforge internal error", exit 3.
from torch import nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        raise RuntimeError("[/]")
