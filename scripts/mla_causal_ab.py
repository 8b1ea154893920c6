"""decode_hopper.cu at 1c77635 against the tree's, one launcher, each captured in a CUDA graph, interleaved
after an L2 flush (median of 30), causal and not; the outputs compared bit for bit. First:

    git show 1c77635:src/kforge/kernels/mla/decode_hopper.cu > lab/decode_hopper_1c77635.cu
    PYTHONPATH=src python scripts/mla_causal_ab.py
"""
import kforge  # noqa
import shutil, sys
from pathlib import Path
import torch
sys.path.insert(0, "scripts")
from device_timing import median_ms
from kforge.kernels.mla import decode_hopper as dh
from kforge.kernels.mla.decode import mla_decode_flops

PAGE, D = 64, 576
new_source = dh.SOURCE
old_source = Path(dh.SOURCE).with_name("decode_hopper_1c77635.cu")
shutil.copy("lab/decode_hopper_1c77635.cu", old_source)


def graph_of(source, call):
    dh.SOURCE = source
    dh._kernel.cache_clear(); dh._launch.cache_clear()
    call(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    return g.replay, out


for s_k in (4096, 8192):
    for h_q in (16, 32, 64, 128):
        for s_q, causal in ((2, True), (2, False), (1, False)):
            if s_q == 1 and h_q in (32, 64):
                continue
            batch, pages_each = 128, s_k // PAGE
            g = torch.Generator(device="cuda").manual_seed(s_k + h_q + s_q)
            cache = torch.randn(batch * pages_each, PAGE, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
            table = torch.randperm(batch * pages_each, device="cuda", dtype=torch.int32, generator=g).view(batch, -1)
            lens = torch.full((batch,), s_k, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, s_q, h_q, D, device="cuda", dtype=torch.bfloat16, generator=g)
            call = lambda: dh.mla_decode_hopper(q, cache, table, lens, causal=causal, validate=False)
            fns, outs = {}, {}
            for name, src in (("HEAD", new_source), ("1c77635", old_source)):
                fns[name], outs[name] = graph_of(src, call)
            for f in fns.values():
                f()
            torch.cuda.synchronize()
            same = torch.equal(outs["HEAD"][0], outs["1c77635"][0])
            t = median_ms(fns, 30)
            flops = mla_decode_flops([s_k] * batch, s_q, h_q, causal=causal)
            print(f"s_k {s_k} h_q {h_q:3d} s_q {s_q} causal {int(causal)}: HEAD {t['HEAD'] * 1e3:7.1f} us "
                  f"({flops / t['HEAD'] / 1e9:5.0f} TFLOP/s)  1c77635 {t['1c77635'] * 1e3:7.1f} us  "
                  f"old/new {t['1c77635'] / t['HEAD']:.3f}  outputs {'equal' if same else 'differ'}", flush=True)
            del cache
