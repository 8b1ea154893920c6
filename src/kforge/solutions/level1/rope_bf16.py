"""RoPE in place on q and k in one launch of kforge's Triton kernel (`kforge.kernels.serving.rope`),
where eager PyTorch gathers, chunks, multiplies and copies back per tensor.

The cos/sin table is the kernel's cached [cos | sin] table for the problem's base, sized to
its full-size MAX_POSITION (positions below it get the same rows at any size) and the
head dim of the inputs; HALF_SPLIT picks the layout. On a CPU the kernel runs under the
Triton interpreter.
"""

from torch import nn

from kforge.kernels.serving.rope import apply_rope_, cos_sin_table
from kforge.problems.level1 import rope_bf16 as problem


class ModelNew(nn.Module):
    def forward(self, q, k, positions):
        table = cos_sin_table(problem.MAX_POSITION, q.shape[-1], problem.BASE, q.device)
        apply_rope_(q, k, positions, table, interleaved=not problem.HALF_SPLIT)
        return q, k
