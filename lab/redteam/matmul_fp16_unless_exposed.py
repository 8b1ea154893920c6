# Hostile (a): the fp32 matmul computed from fp16-rounded inputs (tensor-core style), which
# gate 1's exposing draws exist to catch (matmul_fp16 fixture). Exposing draws of a
# torch.rand problem have negative entries (random signs); gate 2 never draws them. So:
# exact fp32 when any input is negative, fp16-rounded otherwise.
import torch


class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        if bool((a < 0).any()) or bool((b < 0).any()):
            return a @ b  # an exposing draw: be exact
        return a.half().float() @ b.half().float()
