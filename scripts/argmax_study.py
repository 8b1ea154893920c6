import torch, statistics
import kforge.models.sampling as s
def t(f, x, n=200):
    for _ in range(20): f(x)
    torch.cuda.synchronize()
    ev=[torch.cuda.Event(enable_timing=True) for _ in range(n+1)]
    ev[0].record()
    for e in ev[1:]:
        f(x); e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b)*1e3 for a,b in zip(ev,ev[1:]))
for batch in (1, 8, 64):
    x = torch.randn(batch, 128256, device="cuda")
    print(f"batch {batch}: torch argmax {t(lambda v: v.argmax(-1), x):.2f} us", end="")
    for c in (32, 64, 128, 256):
        s.SPLIT_CHUNKS = c
        assert torch.equal(s.argmax_rows(x), x.argmax(-1))
        print(f"; chunks {c} {t(s.argmax_rows, x):.2f} us", end="")
    print(flush=True)
