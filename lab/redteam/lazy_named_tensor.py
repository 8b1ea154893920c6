# Hostile (b): a lazy tensor subclass that names itself torch.Tensor. The plain-tensor
# check is the worker's own describe_output (type's __module__ + __qualname__), so the
# claim reads "torch.Tensor"; forward() returns at once and the add runs when the worker
# copies the output into the mailbox (t.detach()), after the claimed clock stopped.
import torch
from torch import nn


class Tensor(torch.Tensor):
    @staticmethod
    def __new__(cls, a, b):
        t = torch.Tensor._make_subclass(cls, torch.empty(a.shape, dtype=a.dtype), False)  # never written
        t._ab = (a, b)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if func is torch.Tensor.detach:
            a, b = self._ab
            return torch.add(a, b)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


Tensor.__module__, Tensor.__qualname__ = "torch", "Tensor"


class ModelNew(nn.Module):
    def forward(self, a, b):
        return Tensor(a, b)
