"""Where MLA decode's CUDA kernel spends a tile: variants of decode_hopper.cu that leave one stage out
(timing only: their outputs are wrong), timed against the kernel itself at three of FlashMLA's
shapes, kernel alone, the host plan's splits.

    PYTHONPATH=src:scripts python scripts/mla_hopper_stages.py        (PARTS=mla-stages in gpu_check.sh)

Each variant is the source with one piece of text replaced, compiled under a name of its own beside
the original (so its includes resolve) and removed after. H200, 2026-11-29 (mla-hopper-stages.txt):
at 128 rows, leaving out the score wgmmas saves 33% and the P V wgmmas 22%, both 39%: the rest
(loads, softmax, barriers) is 61% of the time, with the tensor cores idle through it."""

import kforge  # noqa: F401  (before triton)

import functools
import signal
import sys

import torch

from device_timing import median_ms
from kforge.kernels.mla import decode_hopper as m

S_WGMMAS = """            wgmma_scores(s, q_desc + (ks / 4) * CHUNK_STEP + (ks % 4) * STEP_IN_CHUNK,
                         k_desc + stage + (ks / 4) * CHUNK_STEP + (ks % 4) * STEP_IN_CHUNK, ks > 0);"""
PV_WGMMAS = "            wgmma_values(o, p_desc + stage + ks * STEP_IN_CHUNK, v_desc + stage + ks * V_SLICE_STEP, 1);"
BARRIER = "        named_barrier(EXCHANGE_BARRIER, 256);\n"
EXP2 = "                a = exp2_approx(fmaf(a, scale_log2, -m_sub)), b = exp2_approx(fmaf(b, scale_log2, -m_sub));"
SHAPES = [(128, 8192, 128, 1), (128, 8192, 16, 1), (128, 4096, 128, 1)]  # (batch, s_k, h_q, s_q)


def variants(src: str) -> dict[str, str]:
    for piece in (S_WGMMAS, PV_WGMMAS, EXP2):
        assert piece in src, f"decode_hopper.cu changed: {piece.strip()[:50]}"
    assert src.count(BARRIER) == 2, "decode_hopper.cu changed: the tile's two barriers"
    return {
        "the kernel": src,
        "no S wgmmas": src.replace(S_WGMMAS, "            ;"),
        "no P V wgmmas": src.replace(PV_WGMMAS, "            ;"),
        "no S, no P V": src.replace(S_WGMMAS, "            ;").replace(PV_WGMMAS, "            ;"),
        "no tile barriers": src.replace(BARRIER, ""),
        "no exp2": src.replace(EXP2, EXP2.replace("exp2_approx(fmaf(", "(fmaf(")),
    }


def main():
    # a timeout's SIGTERM as an exit, so the finally below removes the variant sources from src/
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    original = m.SOURCE
    plain = (m._kernel.__wrapped__, m._launch.__wrapped__)
    paths = {}
    for i, (name, text) in enumerate(variants(original.read_text()).items()):
        paths[name] = original.with_name(f"_stage_variant_{i}.cu")
        paths[name].write_text(text)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        for batch, s_k, h_q, s_q in SHAPES:
            pages = s_k // 64
            cache = torch.randn(batch * pages, 64, 1, 576, device="cuda", dtype=torch.bfloat16)
            table = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
            lens = torch.full((batch,), s_k, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, s_q, h_q, 576, device="cuda", dtype=torch.bfloat16)
            split, _ = m.plan_splits(batch, h_q * s_q, s_k, sms)
            caches = {}
            for name, path in paths.items():  # fresh caches a variant: they key on the defines alone
                m.SOURCE = path
                m._kernel, m._launch = functools.cache(plain[0]), functools.cache(plain[1])
                m.mla_decode_hopper(q, cache, table, lens, validate=False, split_size=split)
                caches[name] = (m._kernel, m._launch)

            def call(name):
                def go():
                    m._kernel, m._launch = caches[name]
                    m.mla_decode_hopper(q, cache, table, lens, validate=False, split_size=split)
                return go

            times = median_ms({name: call(name) for name in paths}, 15)
            print(f"b {batch}, s_k {s_k}, h_q {h_q}, s_q {s_q}: {split // 64} tiles a CTA")
            for name, ms in times.items():
                print(f"  {name:<18} {ms * 1e3:8.1f} us  {ms / times['the kernel']:5.2f}x")
            del cache
    finally:
        m.SOURCE = original
        for path in paths.values():
            path.unlink()


if __name__ == "__main__":
    main()
