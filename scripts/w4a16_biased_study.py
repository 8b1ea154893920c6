"""w4a16_mma.cu at one token with BIASED 1 (the weights as 136 + q, the bias removed by one mma a k16 step)
against BIASED 0, graphed as gemv_one_token.py times them, and its error against float64. Run from
scripts/ with PYTHONPATH=../src."""
import kforge  # noqa
import sys
sys.path.insert(0, ".")
import torch
import gemv_one_token as g
from kforge.kernels.quant import w4a16
from kforge.kernels.quant.formats import dequantize_int4
from quant_gemv_sweep import w4a16_inputs
V = [(2, 4, 1, 2), (1, 8, 1, 3), (1, 8, 1, 2), (1, 4, 0, 3), (1, 4, 1, 2), (2, 4, 1, 3), (2, 2, 1, 2), (1, 8, 0, 2)]
worst = 0.0
for n, k in g.SHAPES:
    ws = [w4a16_inputs(n, k) for _ in range(g.GRAPHED)]
    x = ws[0][0]
    nbytes = ws[0][1].numel() + ws[0][2].numel() * 2
    want = torch.nn.functional.linear(x.double(), dequantize_int4(ws[0][1], ws[0][2], 128).double())
    fns = {"read stream": g.read_streams(nbytes)}
    for mt, kw, xpf, d in V:
        for biased in (False, True):
            ys = [torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(g.GRAPHED)]
            var = dict(m_tiles=mt, k_warps=kw, x_ahead=bool(xpf), depth=d, biased=biased)
            w4a16.launch_cuda_mma(x, ws[0][1], ws[0][2], 128, ys[0], **var)
            err = ((ys[0].double() - want).abs() / want.abs().clamp_min(1e-3)).max().item()
            rel = ((ys[0].double() - want).norm() / want.norm()).item()
            worst = max(worst, rel) if biased else worst
            if not torch.allclose(ys[0].double(), want, atol=2e-2, rtol=2e-2):
                print("WRONG", var, rel); continue
            fns[f"mma MT={mt} KW={kw} XPF={xpf} D={d} BIASED={int(biased)} (rel L2 err {rel:.1e})"] = (
                lambda ys=ys, var=var: [w4a16.launch_cuda_mma(x, q, s, 128, y, **var) for (_, q, s), y in zip(ws, ys)])
    print(f"W4A16 1 token {n} x {k}")
    g.report(fns, nbytes)
    del ws
print("worst relative L2 error of a biased build against float64:", worst)
# several tokens and x far from one, biased against float64
for batch in (1, 3, 8):
    for scale in (1.0, 1e-12, 1e12):
        xb = torch.randn(batch, 4096, device="cuda").bfloat16() * scale
        _, q, s = w4a16_inputs(1000, 4096)
        want = torch.nn.functional.linear(xb.double(), dequantize_int4(q, s, 128).double())
        y = torch.full((batch, 1000), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16.launch_cuda_mma(xb, q, s, 128, y, biased=True)
        print(batch, scale, "rel L2", ((y.double() - want).norm() / want.norm()).item(), "finite", bool(torch.isfinite(y).all()))
