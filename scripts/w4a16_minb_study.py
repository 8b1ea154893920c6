"""w4a16_mma.cu at one token with __launch_bounds__ asking for MINB blocks an SM (fewer registers, more
warps): graphed as gemv_one_token.py times them. Run from scripts/ with PYTHONPATH=../src."""
import kforge  # noqa
import sys
sys.path.insert(0, ".")
import torch
import gemv_one_token as g
from kforge.kernels.quant import w4a16
from kforge.kernels.quant.formats import dequantize_int4
from quant_gemv_sweep import w4a16_inputs
V = [(2, 4, 1, 2, 0), (1, 8, 1, 3, 0), (1, 8, 0, 2, 0), (1, 8, 0, 2, 4), (1, 8, 0, 2, 5), (1, 4, 0, 2, 8),
     (1, 4, 0, 2, 10), (1, 4, 0, 3, 8), (1, 2, 0, 3, 16), (1, 2, 0, 2, 16), (1, 4, 1, 2, 6), (1, 4, 1, 3, 4)]
for n, k in g.SHAPES:
    ws = [w4a16_inputs(n, k) for _ in range(g.GRAPHED)]
    x = ws[0][0]
    nbytes = ws[0][1].numel() + ws[0][2].numel() * 2
    want = torch.nn.functional.linear(x.double(), dequantize_int4(ws[0][1], ws[0][2], 128).double())
    fns = {"read stream": g.read_streams(nbytes),
           f"w4a16_matmul ({w4a16.one_token_kernel(n, k)})": lambda: [w4a16.launch_w4a16(x, q, s, 128, None) for _, q, s in ws]}
    for mt, kw, xpf, d, minb in V:
        ys = [torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(g.GRAPHED)]
        var = dict(m_tiles=mt, k_warps=kw, x_ahead=bool(xpf), depth=d, min_blocks=minb)
        w4a16.launch_cuda_mma(x, ws[0][1], ws[0][2], 128, ys[0], **var)
        if not torch.allclose(ys[0].double(), want, atol=2e-2, rtol=2e-2):
            print("WRONG", var); continue
        fns[f"mma MT={mt} KW={kw} XPF={xpf} D={d} MINB={minb}"] = (lambda ys=ys, var=var: [
            w4a16.launch_cuda_mma(x, q, s, 128, y, **var) for (_, q, s), y in zip(ws, ys)])
    print(f"W4A16 1 token {n} x {k}")
    g.report(fns, nbytes)
    del ws
