"""Mixture of experts: the expert-sorted layout (every assignment once, runs padded, an expert
with no tokens), the grouped GEMM under the interpreter (fp16, fp32; plain, gated, scaled
scatter; ragged counts; N and K tails; tile heights dividing the padding) against float64,
the whole layer against a float64 loop over experts, every output row written (NaN-poisoned
buffers), refusals, and every autotuner config compiled for sm_90 within its shared memory.
On a GPU: bf16 at Mixtral widths, every config of both lists, and the layer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kforge.kernels.moe.ffn import moe_ffn, moe_ffn_min_bytes, moe_ffn_reference
from kforge.kernels.moe.grouped_gemm import GATED_CONFIGS, PLAIN_CONFIGS, grouped_gemm, grouped_gemm_reference
from kforge.kernels.moe.routing import padded_rows, sort_by_expert

# One rounding of the output (fp16 2^-11, bf16 2^-8 relative) after fp32 sums; the layer
# rounds h once more before the second GEMM, an error spread over the sum like the first:
# both relative to the output's RMS. fp32: sums of ~100 products in another order, ~1e-6.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SMALL_TILES = {"BM": 16, "BN": 32, "BK": 32, "GROUP_M": 2}


def _routing(tokens, top_k, experts, *, empty=(), seed=0, device="cpu"):
    """Distinct experts per token, none of them in `empty`; weights summing to 1 per token."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return ids.to(device), (weights / weights.sum(1, keepdim=True)).to(device)


def _weights(experts, n, k, dtype, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, n, k, generator=g) / k**0.5).to(dtype=dtype, device=device)


def _assert_matches(got, want, dtype):
    tol = TOLERANCE[dtype]
    scale = want.pow(2).mean().sqrt().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


# --- the layout ---------------------------------------------------------------------------------

