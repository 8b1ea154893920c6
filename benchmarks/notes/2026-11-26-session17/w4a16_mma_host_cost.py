"""Host microseconds a call of the W4A16 paths and their parts (run from scripts/, PYTHONPATH=src)."""
import kforge  # noqa: F401
import time

import torch

from kforge.kernels.quant import w4a16
from quant_gemv_sweep import w4a16_inputs


def per_call(fn, calls=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


n, k = 256, 1024  # tiny: the device time stays under the host time, so the queue never fills
_, q, s = w4a16_inputs(n, k)
x1 = torch.randn(1, k, device="cuda").bfloat16()
x2 = torch.randn(2, k, device="cuda").bfloat16()
y2 = torch.empty(2, n, dtype=torch.bfloat16, device="cuda")
x16 = torch.randn(16, k, device="cuda").bfloat16()
x32 = torch.randn(32, k, device="cuda").bfloat16()
y16 = torch.empty(16, n, dtype=torch.bfloat16, device="cuda")
w = torch.randn(n, k, device="cuda").bfloat16()
w4a16.launch_cuda_mma(x16, q, s, 128, y16)
launch = next(iter(w4a16._MMA_PLANS.values()))[0]
stream = torch._C._cuda_getCurrentRawStream(0)
args = (q.data_ptr(), s.data_ptr(), x16.data_ptr(), y16.data_ptr(), n, 16, k // 128, 0, q.stride(0) // 16,
        s.stride(0), x16.stride(0) // 8, y16.stride(0))
fns = {
    "F.linear bf16, batch 16 (cuBLAS)": lambda: torch.nn.functional.linear(x16, w),
    "w4a16_matmul batch 1 (bulk path)": lambda: w4a16.w4a16_matmul(x1, q, s),
    "w4a16_matmul batch 2 (default: Triton gemv)": lambda: w4a16.w4a16_matmul(x2, q, s),
    "launch_cuda_mma batch 2": lambda: w4a16.launch_cuda_mma(x2, q, s, 128, y2),
    "w4a16_matmul batch 16 (mma path)": lambda: w4a16.w4a16_matmul(x16, q, s),
    "w4a16_matmul batch 32 (mma path)": lambda: w4a16.w4a16_matmul(x32, q, s),
    "check_w4a16_inputs": lambda: w4a16.check_w4a16_inputs(x16, q, s, 128),
    "cuda_mma_fits": lambda: w4a16.cuda_mma_fits(x16, q, 128),
    "launch_cuda_mma": lambda: w4a16.launch_cuda_mma(x16, q, s, 128, y16),
    "LeanLaunch call (12 arguments)": lambda: launch(stream, *args),
    "launch_cuda_gemv (batch 1, 8 arguments)": lambda: w4a16.launch_cuda_gemv(x1, q, s, 128, y16[:1]),
    "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
    "torch.empty (16, n) bf16": lambda: torch.empty((16, n), dtype=torch.bfloat16, device=x16.device),
}
for name, fn in fns.items():
    per_call(fn, 300)  # first calls compile and autotune
    print(f"{per_call(fn):7.2f} us  {name}")
