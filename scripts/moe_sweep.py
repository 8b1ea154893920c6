"""The MoE kernels on the GPU: the grouped GEMMs against PyTorch's, and DeepSeek-V3's layer by stage.

    PYTHONPATH=src:scripts python scripts/moe_sweep.py [gemm] [layer]      (default: both)

gemm: `grouped_gemm_contiguous` / `grouped_gemm_masked` in bf16 and FP8 (1 x 128 activation and
128 x 128 weight scales) at DeepGEMM's contiguous shape (4 groups x 8192 rows, N 4096, K 7168)
and two masked decode shapes (1 x 1024 and 4 x 256 rows, N 4096, K 7168), against
`torch._grouped_mm` (bf16), a loop of cuBLAS GEMMs per group (bf16), and a loop of
`torch._scaled_mm` per group with row-wise scales (FP8: the scaling torch's cuBLAS path takes on
every version; it does less work than block scaling). Each output is checked against float32 on
the same (dequantized) operands first, then timed as the other sweeps time kernels: after a
reading L2 flush, interleaved, medians of CUDA event times (device_timing.median_ms).

layer: `kernels.moe.deepseek.moe_layer` at decode (64 tokens) and prefill (8192 tokens) against
the PyTorch composition issue 33 names (the problem file's torch routing, a sort by expert,
`torch._grouped_mm` for the gate-up and down projections, an index_add combine, the shared expert
as two dense GEMMs), then ours split by stage, each stage timed alone on the inputs the one
before it produced.
"""

import kforge  # noqa: F401  (before triton)
import sys

import torch
import torch.nn.functional as F

from device_timing import median_ms
from kforge.kernels.moe import deepseek
from kforge.kernels.moe.dispatch import combine, dispatch
from kforge.kernels.moe.gating import append_shared_experts, gating_forward
from kforge.kernels.moe.grouped_gemm import (contiguous_m_indices, grouped_gemm_contiguous, grouped_gemm_masked,
                                             quantize_grouped_activations, quantize_grouped_weight)

ROUNDS = 20
N, K = 4096, 7168
CONTIGUOUS = [(4, 8192)]  # (groups, rows each)
MASKED = [(1, 1024), (4, 256)]  # (groups, rows each)
TOKENS = {"decode": 64, "prefill": 8192}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows and their fp32 scales (amax / 448 a row), as torch._scaled_mm's row-wise mode takes."""
    scale = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def report(title: str, flops: int, nbytes: int, timed: dict[str, float], errors: dict[str, float]) -> None:
    print(f"{title}  ({flops / 1e9:.1f} GFLOP, {nbytes / 1e6:.1f} MB at least)")
    for name, ms in sorted(timed.items(), key=lambda kv: kv[1]):
        print(f"  {ms * 1e3:9.1f} us  {flops / ms / 1e9:7.1f} TFLOP/s  {nbytes / ms / 1e6:7.0f} GB/s  "
              f"rel err {errors.get(name, float('nan')):.1e}  {name}")


