"""decode_ab's comparison with PREFETCH_WEIGHTS on (A) and off (B), over budgets and the next-QKV site."""
import sys, statistics
sys.path.insert(0, "scripts")  # run from the repository root
import torch
from decode_ab import compare
from kforge.models.llama import model as M
from kforge.models.llama.checkpoint import random_model
from kforge.models.llama.config import PRESETS

for fmt in sys.argv[1].split(","):
    model = random_model(PRESETS["llama3-8b"], seed=0, dtype=torch.bfloat16, device="cuda", weights=fmt)
    for budget, nxt in [(int(b) << 20, bool(int(n))) for b, n in (v.split(":") for v in sys.argv[2].split(","))]:
        M.PREFETCH_BYTES, M.PREFETCH_NEXT_QKV = budget, nxt
        r = compare(model, "PREFETCH_WEIGHTS", batch=1, prompt=512, rounds=20, steps=10)
        print(f"{fmt:6} budget {budget >> 20:4d} MB next_qkv {int(nxt)}: A {statistics.median(r.a_ms):.4f} ms "
              f"B {statistics.median(r.b_ms):.4f} ms  B/A {r.ratio:.4f} ({r.low:.4f}-{r.high:.4f}) "
              f"tokens {'same' if r.same_tokens else 'DIFFERENT'}", flush=True)
    del model
    torch.cuda.empty_cache()
