"""The decode step with the H200 one-token GEMV choices (A) against the rules before them (B), in one
process (decode_ab.compare; run from the repository root with PYTHONPATH=src):

    python scripts/gemv_choice_ab.py w4a16,fp8

B: FP8 one m-tile over 8 warps, x loaded with its chunk, 3 blocks an SM at every width; W4A16 one
token on w4a16_gemv_bulk.cu where `bulk_is_faster`, else w4a16_gemv.cu. Each setting's launch plans
are cached apart (the plan caches keyed by the flag too). The weights differ in bits between A and B
for W4A16 (another kernel sums them in another order), so the tokens may differ."""
import sys, statistics
sys.path.insert(0, "scripts")
import torch
from decode_ab import compare
from kforge.kernels.quant import fp8_gemv, w4a16
from kforge.models.llama import model as M
from kforge.models.llama.checkpoint import random_model
from kforge.models.llama.config import PRESETS

M.NEW_GEMV_CHOICE = True
new_fp8, new_one = fp8_gemv.cuda_variant, w4a16.one_token_kernel


class ByFlag(dict):
    def get(self, key, default=None):
        return super().get((M.NEW_GEMV_CHOICE, key), default)

    def __setitem__(self, key, value):
        super().__setitem__((M.NEW_GEMV_CHOICE, key), value)


fp8_gemv._CUDA_PLANS = ByFlag()
w4a16._MMA_PLANS = ByFlag()
fp8_gemv.cuda_variant = lambda n, b, sms: new_fp8(n, b, sms) if M.NEW_GEMV_CHOICE else (
    (1, 8, False, 3) if b <= 8 else (2, 4, True, 2))
w4a16.one_token_kernel = lambda n, k: new_one(n, k) if M.NEW_GEMV_CHOICE else (
    "bulk" if w4a16.bulk_is_faster(n, k) else "gemv")

for fmt in sys.argv[1].split(","):
    for head in (False, True):
        model = random_model(PRESETS["llama3-8b"], seed=0, dtype=torch.bfloat16, device="cuda", weights=fmt,
                             quantize_head=head)
        r = compare(model, "NEW_GEMV_CHOICE", batch=1, prompt=512, rounds=20, steps=10)
        print(f"{fmt:6} head {'quantized' if head else 'bf16':9}: A {statistics.median(r.a_ms):.4f} ms "
              f"B {statistics.median(r.b_ms):.4f} ms  B/A {r.ratio:.4f} ({r.low:.4f}-{r.high:.4f}) "
              f"tokens {'same' if r.same_tokens else 'DIFFERENT'}", flush=True)
        del model
        torch.cuda.empty_cache()