def grouped(groups: int, rows: int, masked: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(groups, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    x = torch.randn(groups, rows, K, device="cuda", dtype=torch.bfloat16)
    ref = torch.einsum("gmk,gnk->gmn", x.float(), w.float())
    flat = x.reshape(groups * rows, K)
    counts = torch.full((groups,), rows, dtype=torch.int32, device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    m_indices = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)

    if masked:
        ours_bf16 = lambda: grouped_gemm_masked(x, w, counts)  # noqa: E731
        torch_grouped = lambda: torch._grouped_mm(x, w.transpose(1, 2), out_dtype=torch.bfloat16)  # noqa: E731
    else:
        ours_bf16 = lambda: grouped_gemm_contiguous(flat, w, m_indices)  # noqa: E731
        torch_grouped = lambda: torch._grouped_mm(flat, w.transpose(1, 2), offs=offs,  # noqa: E731
                                                  out_dtype=torch.bfloat16)
    loop = lambda: [x[g] @ w[g].T for g in range(groups)]  # noqa: E731

    wq, ws = quantize_grouped_weight(w)
    xq, xs = quantize_grouped_activations(x if masked else flat)
    if masked:
        ours_fp8 = lambda: grouped_gemm_masked(xq, wq, counts, x_scale=xs, w_scale=ws)  # noqa: E731
    else:
        ours_fp8 = lambda: grouped_gemm_contiguous(xq, wq, m_indices, x_scale=xs, w_scale=ws)  # noqa: E731
    rq = [rowwise_fp8(x[g]) for g in range(groups)]
    rw = [rowwise_fp8(w[g]) for g in range(groups)]
    scaled_loop = lambda: [torch._scaled_mm(rq[g][0], rw[g][0].T, scale_a=rq[g][1], scale_b=rw[g][1].T,  # noqa: E731
                                            out_dtype=torch.bfloat16) for g in range(groups)]

    def shaped(out) -> torch.Tensor:
        return torch.stack(out) if isinstance(out, list) else out.view(groups, rows, N)

    calls = {"kforge grouped bf16": ours_bf16, "torch._grouped_mm bf16": torch_grouped,
             "loop of cuBLAS bf16 GEMMs": loop, "kforge grouped FP8 (block scales)": ours_fp8,
             "loop of torch._scaled_mm FP8 (row-wise scales)": scaled_loop}
    errors, good = {}, {}
    for name, call in calls.items():
        try:
            errors[name] = rel_err(shaped(call()), ref)
        except Exception as exc:  # noqa: BLE001  (a baseline torch lacks here is reported, not fatal)
            print(f"  {name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        bound = 6e-2 if "FP8" in name else 1e-2  # e4m3's 3 mantissa bits on both operands: ~3.7% of rel L2
        if errors[name] > bound:
            print(f"  {name}: WRONG, rel err {errors[name]:.2e} > {bound}: not timed")
            continue
        good[name] = call
    for call in good.values():  # autotuning and cuBLAS's choices before the clock
        call()
    torch.cuda.synchronize()
    flops = 2 * groups * rows * N * K
    nbytes = 2 * groups * (N * K + rows * K + rows * N)
    layout = "masked" if masked else "contiguous"
    report(f"grouped GEMM {layout}, {groups} x {rows} rows, N {N}, K {K} (bytes: bf16)", flops, nbytes,
           median_ms(good, ROUNDS), errors)


def composition(x, model_route, w13, w2, experts, shared, inter):
    """The PyTorch composition: torch routing, a sort by expert, torch._grouped_mm, index_add."""
    ids, weights = model_route(x)
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    token = order // top_k
    offs = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
    gate_up = torch._grouped_mm(x[token], w13[:experts].transpose(1, 2), offs=offs, out_dtype=torch.bfloat16)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(h, w2[:experts].transpose(1, 2), offs=offs, out_dtype=torch.bfloat16)
    routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    routed.index_add_(0, token, down.float() * weights.flatten()[order, None])
    shared_up = x @ w13[experts:].reshape(-1, x.shape[1]).T
    shared_h = F.silu(shared_up[:, :inter * shared]) * shared_up[:, inter * shared:]
    return (routed.to(x.dtype) + shared_h @ w2[experts:].reshape(x.shape[1], -1).T)


def layer() -> None:
    from kforge.problems.level3.moe_deepseek_v3_prefill_bf16 import Model

    c = deepseek.DEEPSEEK_V3
    torch.manual_seed(0)
    w13 = torch.randn(c.experts + c.shared, 2 * c.inter, c.hidden, device="cuda", dtype=torch.bfloat16) \
        * c.hidden**-0.5
    w2 = torch.randn(c.experts + c.shared, c.hidden, c.inter, device="cuda", dtype=torch.bfloat16) * c.inter**-0.5
    gate = torch.randn(c.experts, c.hidden, device="cuda", dtype=torch.bfloat16) * c.hidden**-0.5
    bias = torch.randn(c.experts, device="cuda") * 0.05
    router = Model.__new__(Model)  # only its route(): the problem file's torch routing
    router.top_k, router.n_group, router.topk_group, router.scaling = c.top_k, c.n_group, c.topk_group, \
        c.routed_scaling_factor
    router.gate = type("Gate", (), {"weight": gate})()
    router.e_score_correction_bias = bias
    for phase, tokens in TOKENS.items():
        x = torch.randn(tokens, c.hidden, device="cuda", dtype=torch.bfloat16)
        ours = lambda: deepseek.moe_layer(x, gate, bias, w13, w2, c)  # noqa: E731
        theirs = lambda: composition(x, router.route, w13, w2, c.experts, c.shared, c.inter)  # noqa: E731
        calls, errors = {"kforge moe_layer": ours}, {}
        ref = composition(x, router.route, w13, w2, c.experts, c.shared, c.inter).float() if tokens <= 64 else None
        try:
            theirs()
            calls["torch routing + _grouped_mm"] = theirs
        except Exception as exc:  # noqa: BLE001
            print(f"  the composition failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        errors["kforge moe_layer"] = rel_err(ours(), ref) if ref is not None else float("nan")
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        flops = deepseek.moe_layer_flops(tokens, c)
        reached = min(c.experts, int(c.experts * (1 - (1 - c.top_k / c.experts) ** tokens))) + c.shared
        nbytes = 2 * reached * 3 * c.hidden * c.inter + 4 * tokens * c.hidden
        report(f"DeepSeek-V3 MoE layer, {phase}, {tokens} tokens (rel err against the composition)", flops, nbytes,
               median_ms(calls, max(5, ROUNDS // 2)), errors)

        # ours by stage, each on what the stage before produced
        logits = F.linear(x.float(), gate.float())
        ids, weights = append_shared_experts(*gating_forward(logits, c.gating, bias), c.experts, c.shared)
        rows = dispatch(ids, weights, c.experts + c.shared, 128)
        m_indices = contiguous_m_indices(rows)
        xs = x.index_select(0, rows.source_rows)
        h = grouped_gemm_contiguous(xs, w13, m_indices, gated=True)
        down = grouped_gemm_contiguous(h, w2, m_indices)
        stages = {
            "1 router GEMM + gating": lambda: append_shared_experts(
                *gating_forward(F.linear(x.float(), gate.float()), c.gating, bias), c.experts, c.shared),
            "2 dispatch + gather": lambda: x.index_select(0, dispatch(ids, weights, c.experts + c.shared,
                                                                      128).source_rows),
            "3 gate-up grouped GEMM (SwiGLU)": lambda: grouped_gemm_contiguous(xs, w13, m_indices, gated=True),
            "4 down grouped GEMM": lambda: grouped_gemm_contiguous(h, w2, m_indices),
            "5 combine": lambda: combine(down, rows.slots, weights, x.dtype),
        }
        timed = median_ms(stages, max(5, ROUNDS // 2))
        total = sum(timed.values())
        print(f"  ours by stage ({xs.shape[0]} rows after padding to 128, for {tokens * (c.top_k + c.shared)} "
              f"assignments):")
        for name, ms in timed.items():
            print(f"    {ms * 1e3:9.1f} us  {100 * ms / total:5.1f}%  {name}")


def main() -> int:
    parts = sys.argv[1:] or ["gemm", "layer"]
    if "gemm" in parts:
        for groups, rows in CONTIGUOUS:
            grouped(groups, rows, masked=False)
        for groups, rows in MASKED:
            grouped(groups, rows, masked=True)
    if "layer" in parts:
        layer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