def test_layout_holds_every_assignment_once_in_padded_runs_of_one_expert():
    tokens, top_k, experts, align = 23, 2, 6, 8
    ids, weights = _routing(tokens, top_k, experts, empty=(1, 5))
    layout = sort_by_expert(ids, weights, experts, align)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert layout.counts.tolist() == counts.tolist() and counts[1] == counts[5] == 0
    used = int(layout.used_rows)
    assert used == sum(-(-int(c) // align) * align for c in counts) and used % align == 0
    assert layout.rows == padded_rows(tokens * top_k, experts, align) >= used

    real = layout.dest_rows >= 0
    assert sorted(layout.dest_rows[real].tolist()) == list(range(tokens * top_k))  # each assignment once
    assert not real[used:].any()
    assert (layout.weights[~real] == 0).all() and (layout.source_rows[~real] == 0).all()
    dest = layout.dest_rows[real].long()
    assert torch.equal(layout.source_rows[real], dest // top_k)
    assert torch.equal(layout.weights[real], weights.flatten()[dest])
    row_expert = layout.block_experts.repeat_interleave(align)[:layout.rows]
    assert torch.equal(row_expert[real], ids.flatten()[dest])  # every block holds one expert's rows
    for e in range(experts):  # runs in expert order, tokens in order within a run (a stable sort)
        mine = dest[row_expert[real] == e]
        assert torch.equal(mine, mine.sort().values)
    assert (layout.block_experts[:used // align].diff() >= 0).all()


def test_layout_refuses_malformed_routing():
    ids, weights = _routing(4, 2, 4)
    for args, message in [((ids[:, 0], weights, 4, 8), "both be"), ((ids.float(), weights, 4, 8), "int32/int64"),
                          ((ids, weights, 0, 8), "num_experts")]:
        with pytest.raises(ValueError, match=message):
            sort_by_expert(*args)


# --- the grouped GEMM ---------------------------------------------------------------------------

def _gemm_case(dtype, gated, *, tokens=21, top_k=2, experts=5, n=40, k=48, align=32):
    """Rows in the padded layout of a ragged routing (expert 2 gets nothing): N = 40 and K = 48
    leave tails on 32-wide tiles."""
    ids, weights = _routing(tokens, top_k, experts, empty=(2,))
    layout = sort_by_expert(ids, weights, experts, align)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(layout.rows, k, generator=g).to(dtype)
    w = _weights(experts, 2 * n if gated else n, k, dtype)
    return layout, x, w


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_grouped_gemm_matches_float64_on_every_used_row(dtype, gated, nan_outputs):
    layout, x, w = _gemm_case(dtype, gated)
    out = grouped_gemm(x, w, layout.block_experts, layout.used_rows, gated=gated, align=layout.align,
                       config=SMALL_TILES)
    used = int(layout.used_rows)
    assert out.shape == (layout.rows, 40) and out.dtype == dtype
    want = grouped_gemm_reference(x, w, layout.block_experts, layout.used_rows, gated=gated, align=layout.align)
    _assert_matches(out[:used], want[:used], dtype)
    assert torch.isnan(out[used:]).all()  # rows past used_rows are left alone


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_scatter_scales_each_row_and_writes_every_assignment(dtype, nan_outputs):
    layout, x, w = _gemm_case(dtype, False)
    args = dict(row_scale=layout.weights, dest_rows=layout.dest_rows, out_size=42, align=layout.align)
    out = grouped_gemm(x, w, layout.block_experts, layout.used_rows, **args, config=SMALL_TILES)
    assert out.shape == (42, 40) and not torch.isnan(out).any()  # all 21 x 2 rows written, padding dropped
    _assert_matches(out, grouped_gemm_reference(x, w, layout.block_experts, layout.used_rows, **args), dtype)


@pytest.mark.parametrize("bm", [16, 32])
def test_tiles_of_any_height_dividing_the_padding_read_the_right_expert(bm):
    layout, x, w = _gemm_case(torch.float32, True, align=32)
    out = grouped_gemm(x, w, layout.block_experts, layout.used_rows, gated=True, align=32,
                       config=dict(SMALL_TILES, BM=bm))
    used = int(layout.used_rows)
    want = grouped_gemm_reference(x, w, layout.block_experts, layout.used_rows, gated=True, align=32)
    _assert_matches(out[:used], want[:used], torch.float32)
    with pytest.raises(ValueError, match="must divide align"):
        grouped_gemm(x, w, layout.block_experts, layout.used_rows, gated=True, align=32,
                     config=dict(SMALL_TILES, BM=64))


def test_grouped_gemm_refuses_what_it_cannot_take():
    layout, x, w = _gemm_case(torch.float32, False)
    experts, used = layout.block_experts, layout.used_rows
    cases = [
        ((x[:, :40], w, experts, used), {}, "K must match"),
        ((x, w[:, :39], experts, used), {"gated": True}, "gate rows then up rows"),
        ((x, w.half(), experts, used), {}, "share one dtype"),
        ((x[:-1], w, experts, used), {}, "multiple of align"),
        ((x, w, experts.long(), used), {}, "block_experts"),
        ((x, w, experts, used.long()), {}, "used_rows"),
        ((x, w, experts, used), {"dest_rows": layout.dest_rows}, "come together"),
        ((x, w[..., :44], experts, used), {}, "K must match"),
        ((x[:, :42].contiguous(), w[..., :42].contiguous(), experts, used), {}, "16-byte"),
        ((x, w, experts, used), {"row_scale": layout.weights, "dest_rows": layout.dest_rows, "out_size": 42,
                                 "gated": True}, "does not scatter"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            grouped_gemm(*args, align=layout.align, **kwargs)


# --- the layer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_moe_ffn_matches_a_float64_loop_over_experts(dtype, top_k, nan_outputs):
    tokens, hidden, inter, experts = 19, 32, 40, 4
    ids, weights = _routing(tokens, top_k, experts, empty=(3,))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = _weights(experts, 2 * inter, hidden, dtype), _weights(experts, hidden, inter, dtype, seed=2)
    y = moe_ffn(x, ids, weights.to(dtype), w13, w2)
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    _assert_matches(y, moe_ffn_reference(x, ids, weights.to(dtype), w13, w2), dtype)


def test_moe_ffn_refuses_mismatched_layers_and_takes_no_tokens():
    x, w13, w2 = torch.randn(3, 32), torch.randn(4, 80, 32), torch.randn(4, 32, 40)
    ids, weights = _routing(3, 2, 4)
    for args, message in [((x, ids, weights, w13[:, :79], w2), "w13 must be"), ((x, ids, weights, w13, w2[:2]), "w2"),
                          ((x, ids[:2], weights, w13, w2), "topk_ids must be")]:
        with pytest.raises(ValueError, match=message):
            moe_ffn(*args)
    assert moe_ffn(x[:0], ids[:0], weights[:0], w13, w2).shape == (0, 32)


def test_min_bytes_counts_the_weights_in_use_once():
    assert moe_ffn_min_bytes(4096, 4096, 14336, 8) == (8 * 3 * 4096 * 14336 + 2 * 4096 * 4096) * 2


# --- the machine code ---------------------------------------------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re
    os.environ["TRITON_INTERPRET"] = "0"  # compile for sm_90 on a machine with no GPU
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.moe import grouped_gemm as gg
    from kforge.runtime.cuda import Cubin, resources, sass

    fn, found = gg.grouped_gemm_kernel, []
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "block_experts_ptr": "*i32",
             "used_rows_ptr": "*i32", "row_scale_ptr": "*fp32", "dest_rows_ptr": "*i32", "M": "i32", "N": "i32",
             "K": "i32", "E": "i32", "stride_out": "i32"}
    aligned = [fn.arg_names.index(name) for name in ("x_ptr", "w_ptr", "out_ptr", "M", "N", "K", "stride_out")]
    for gated, configs in ((False, gg.PLAIN_CONFIGS), (True, gg.GATED_CONFIGS)):
        for c in configs:
            constants = dict(c.kwargs, NUM_PROGRAMS=132, ALIGN=gg.ROW_ALIGN, GATED=gated, SCATTER=not gated,
                             DOT_PRECISION="tf32")
            source = ASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in fn.arg_names},
                               constexprs=constants, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": c.num_warps, "num_stages": c.num_stages})
            cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
            code = sass(cubin)
            found.append(dict(gated=gated, config=str(c), shared=kernel.metadata.shared,
                              spills=len(re.findall(r"\b(STL|LDL)\b", code)),
                              wgmma=len(re.findall(r"\bHGMMA\b", code)), tma=len(re.findall(r"\bUTMALDG\b", code))))
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_every_config_compiles_for_sm90_to_tma_and_wgmma_within_shared_memory():
    # A config over the 227 KB would be skipped by the autotuner without a word.
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == len(PLAIN_CONFIGS) + len(GATED_CONFIGS)
    for kernel in found:
        assert 0 < kernel["shared"] <= 227 * 1024, kernel
        assert kernel["spills"] == 0 and kernel["wgmma"] > 0 and kernel["tma"] > 0, kernel


# --- on the GPU ---------------------------------------------------------------------------------

def _loop_reference_gpu(x, ids, weights, w13, w2):
    """moe_ffn_reference expert by expert, in float64 on the GPU (the token-by-token oracle
    would gather a (tokens, 2I, H) weight)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = x[token].double() @ w13[e].double().T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, weights[token, slot, None].double() * (h @ w2[e].double().T))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_every_config_on_the_gpu_matches_float64(gated):
    # 700 tokens x 2 over 8 experts (one empty) at N = 1000 (a tail on every BN), K = 1024
    ids, weights = _routing(700, 2, 8, empty=(6,), device="cuda")
    layout = sort_by_expert(ids, weights, 8, 128)
    x = torch.randn(layout.rows, 1024, device="cuda").to(torch.bfloat16)
    w = _weights(8, 2000 if gated else 1000, 1024, torch.bfloat16, device="cuda")
    scatter = {} if gated else dict(row_scale=layout.weights, dest_rows=layout.dest_rows, out_size=1400)
    want = grouped_gemm_reference(x, w, layout.block_experts, layout.used_rows, gated=gated, align=128, **scatter)
    rows = slice(0, int(layout.used_rows)) if gated else slice(None)
    _assert_matches(grouped_gemm(x, w, layout.block_experts, layout.used_rows, gated=gated, **scatter)[rows],
                    want[rows], torch.bfloat16)  # autotuned
    for config in GATED_CONFIGS if gated else PLAIN_CONFIGS:
        tiles = dict(config.kwargs, num_stages=config.num_stages, num_warps=config.num_warps)
        out = grouped_gemm(x, w, layout.block_experts, layout.used_rows, gated=gated, config=tiles, **scatter)
        _assert_matches(out[rows], want[rows], torch.bfloat16)


@pytest.mark.gpu
def test_moe_ffn_on_the_gpu_at_mixtral_widths():
    tokens, hidden, inter, experts = 1024, 4096, 14336, 8
    ids, weights = _routing(tokens, 2, experts, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    w13 = _weights(experts, 2 * inter, hidden, torch.bfloat16, device="cuda")
    w2 = _weights(experts, hidden, inter, torch.bfloat16, seed=2, device="cuda")
    weights = weights.to(torch.bfloat16)
    _assert_matches(moe_ffn(x, ids, weights, w13, w2), _loop_reference_gpu(x, ids, weights, w13, w2), torch.bfloat16)
