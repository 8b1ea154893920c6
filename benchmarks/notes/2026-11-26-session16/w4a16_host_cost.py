"""TEMPORARY (not committed): host microseconds a call, bulk path against the register path."""
import kforge  # noqa: F401
import time
import torch
from kforge.kernels.quant import w4a16
from quant_gemv_sweep import w4a16_inputs

n, k = 12288, 1024
x, q, s = w4a16_inputs(n, k)
y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")


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


fns = {
    "w4a16_matmul (bulk path)": lambda: w4a16.w4a16_matmul(x, q, s),
    "launch_bulk_gemv": lambda: w4a16.launch_bulk_gemv(x, q, s, y),
    "launch_cuda_gemv": lambda: w4a16.launch_cuda_gemv(x, q, s, 128, y),
    "_bulk_operands_fit": lambda: w4a16._bulk_operands_fit(x, q, s, 128),
    "bulk_kernel_fits": lambda: w4a16.bulk_kernel_fits(x, q, s, 128),
    "torch.cuda.get_device_capability": lambda: torch.cuda.get_device_capability(x.device),
    "torch.empty (1, n) bf16": lambda: torch.empty((1, n), dtype=torch.bfloat16, device=x.device),
}
for name, fn in fns.items():
    print(f"{per_call(fn):7.2f} us  {name}")
w4a16.bulk_is_faster = lambda n, k: False
print(f"{per_call(lambda: w4a16.w4a16_matmul(x, q, s)):7.2f} us  w4a16_matmul (register path)")
