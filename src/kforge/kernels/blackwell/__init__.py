"""Blackwell (sm_100a) kernels: tcgen05 MMA with tensor-memory accumulators, the 2-CTA MMA, and the
block-scaled NVFP4 MMA. Compiled by NVRTC and checked on their machine code; NOT YET RUN ON A GPU
(docs/blackwell.md says what the first run must check). Their launchers refuse any other GPU."""

from __future__ import annotations

import torch

from kforge.errors import KforgeError

ARCH = "sm_100a"  # tcgen05 assembles only for the architecture-specific target
SHARED_LIMIT = 227 * 1024  # dynamic shared memory a block may opt in to on sm_100


def require_sm100(t: torch.Tensor, what: str) -> int:
    """The CUDA device index of `t`, if it is an sm_100 GPU (compute capability 10.0); else a
    KforgeError in one line. (An sm_100a cubin loads on 10.0 only: 10.3 would need sm_103a.)"""
    if t.device.type != "cuda":
        raise KforgeError(f"{what} runs on an sm_100 GPU (B200/GB200); got tensors on {t.device}")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability != (10, 0):
        raise KforgeError(f"{what} needs an sm_100 GPU (B200/GB200, compute capability 10.0); "
                          f"{torch.cuda.get_device_name(index)} is {capability[0]}.{capability[1]}")
    return index
