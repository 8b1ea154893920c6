"""MoE dispatch and combine: the reference layout against a token-by-token Python model of
the spec (rows, drops in token order, padding, block experts); the Triton dispatch under the
interpreter equal to the reference in every field (random routing, empty experts, one-token
experts, every token to one expert, ragged tails across blocks, the capacity hit and exactly
met, capacity 0 and 1, a per-expert capacity leaving a shared expert uncapped, no tokens,
int32 and int64 ids); the capacity formula; the per-expert loads (seed 003's balanced
table); the combine kernel equal to its reference (weighted or not, fp32/fp16, dropped slots
adding 0, padding rows never read) and to a direct sum over identity experts; the custom ops
(opcheck, one compiled graph, the CPU fallback); `kforge trace moe`; every kernel compiled
for sm_90. On a GPU: DeepSeek-V3's sizes (4096 tokens, top-8 of 256, align 128), with and
without a capacity, and its bf16 combine at hidden 7168."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kforge.kernels.moe.dispatch import combine, combine_reference, dispatch, expert_loads
from kforge.kernels.moe.gating import Gating, append_shared_experts, gating_reference
from kforge.kernels.moe.routing import expert_capacity, padded_rows, sort_by_expert
from kforge.ops.moe import moe_combine, moe_dispatch


def _routing(tokens, top_k, experts, *, seed=0, skew=None, device="cpu"):
    """Distinct experts per token, drawn uniformly or with probabilities `skew`; or round robin
    (token t to experts t, t + 1, ... mod E); or ("lone", e1, e2, ...): uniform over the other
    experts, then e1 in the first token's slot 0, e2 in the second's, ... (one token each).
    Weights in (0.1, 1.1)."""
    g = torch.Generator().manual_seed(seed)
    if skew == "round robin":
        ids = (torch.arange(tokens)[:, None] + torch.arange(top_k)) % experts
    else:
        lone = skew[1:] if isinstance(skew, tuple) else ()
        p = torch.ones(experts) if skew is None or lone else torch.tensor(skew, dtype=torch.float32)
        p[list(lone)] = 0
        ids = torch.stack([torch.multinomial(p, top_k, generator=g) for _ in range(tokens)]) if tokens else \
            torch.zeros(0, top_k, dtype=torch.int64)
        for t, e in enumerate(lone):
            ids[t, 0] = e
    return ids.to(device), (torch.rand(tokens, top_k, generator=g) + 0.1).to(device)


def _spec(ids, weights, experts, align, capacity):
    """The layout token by token, as the spec words it: assignment a = t * top_k + j in order;
    an expert keeps its first `capacity` and drops the rest; runs in expert order, padded."""
    tokens, top_k = ids.shape
    caps = [capacity if not isinstance(capacity, list) else capacity[e] for e in range(experts)]
    caps = [c if c is not None else tokens * top_k for c in caps]
    mine = [[] for _ in range(experts)]
    slots = [-1] * (tokens * top_k)
    routed = [0] * experts
    for a, e in enumerate(ids.flatten().tolist()):
        routed[e] += 1
        if len(mine[e]) < caps[e]:
            mine[e].append(a)
    source, dest, row_weights, block_experts = [], [], [], []
    for e in range(experts):
        for a in mine[e]:
            slots[a] = len(dest)
            source.append(a // top_k)
            dest.append(a)
            row_weights.append(weights.flatten()[a].item())
        padding = -len(mine[e]) % align
        source += [0] * padding
        dest += [-1] * padding
        row_weights += [0.0] * padding
        block_experts += [e] * ((len(mine[e]) + padding) // align)
    return dict(used=len(dest), source=source, dest=dest, weights=row_weights, block_experts=block_experts,
                counts=routed, kept=[len(m) for m in mine], slots=slots)


def _assert_same_layout(got, want):
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (field.name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


# (tokens, top_k, experts, align, capacity, skew): assignments 130 and 300 leave tails on the
# kernel's 64-assignment blocks; 3 experts empty; a one-token expert; every token to expert 2;
# capacities hit, exactly met, 0 and one row
CASES = {
    "random, ragged tails": (65, 2, 6, 8, None, None),
    "empty experts": (40, 2, 8, 4, None, [1, 0, 1, 1, 0, 1, 0, 1]),
    "one-token experts": (33, 2, 5, 8, None, ("lone", 2, 4)),
    "all tokens to one expert": (70, 1, 4, 16, None, [0, 0, 1, 0]),
    "capacity hit, skewed": (100, 3, 5, 4, 40, [8, 1, 1, 1, 1]),
    "capacity met exactly": (64, 2, 4, 8, 32, "round robin"),
    "capacity 1": (20, 2, 4, 8, 1, None),
    "capacity 0": (10, 2, 4, 8, 0, None),
}


@pytest.mark.parametrize("case", CASES)
def test_reference_follows_the_spec_token_by_token(case):
    tokens, top_k, experts, align, capacity, skew = CASES[case]
    ids, weights = _routing(tokens, top_k, experts, skew=skew)
    layout = sort_by_expert(ids, weights, experts, align, capacity=capacity)
    spec = _spec(ids, weights, experts, align, capacity)
    used = int(layout.used_rows)
    assert used == spec["used"] and layout.rows == padded_rows(tokens * top_k, experts, align, capacity) >= used
    assert layout.counts.tolist() == spec["counts"] and layout.kept.tolist() == spec["kept"]
    assert layout.slots.flatten().tolist() == spec["slots"]
    assert layout.source_rows[:used].tolist() == spec["source"] and (layout.source_rows[used:] == 0).all()
    assert layout.dest_rows[:used].tolist() == spec["dest"] and (layout.dest_rows[used:] == -1).all()
    assert layout.weights[:used].tolist() == pytest.approx(spec["weights"], rel=1e-7)
    assert layout.block_experts[:used // align].tolist() == spec["block_experts"]
    assert (layout.block_experts[used // align:] == experts - 1).all()  # past used_rows: clamped, never read
    if capacity is not None:  # drops counted exactly: every assignment past the capacity, nothing else
        dropped = (layout.counts - layout.kept).tolist()
        assert dropped == [max(0, c - capacity) for c in spec["counts"]]
        assert sum(dropped) == (layout.slots < 0).sum() and (sum(dropped) > 0) == ("met" not in case)


@pytest.mark.parametrize("case", CASES)
def test_kernel_dispatch_equals_the_reference(case):
    tokens, top_k, experts, align, capacity, skew = CASES[case]
    ids, weights = _routing(tokens, top_k, experts, skew=skew)
    _assert_same_layout(dispatch(ids, weights, experts, align, capacity=capacity),
                        sort_by_expert(ids, weights, experts, align, capacity=capacity))


def test_kernel_dispatch_takes_int32_ids_half_weights_and_no_tokens():
    ids, weights = _routing(50, 2, 5, seed=2)
    ids32, half = ids.int(), weights.half()
    _assert_same_layout(dispatch(ids32, half, 5, 8), sort_by_expert(ids32, half, 5, 8))
    empty_ids, empty_weights = ids[:0], weights[:0]
    layout = dispatch(empty_ids, empty_weights, 5, 8, capacity=3)
    _assert_same_layout(layout, sort_by_expert(empty_ids, empty_weights, 5, 8, capacity=3))
    assert int(layout.used_rows) == 0 and layout.slots.shape == (0, 2)


def test_a_per_expert_capacity_leaves_the_shared_expert_uncapped():
    tokens, experts = 40, 4
    ids, weights = append_shared_experts(*_routing(tokens, 2, experts, seed=5), experts, 1)
    cap = expert_capacity(tokens, 2, experts, 1.0)
    capacity = torch.tensor([cap] * experts + [tokens])
    layout = dispatch(ids, weights, experts + 1, 8, capacity=capacity)
    _assert_same_layout(layout, sort_by_expert(ids, weights, experts + 1, 8, capacity=capacity))
    assert layout.kept[-1] == tokens and layout.counts[-1] == tokens
    spec = _spec(ids, weights, experts + 1, 8, [cap] * experts + [tokens])
    assert layout.slots.flatten().tolist() == spec["slots"]


def test_capacity_formula_and_the_row_bound():
    assert expert_capacity(4096, 8, 256, 1.0) == 128
    assert expert_capacity(4096, 8, 256, 1.25) == 160
    assert expert_capacity(10, 3, 4, 1.0) == 8  # ceil(7.5)
    assert expert_capacity(1, 1, 8, 1.0) == 1
    with pytest.raises(ValueError, match="capacity factor"):
        expert_capacity(10, 2, 4, 0.0)
    assert padded_rows(100, 4, 8) == 128 and padded_rows(100, 4, 8, capacity=10) == 64
    assert padded_rows(100, 4, 8, capacity=0) == 0


def test_refusals():
    ids, weights = _routing(4, 2, 4)
    for capacity, message in [(-1, "capacity must be"), (torch.tensor([1.0] * 4), "per-expert capacity"),
                              (torch.tensor([1, 2]), "per-expert capacity")]:
        for route in (dispatch, sort_by_expert, moe_dispatch):
            with pytest.raises(ValueError, match=message):
                route(ids, weights, 4, 8, capacity=capacity)
    with pytest.raises(ValueError, match="both be"):
        dispatch(ids[:, 0], weights, 4, 8)


# --- the loads -------------------------------------------------------------------------------------

def test_loads_of_seed_003s_balanced_routing():
    # 32 tokens, top-1, 4 experts, tiles of 8: 8 tokens each, one full tile each, 100% useful
    ids = torch.arange(32).div(8, rounding_mode="floor")[:, None]
    layout = sort_by_expert(ids, torch.ones(32, 1), 4, 8)
    assert [(x.routed, x.kept, x.tiles, x.padding, x.dropped, x.utilization) for x in expert_loads(layout)] == \
        [(8, 8, 1, 0, 0, 1.0)] * 4


def test_loads_count_padding_and_drops():
    ids = torch.tensor([0] * 11 + [1] * 3 + [3] * 2)[:, None]  # expert 2 empty
    loads = expert_loads(sort_by_expert(ids, torch.ones(16, 1), 4, 4, capacity=9))
    assert [tuple(x) for x in loads] == [(0, 11, 9, 2, 3, 3, 0.75), (1, 3, 3, 0, 1, 1, 0.75), (2, 0, 0, 0, 0, 0, None),
                                         (3, 2, 2, 0, 1, 2, 0.5)]


# --- combine ---------------------------------------------------------------------------------------

def _combine_case(dtype, capacity=None, seed=0):
    ids, weights = _routing(30, 3, 5, seed=seed, skew=[4, 1, 1, 1, 1])
    layout = sort_by_expert(ids, weights, 5, 8, capacity=capacity)
    g = torch.Generator().manual_seed(seed + 1)
    out = torch.randn(layout.rows, 40, generator=g).to(dtype)
    out[layout.dest_rows < 0] = float("nan")  # padding rows: the combine must never read them
    return layout, weights, out


# bf16 on the GPU only: the interpreter's fp32 -> bf16 conversion truncates where the GPU rounds
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "sum"])
def test_kernel_combine_equals_the_reference(dtype, weighted, nan_outputs):
    layout, weights, out = _combine_case(dtype, capacity=12)
    w = weights if weighted else None
    got = combine(out, layout.slots, w)
    want = combine_reference(out, layout.slots, w)
    assert got.dtype == dtype and got.shape == (30, 40) and not torch.isnan(got).any()
    assert torch.equal(got, want)
    assert torch.equal(combine(out, layout.slots, w, torch.float32), combine_reference(out, layout.slots, w,
                                                                                        torch.float32))


def test_combine_through_identity_experts_gives_each_token_its_kept_weight():
    # expert e's output is its input row: y_t = x_t * (sum of t's kept weights); a dropped one adds 0
    tokens, hidden = 30, 24
    ids, weights = _routing(tokens, 3, 5, seed=1, skew=[4, 1, 1, 1, 1])
    layout = dispatch(ids, weights, 5, 8, capacity=12)
    assert (layout.slots < 0).any()  # some assignments dropped
    x = torch.randn(tokens, hidden, dtype=torch.float64).float()
    y = combine(x[layout.source_rows], layout.slots, weights)
    kept_weight = torch.where(layout.slots >= 0, weights, 0.0).double().sum(1, keepdim=True)
    torch.testing.assert_close(y.double(), x.double() * kept_weight, rtol=1e-6, atol=1e-6)


def test_combine_refusals_and_no_tokens():
    layout, weights, out = _combine_case(torch.float32)
    with pytest.raises(ValueError, match="must match"):
        combine(out, layout.slots, weights[:, :2])
    with pytest.raises(ValueError, match="slots integer"):
        combine(out, layout.slots.float())
    assert combine(out, layout.slots[:0], weights[:0]).shape == (0, 40)


def test_the_ops_pass_opcheck_compile_and_run_the_references_on_the_cpu():
    ids, weights = _routing(30, 2, 6, seed=4)
    per_expert = torch.tensor([7, 7, 7, 7, 7, 60])
    for capacity in (None, 7, per_expert):
        _assert_same_layout(moe_dispatch(ids, weights, 6, 8, capacity=capacity),
                            sort_by_expert(ids, weights, 6, 8, capacity=capacity))
    for scalar, tensor in ((-1, None), (7, None), (-1, per_expert)):
        torch.library.opcheck(torch.ops.kforge.moe_dispatch.default, (ids, weights, 6, 8, scalar, tensor))
    layout = moe_dispatch(ids, weights, 6, 8, capacity=7)
    out = torch.randn(layout.rows, 16)
    assert torch.equal(moe_combine(out, layout.slots, weights), combine_reference(out, layout.slots, weights))
    torch.library.opcheck(torch.ops.kforge.moe_combine.default, (out, layout.slots, weights, torch.bfloat16))
    torch.library.opcheck(torch.ops.kforge.moe_combine.default, (out, layout.slots, None, torch.float32))
    compiled = torch.compile(lambda w: moe_combine(out, moe_dispatch(ids, w * 2, 6, 8, capacity=7).slots, w) + 1,
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(weights), combine_reference(out, layout.slots, weights) + 1)


# --- kforge trace moe ------------------------------------------------------------------------------

def _kforge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_trace_moe_prints_seed_003s_table(tmp_path):
    logits = torch.full((32, 4), -5.0)
    logits[torch.arange(32), torch.arange(32) // 8] = 5.0  # 8 tokens to each expert
    torch.save(logits, tmp_path / "logits.pt")
    done = _kforge("trace", "moe", "logits.pt", "--top-k", "1", "--align", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for header in ("expert", "routed", "kept", "dropped", "tiles", "padding rows", "utilization"):
        assert header in done.stdout
    rows = [line.split("│")[1:-1] for line in done.stdout.splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows[:4]] == [[f"E{e}", "8", "8", "0", "1", "0", "100%"]
                                                                    for e in range(4)]
    assert "32 row slots to do 32 real ones: 100% useful" in " ".join(done.stdout.split())


def _kforge_here(*args, monkeypatch, capsys):
    """(exit status, stdout, stderr) of the kforge command run in this process."""
    from kforge.cli import main

    monkeypatch.setattr(sys, "argv", ["kforge", *map(str, args)])
    with pytest.raises(SystemExit) as done:
        main()
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def test_trace_moe_json_from_npy_with_a_capacity_and_bad_input(tmp_path, monkeypatch, capsys):
    import numpy as np

    path = tmp_path / "skewed.npy"
    np.save(path, np.tile(np.array([[3.0, 0.0, 0.0, 0.0]], dtype=np.float32), (20, 1)))
    run = dict(monkeypatch=monkeypatch, capsys=capsys)
    code, out, err = _kforge_here("trace", "moe", path, "--top-k", "1", "--align", "4", "--capacity-factor", "1.0",
                                  "--json", **run)
    assert code == 0, err
    trace = json.loads(out)
    assert trace["capacity"] == 5 and trace["rows"][0]["routed"] == 20 and trace["rows"][0]["dropped"] == 15
    assert trace["total"] == {"routed": 20, "kept": 5, "dropped": 15, "tiles": 2, "padding": 3, "utilization": 0.625}
    code, out, err = _kforge_here("trace", "moe", "--random", "16,8", "--gating", "sigmoid", "--groups", "4",
                                  "--topk-groups", "2", "--top-k", "4", "--align", "4", "--json", **run)
    assert code == 0 and json.loads(out)["total"]["routed"] == 64, err
    torch.save(torch.zeros(5), tmp_path / "vector.pt")
    for args in (["--random", "16"], [tmp_path / "missing.pt"], [tmp_path / "vector.pt"], [path, "--random", "4,4"],
                 ["--random", "8,4", "--groups", "2"], ["--random", "8,4", "--top-k", "5"],
                 ["--random", "8,4", "--capacity-factor", "0"]):
        code, out, err = _kforge_here("trace", "moe", *args, **run)
        assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, (args, err)


# --- the machine code ------------------------------------------------------------------------------

_COMPILE_SM90 = textwrap.dedent(r"""
    import json, os, re
    os.environ["TRITON_INTERPRET"] = "0"  # compile for sm_90 on a machine with no GPU
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.kernels.moe import dispatch as dp, gating as gt
    from kforge.runtime.cuda import Cubin, sass

    i32, i64, f32 = "*i32", "*i64", "*fp32"
    kernels = [
        (gt.gating_kernel, dict(logits_ptr="*bf16", bias_ptr=f32, ids_ptr=i32, weights_ptr=f32, stride_t="i32",
                                GROUP_SIZE="i32", scale="fp32"),
         dict(N_GROUP=8, BLOCK_G=8, BLOCK_S=32, TOP_K=8, BLOCK_K=8, TOPK_GROUP=4, SIGMOID=True, HAS_BIAS=True,
              GROUPED=True, RENORMALIZE=True), dict(num_warps=1, enable_fp_fusion=False)),
        (gt.gating_kernel, dict(logits_ptr=f32, bias_ptr=f32, ids_ptr=i32, weights_ptr=f32, stride_t="i32",
                                GROUP_SIZE="i32", scale="fp32"),
         dict(N_GROUP=1, BLOCK_G=1, BLOCK_S=512, TOP_K=16, BLOCK_K=16, TOPK_GROUP=1, SIGMOID=False,
              HAS_BIAS=False, GROUPED=False, RENORMALIZE=True), dict(num_warps=2, enable_fp_fusion=False)),
        (dp.histogram_kernel, dict(ids_ptr=i32, block_counts_ptr=i32, A="i32", E="i32"),
         dict(BLOCK=dp.BLOCK, BLOCK_E=256), {}),
        (dp.scan_kernel, dict(block_counts_ptr=i32, block_offsets_ptr=i32, counts_ptr=i64, num_blocks="i32",
                              E="i32"), dict(SCAN_BLOCKS=dp.SCAN_BLOCKS, SCAN_EXPERTS=dp.SCAN_EXPERTS), {}),
        (dp.layout_kernel, dict(counts_ptr=i64, capacity_ptr=i64, kept_ptr=i64, run_starts_ptr=i64,
                                used_rows_ptr=i32, block_experts_ptr=i32, E="i32", row_blocks="i32"),
         dict(ALIGN=128, BLOCK_E=256, ROW_BLOCKS=dp.ROW_BLOCKS), {}),
        (dp.scatter_kernel, dict(ids_ptr=i64, weights_ptr=f32, block_offsets_ptr=i32, capacity_ptr=i64,
                                 run_starts_ptr=i64, source_rows_ptr=i64, dest_rows_ptr=i32, row_weights_ptr=f32,
                                 slots_ptr=i32, A="i32", E="i32"), dict(TOP_K=8, BLOCK=dp.BLOCK), {}),
        (dp.combine_kernel, dict(out_ptr="*bf16", expert_ptr="*bf16", slots_ptr=i32, weights_ptr=f32, H="i32",
                                 stride_expert="i32", stride_out="i32"),
         dict(TOP_K=9, BLOCK_H=dp.COMBINE_H, WEIGHTED=True), dict(enable_fp_fusion=False)),
    ]
    found = []
    for fn, types, constants, options in kernels:
        source = ASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in fn.arg_names}, constexprs=constants)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        code = sass(Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], ""))
        found.append(dict(name=fn.__name__, spills=len(re.findall(r"\b(STL|LDL)\b", code)),
                          fma="enable_fp_fusion" in options and bool(re.search(r"\bFFMA\b", code))))
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_every_routing_kernel_compiles_for_sm90_without_spills():
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 7
    for kernel in found:
        assert kernel["spills"] == 0, kernel
    assert not found[-1]["fma"]  # the combine's products round before they are added, as PyTorch's do


# --- on the GPU ------------------------------------------------------------------------------------

def _deepseek_routing():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 256, generator=g).cuda()
    bias = (0.1 * torch.randn(256, generator=g)).cuda()
    return gating_reference(logits, Gating("sigmoid", 8, n_group=8, topk_group=4, routed_scaling_factor=2.5), bias)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["uncapped", "capacity 1.0"])
def test_deepseek_v3_dispatch_and_combine_on_the_gpu(capacity_factor):
    ids, weights = _deepseek_routing()
    capacity = None if capacity_factor is None else expert_capacity(4096, 8, 256, capacity_factor)
    layout = dispatch(ids, weights, 256, 128, capacity=capacity)
    _assert_same_layout(layout, sort_by_expert(ids, weights, 256, 128, capacity=capacity))
    _assert_same_layout(dispatch(ids, weights, 256, 128, capacity=capacity), layout)  # the same every run
    out = torch.randn(layout.rows, 7168, device="cuda").bfloat16()
    for w in (weights, None):
        assert torch.equal(combine(out, layout.slots, w), combine_reference(out, layout.slots, w))
