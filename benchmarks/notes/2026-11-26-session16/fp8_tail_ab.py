"""TEMPORARY (not committed): HEAD's kernel against the tail-split one, same run."""
import sys
import kforge  # noqa: F401
import torch
from device_timing import median_ms
from kforge.kernels.quant.formats import quantize_fp8_blockwise, quantize_fp8_rowwise
from kforge.kernels.quant import fp8_block_gemm as module
from kforge.runtime.cuda import CudaKernel, compile_cuda
from kforge.runtime import sass_control

m, n, k = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (4096, 7168, 16384)
x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / k**0.5
(a, sa), (b, sb) = quantize_fp8_blockwise(x, (1, 128)), quantize_fp8_blockwise(w, (128, 128))
(ra, rsa), (rb, rsb) = quantize_fp8_rowwise(x), quantize_fp8_rowwise(w)
cubin = compile_cuda(module.SOURCE.with_name("fp8_block_gemm_before.cu"), defines={"STAGES": 4, "BN": 256, "CLUSTER_M": 2})
before = module._Plan(CudaKernel(sass_control.rewrite_promotion(cubin, "fp8_block_gemm", module.PROMOTION), "fp8_block_gemm"),
                      4, 256, 2, m, n, k, torch.cuda.current_device(), tail_split=False)
def run_before():
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda"); before(a, b, c, sa, sb); return c
fns = {"HEAD kernel": run_before,
       "tail split": lambda: module.fp8_block_gemm(a, b, sa, sb),
       "new kernel, last round whole": lambda: module.fp8_block_gemm(a, b, sa, sb, tail_split=False),
       "_scaled_mm rowwise": lambda: torch._scaled_mm(ra, rb.t(), scale_a=rsa, scale_b=rsb.reshape(1, n), out_dtype=torch.bfloat16)}
ref = run_before().float()
for name in ("tail split", "new kernel, last round whole"):
    print(name, "max |diff| / max", ((fns[name]().float() - ref).abs().max() / ref.abs().max()).item())
for rep in range(2):
    times = median_ms(fns, 30)
    base = times["_scaled_mm rowwise"]
    for name, ms in sorted(times.items(), key=lambda t: t[1]):
        print(f"  {ms:8.4f} ms  {2*m*n*k/ms/1e9:7.1f} TFLOP/s  {base/ms:6.3f}x rowwise  {name}")
    print()
