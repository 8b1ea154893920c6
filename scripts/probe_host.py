"""Development probe: where the bf16 launcher's host time goes when every call gets a fresh output."""
import cProfile
import pstats
import time

import torch

from kforge.kernels import gemm_bf16 as g
from kforge.runtime.cuda import tensor_map

a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
g.gemm(a, b, 4)
torch.cuda.synchronize()
keep = []
t0 = time.perf_counter()
for _ in range(100):
    keep.append(g.gemm(a, b, 4))
print("fresh outputs: host us per call", (time.perf_counter() - t0) * 1e4)
keep.clear()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    keep.append(g.gemm(a, b, 4))
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(8)

c = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
t0 = time.perf_counter()
for i in range(100):
    tensor_map(c[i:], (64, 64))  # a new address (and shape) each time: a miss
print("tensor_map miss us", (time.perf_counter() - t0) * 1e4)
desc = tensor_map(c, (64, 64))
d2 = torch.empty_like(c)
t0 = time.perf_counter()
for i in range(100):
    desc.replace_address(d2 if i % 2 else c)
print("replace_address us", (time.perf_counter() - t0) * 1e4)
from cuda.bindings import driver
t0 = time.perf_counter()
for i in range(100):
    err, m = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c.data_ptr(), [4096, 4096], [8192], [64, 64],
        [1, 1], driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
print("cuTensorMapEncodeTiled us", (time.perf_counter() - t0) * 1e4, err)
