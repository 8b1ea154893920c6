"""Decode step time of llama3-8b bf16 batch 1 under different paged-decode partition minimums (lab)."""
import sys, torch
sys.path.insert(0, "scripts")
import kforge.kernels.serving.paged_decode as pd
from kforge.bench.model import time_steps
from kforge.device import current_device
from kforge.models.engine import Engine
from kforge.models.llama.checkpoint import random_model
from kforge.models.llama.config import PRESETS
from kforge.models.sampling import SamplingParams

device = current_device()
config = PRESETS["llama3-8b"]
model = random_model(config, seed=0, dtype=torch.bfloat16, device=device.torch_device, weights="bf16")
prompt = torch.randint(0, config.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
for rep in range(2):
    for minimum in (128, 64, 32, 100000):
        pd.MIN_PARTITION_TOKENS = minimum
        engine = Engine(model, max_slots=1, max_context=512 + 60, max_step_tokens=512)
        engine.submit(prompt, SamplingParams(max_tokens=50))
        with torch.no_grad():
            engine.step()
            t = time_steps(engine.step, steps=30, warmup=8, cuda=True)
        plan = pd.plan_decode(1, config.n_kv_heads, 512 + 60 + 16, config.head_dim, 2)
        print(f"rep {rep} MIN_PARTITION_TOKENS {minimum:>6}: step {t.median_ms:.4f} ms (p10 {t.p10_ms:.4f} p90 {t.p90_ms:.4f}); plan ~{plan}", flush=True)
        del engine
        torch.cuda.empty_cache()
