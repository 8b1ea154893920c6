"""The CUDA FlashAttention forward for Hopper (kernels/attention/flash_hopper.cu and .py, its parts in
hopper_attention.cuh). On any machine: every build (head dim 64/128, causal or not, bf16/fp16)
compiled for sm_90a, its registers, spills and shared memory, and its key-tile loops read from the
machine code (both products on wgmma, the ping-pong barriers, one exp2 a score, the softmax under the
P V); the parts compiled alone; the causal tile range checked against a brute force at compile time;
the wrapper's refusals. On a Hopper GPU: against float64 attention on odd shapes (lengths 1, 127,
129, 1000; GQA 4:1; causal or not), LSE included, into NaN-poisoned buffers, and at the bench shape."""

import re

import pytest
import torch

from kforge.kernels.attention import flash_hopper
from kforge.kernels.attention.flash_hopper import (check_hopper_inputs, flash_attention_hopper, kernel_defines,
                                                   shared_bytes)
from kforge.kernels.attention.naive import naive_attention
from kforge.runtime.cuda import CudaCompileError, compile_cuda, resources, sass, sass_loop_instructions

BUILDS = [(d, causal, dtype) for d in flash_hopper.HEAD_DIMS for causal in (False, True)
          for dtype in (torch.bfloat16, torch.float16)]
PARTS = flash_hopper.SOURCE.with_name("hopper_attention.cuh")
MAX_REGISTERS = 65536 // flash_hopper.THREADS // 8 * 8  # __launch_bounds__(384, 1): 168 a thread at launch


def _build_id(build):
    d, causal, dtype = build
    return f"hd{d}-{'causal' if causal else 'full'}-{str(dtype).removeprefix('torch.')}"


def key_tile_loops(code: str) -> list[list[str]]:
    """The consumers' key-tile loops in `sass` text, each as its instructions (predicates dropped):
    the loops whose bodies hold wgmmas and no TMA load. (The other loops are the mbarrier waits'
    retries, out of line at the end of the code, and the producer's loop.)"""
    return [body for body in sass_loop_instructions(code)
            if any(t.startswith("HGMMA") for t in body) and not any(t.startswith("UTMALDG") for t in body)]


# --- the compiled kernel, on any machine ------------------------------------------------------

@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
@pytest.mark.slow
def test_every_build_fits_its_launch_bounds_without_spills(build):
    d, causal, dtype = build
    defines = kernel_defines(d, causal, dtype)
    cubin = compile_cuda(flash_hopper.SOURCE, arch="sm_90a", defines=defines, options=flash_hopper.OPTIONS)
    used = resources(cubin)[flash_hopper.KERNEL]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes, used.local_bytes) == (0, 0, 0, 0)
    assert used.registers <= MAX_REGISTERS, "three warpgroups must fit one SM's registers at launch"
    # setmaxnreg moves registers within the CTA's pool: the consumers' 240 are only there if the producer's
    # 24 plus theirs fit what the launch allocated (fewer at launch: their raise would spin forever)
    assert 128 * 24 + 256 * 240 <= used.registers * flash_hopper.THREADS, used.registers
    code = sass(cubin)
    assert not re.search(r"\b(STL|LDL)\b", code), "local memory in the machine code"
    # registers move from the producer to the consumers (24 / 240 a thread), and ptxas did as told
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in code and "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in code
    assert "C7508" not in cubin.ptxas_log, "ptxas ignored setmaxnreg"
    instructions = [line.split("*/", 1)[1] for line in code.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    dealloc = next(i for i, text in enumerate(instructions) if "USETMAXREG.DEALLOC" in text)

    def registers(texts):
        return 1 + max(int(r) for text in texts for r in re.findall(r"\bR(\d+)\b", text))

    # (what follows the producer's dealloc: its code and the waits' out-of-line retries, all under 24)
    assert registers(instructions) <= 240 and registers(instructions[dealloc:]) <= 24
    assert "serialized" not in cubin.ptxas_log, "ptxas serialized the wgmmas"
    assert shared_bytes(defines) <= 227 * 1024


@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
@pytest.mark.slow
def test_key_tile_loops_issue_both_products_and_run_the_softmax_under_the_p_v(build):
    """Both loops (the masked tiles, then the rest) per key tile: S = Q K^T as d/16 wgmmas from
    shared memory, P V as 8 wgmmas with P from registers and V read transposed; one exp2 a score (64
    a thread) plus one a row (the rescale), 32 conversions of P to 16 bits, two quad max reductions
    (the row sums add up across the quad only at the end); one turn of the ping-pong; the K and V
    waits and releases. The P V is waited for at the loop's top (0 groups left) and S just before
    the softmax (1 left: the P V), with every exp2 after that: the softmax runs while the P V does.
    Only the masked loop selects (-inf past n_k or the diagonal; 0 for a row that has seen no key)."""
    d, causal, dtype = build
    code = sass(compile_cuda(flash_hopper.SOURCE, arch="sm_90a", defines=kernel_defines(d, causal, dtype),
                             options=flash_hopper.OPTIONS))
    kind = r"\.F32\.BF16" if dtype == torch.bfloat16 else r"\.F32"
    loops = key_tile_loops(code)
    assert len(loops) == 2, f"{len(loops)} key-tile loops"
    for body in loops:
        def count(pattern):
            return sum(bool(re.match(pattern, t)) for t in body)

        assert count(rf"HGMMA\.64x128x16{kind} R\d+, gdesc\[UR\d+\], R(Z|\d+)") == d // 16, "S = Q K^T"
        assert count(rf"HGMMA\.64x{d}x16{kind} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB, R\d+") == 8, "P V, P in registers"
        assert count(r"MUFU\.EX2\b") == 64 + 2
        # log2(e) folded into the scale: one FFMA a score (s scale - m) and 2 for the row sums; the only
        # multiplies are O's rescale (d/2 a thread) and the 2 row maxima's scale
        assert count(r"FFMA\b") == 64 + 2 and count(r"FMUL\b") == d // 2 + 2
        assert count(r"F2FP\.(BF16|F16)\.F32\.PACK_AB\b") == 32
        assert count(r"SHFL\.BFLY\b") == 4
        assert count(r"BAR\.SYNC\b") == 1 and count(r"BAR\.ARV\b") == 1, "one turn of the ping-pong"
        assert count(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b") == 2 and count(r"SYNCS\.ARRIVE\b") == 2, "K and V"
        waits = [(i, t) for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR")]
        assert [t.split()[-1] for _, t in waits] == ["0x0", "0x1"], waits
        exps = [i for i, t in enumerate(body) if t.startswith("MUFU.EX2")]
        assert min(exps) > waits[-1][0], "an exp2 before S has landed, or the P V waited for before the softmax"
    masked, unmasked = sorted(loops, key=lambda body: -sum(t.startswith("FSEL") for t in body))
    assert sum(t.startswith("FSEL") for t in masked) == 64 + 2 and not any(t.startswith("FSEL") for t in unmasked)


@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
@pytest.mark.slow
def test_every_build_loads_and_stores_through_4d_tensor_maps(build):
    d, causal, dtype = build
    code = sass(compile_cuda(flash_hopper.SOURCE, arch="sm_90a", defines=kernel_defines(d, causal, dtype),
                             options=flash_hopper.OPTIONS))
    assert "UTMALDG.4D" in code and "UTMASTG.4D" in code
    assert code.count("UTMASTG.4D") == d // 64, "O goes out as one box a 64-column chunk"
    assert code.count("STSM.16.M88.4") == d // 16, "the output rows into shared memory, 4 matrices a stmatrix"
    assert not re.search(r"\bSTG\.E\.(64|128)\b", code), "the output goes through TMA, not stores"


@pytest.mark.slow
def test_the_launcher_and_the_kernel_agree_on_shared_memory(tmp_path):
    """flash_hopper.shared_bytes is the source's SHARED_BYTES (the kernel traps on less), for the
    default stages and for given ones."""
    for d in flash_hopper.HEAD_DIMS:
        # (hd 128 at 3 K and 4 V stages would not fit)
        for i, extra in enumerate(({}, {"V_STAGES": 2}, *([{"STAGES": 3}] if d == 64 else []))):
            defines = {**kernel_defines(d, False, torch.bfloat16), **extra}
            source = tmp_path / f"shared_{d}_{i}.cu"
            source.write_text(f'#include "{flash_hopper.SOURCE}"\n'
                              f'static_assert(SHARED_BYTES == {shared_bytes(defines)}, "shared bytes differ");\n')
            compile_cuda(source, arch="sm_90a", defines=defines, options=flash_hopper.OPTIONS, cache=False)


def _brute_force_tiles(m0, block_m, block_n, n_k, causal):
    """(count, unmasked) by looking at every (row, key) pair of the query tile."""
    rows = torch.arange(m0, m0 + block_m)[:, None]
    count, unmasked, prefix = 0, 0, True
    for tile in range(-(-n_k // block_n)):
        keys = torch.arange(tile * block_n, (tile + 1) * block_n)[None, :]
        seen = (keys < n_k) & (keys <= rows if causal else True)
        if seen.any():
            count = tile + 1
        prefix = prefix and bool(seen.all())
        unmasked += prefix
    return count, unmasked


@pytest.mark.slow
def test_key_tiles_skip_every_tile_above_the_diagonal_and_mask_only_where_needed(tmp_path):
    """hopper_attention.cuh's key_tiles, which both the producer and the consumers walk, against a
    brute force over (row, key) pairs, evaluated by the compiler (static_asserts): a query tile
    loads exactly the key tiles holding a key some row sees (causal: none wholly above the diagonal),
    and runs unmasked exactly those every row sees whole."""
    cases = [(m0, bm, bn, n_k, causal) for bm, bn in ((128, 128), (64, 128), (128, 64))
             for m0 in range(0, 640, bm) for n_k in (1, 63, 64, 127, 128, 129, 255, 256, 300, 511, 700)
             for causal in (False, True)]
    lines = [f'#include "{PARTS}"']
    for m0, bm, bn, n_k, causal in cases:
        count, unmasked = _brute_force_tiles(m0, bm, bn, n_k, causal)
        call = f"key_tiles({m0}, {bm}, {bn}, {n_k}, {str(causal).lower()})"
        lines.append(f'static_assert({call}.count == {count} && {call}.unmasked == {unmasked}, "{call}");')
    source = tmp_path / "key_tiles.cu"
    source.write_text("\n".join(lines) + "\n")
    try:
        compile_cuda(source, arch="sm_90a", options=flash_hopper.OPTIONS, cache=False)
    except CudaCompileError as error:
        pytest.fail(f"key_tiles disagrees with the brute force: {error}")
    kernel = flash_hopper.SOURCE.read_text()
    assert "key_tiles(m0, BLOCK_M, BLOCK_N, n_k, CAUSAL)" in kernel, "the kernel walks what key_tiles says"


PARTS_KERNEL = """
extern "C" __global__ void k(const __grid_constant__ TensorMap map, float* out, u32 bits, float scale, int n_k) {
    __shared__ __align__(1024) bf16_bits tile[2 * 64 * 64];
    __shared__ __align__(8) u64 bar;
    tma_load_4d(tile, map, &bar, 0, 64, 1, 2);
    float s[64], o[64];
    u32 p[32];
    for (int i = 0; i < 64; ++i) s[i] = out[i * 128 + threadIdx.x], o[i] = 0.0f;
    wgmma_fence();
    wgmma_qk<FP16>(s, kmajor_desc(tile, 0), kmajor_desc(tile, 1), 1);
    wgmma_commit();
    wgmma_wait<0>();
    pin(s);
    OnlineSoftmax<128> softmax;
    softmax.tile<MASKED>(s, scale, 0, n_k, n_k + 8);
    scores_to_operand<128, FP16>(s, p);
    wgmma_fence();
    for (int ks = 0; ks < 8; ++ks) {
        const u32 a[4] = {p[4 * ks], p[4 * ks + 1], p[4 * ks + 2], p[4 * ks + 3]};
        wgmma_pv<128, FP16>(o, a, smem_desc(tile, 128 * 128, 1024), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin(o);
    named_barrier_arrive(1, 256);
    const float2 row = softmax.finish(0);
    store_rows_swizzled<128, 64 * 64, FP16>(o, tile, row.x, softmax.finish(1).x);
    fence_proxy_async();
    tma_store_4d(map, tile, 0, 0, 0, 0);
    bulk_commit();
    bulk_wait_read();
    out[threadIdx.x] = row.y + __uint_as_float(bits);
}"""


@pytest.mark.parametrize("fp16", [0, 1])
@pytest.mark.parametrize("masked", [0, 1])
@pytest.mark.slow
def test_the_attention_parts_compile_alone_to_their_instructions(fp16, masked, tmp_path):
    """hopper_attention.cuh in a one-tile kernel: 4-D TMA both ways, the two wgmma forms (S from shared
    memory; P V with P in registers, V transposed), the ping-pong's arrive, the online softmax at one
    MUFU.EX2 a score plus one a row (64 + 2 for a thread's share of a 64 x 128 tile), P packed with
    no shuffles (32 conversions), the output through stmatrix; no spills."""
    text = PARTS.read_text()
    assert text.startswith("// Hopper attention parts") and "#pragma once" in text
    source = tmp_path / "parts.cu"
    source.write_text(f'#include "{PARTS}"\n#define FP16 {fp16}\n#define MASKED {str(bool(masked)).lower()}\n'
                      + PARTS_KERNEL)
    cubin = compile_cuda(source, arch="sm_90a", options=flash_hopper.OPTIONS, cache=False)
    code = sass(cubin)
    kind = r"\.F32\.BF16" if not fp16 else r"\.F32"
    for pattern in ("UTMALDG.4D", "UTMASTG.4D", rf"HGMMA\.64x128x16{kind} R\d+, gdesc",
                    rf"HGMMA\.64x128x16{kind} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", r"BAR\.ARV", r"STSM\.16\.M88\.4"):
        assert re.search(pattern, code), f"no {pattern} in the machine code"
    assert len(re.findall(r"\bMUFU\.EX2\b", code)) == 64 + 2
    # 32 for P, 32 for the output rows
    assert len(re.findall(rf"\bF2FP\.{'F16' if fp16 else 'BF16'}\.F32\.PACK_AB\b", code)) == 32 + 32
    assert len(re.findall(r"\bFSEL\b", code)) >= (64 if masked else 0)
    used = resources(cubin)["k"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0)


def test_the_kernel_header_says_what_it_does_and_does_not_do_yet():
    text = flash_hopper.SOURCE.read_text()
    assert text.startswith("// FlashAttention forward for Hopper")
    for words in ("Tiling:", "Not yet", "Measured (H200", "TFLOP/s", "cuDNN"):
        assert words in text, words


# --- the wrapper's refusals, on any machine ---------------------------------------------------

def _qkv(b=1, h=4, hk=2, nq=16, nk=16, d=64, dtype=torch.bfloat16, device="cpu"):
    return (torch.zeros(b, h, nq, d, dtype=dtype, device=device), torch.zeros(b, hk, nk, d, dtype=dtype, device=device),
            torch.zeros(b, hk, nk, d, dtype=dtype, device=device))


@pytest.mark.parametrize("args, message", [
    (_qkv(dtype=torch.float32), "takes bfloat16 or float16, got torch.float32"),
    (_qkv(d=32), "takes head_dim 64 or 128, got 32"),
    (_qkv(d=256), "takes head_dim 64 or 128, got 256"),
    (_qkv(), r"runs on a CUDA device \(sm_90\); q is on cpu"),
    ((torch.zeros(4, 16, 64), *_qkv()[1:]), "must be 4-D"),
    (_qkv(h=3), r"multiple of key/value heads"),
    ((_qkv()[0], _qkv()[1], _qkv(nk=8)[2]), "k and v must be"),
    ((_qkv()[0], _qkv()[1].transpose(2, 3).contiguous().transpose(2, 3), _qkv()[2]), "contiguous last dimension"),
    (_qkv(nk=0), "no keys"),
])
def test_bad_inputs_are_refused_with_one_line(args, message):
    with pytest.raises(ValueError, match=message) as error:
        flash_attention_hopper(*args)
    assert "\n" not in str(error.value)


def test_scale_is_checked_and_defaults_to_one_over_sqrt_d():
    q, k, v = _qkv(dtype=torch.float16)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        check_hopper_inputs(q, k, v, -1.0)
    with pytest.raises(ValueError, match="runs on a CUDA device"):  # everything else passed: the device is last
        check_hopper_inputs(q, k, v, 0.5)


def test_bench_times_the_cuda_kernel_on_hopper_only(monkeypatch):
    from kforge.bench import attention as bench

    target = next(s for s in bench.attention_shapes() if (s.seq, s.head_dim, s.causal) == (4096, 128, False))
    monkeypatch.setattr(bench, "hopper_gpu", lambda: True)
    assert set(bench.attention_methods(target)) == {"ours", "ours-cuda", "naive", "sdpa-cudnn", "sdpa-efficient"}
    assert all("ours-cuda" in bench.attention_methods(s) for s in bench.attention_shapes())  # hd 64 and 128
    monkeypatch.setattr(bench, "hopper_gpu", lambda: False)
    assert "ours-cuda" not in bench.attention_methods(target)
    assert bench.hbm_bytes("ours-cuda", target.sizes) == bench.hbm_bytes("ours", target.sizes)


# --- on a Hopper GPU ----------------------------------------------------------------------------

def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _inputs(shape, dtype, seed=0):
    b, h, hk, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n_h, n, d, generator=g).to(dtype=dtype, device="cuda")
            for n_h, n in ((h, nq), (hk, nk), (hk, nk))]


def _poison(q):
    """NaN buffers the size of the output (q's dtype) and the LSE (fp32), freed together: the caching
    allocator hands the same blocks to the kernel's outputs, so anything it does not write stays NaN."""
    buffers = [torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda"),
               torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")]
    del buffers


def _check(shape, dtype, causal, seed=0, scale=None):
    q, k, v = _inputs(shape, dtype, seed)
    _poison(q)
    out, lse = flash_attention_hopper(q, k, v, causal=causal, scale=scale)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal, scale=scale, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert not out.isnan().any() and not lse.isnan().any(), "an output or LSE element was never written"
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


# (batch, heads, kv_heads, seq_q, seq_k): one row and one key, a tile less one and plus one, 1000 with
# GQA 4:1, a short query block over many keys, more queries than keys, a single query
ODD = [(1, 4, 4, 1, 1), (1, 4, 1, 127, 127), (1, 4, 1, 129, 129), (2, 8, 2, 1000, 1000), (1, 4, 4, 77, 300),
       (1, 4, 1, 513, 129), (1, 4, 1, 1, 1000)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", flash_hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_on_odd_shapes(head_dim, causal, dtype):
    for i, (b, h, hk, nq, nk) in enumerate(ODD):
        _check((b, h, hk, nq, nk, head_dim), dtype, causal, seed=i)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
def test_scale_strided_inputs_and_back_to_back_calls():
    """A given scale; q, k, v as transposed views of (batch, seq, heads, d) (the 4-D maps read them
    in place, O keeps q's layout); calls queued without a synchronize each read their own inputs."""
    _check((1, 4, 2, 300, 300, 128), torch.bfloat16, True, scale=0.3)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 333, n, 64, generator=g).to(torch.bfloat16).cuda().transpose(1, 2) for n in (8, 2, 2))
    out, _ = flash_attention_hopper(q, k, v)
    assert out.stride() == q.stride()
    torch.testing.assert_close(out.double(), naive_attention(q.double(), k.double(), v.double()), rtol=2e-2,
                               atol=1e-2)
    sets = [_inputs((2, 8, 2, 700, 700, 128), torch.bfloat16, seed) for seed in range(4)]
    results = [flash_attention_hopper(*qkv, causal=True)[0] for qkv in sets]
    for got, (q, k, v) in zip(results, sets):
        torch.testing.assert_close(got.double(), naive_attention(q.double(), k.double(), v.double(), causal=True),
                                   rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("causal", [False, True])
def test_the_bench_shape_matches_float64(causal):
    """B 8, H 16, N 4096, hd 128 (`kforge bench attention`'s target): 4096 CTAs, causal ones
    longest first; checked one batch element at a time against float64."""
    q, k, v = _inputs((8, 16, 16, 4096, 4096, 128), torch.bfloat16, seed=3)
    _poison(q)
    out, lse = flash_attention_hopper(q, k, v, causal=causal)
    assert not out.isnan().any() and not lse.isnan().any()
    for b in range(8):
        ref, ref_lse = naive_attention(q[b:b + 1].double(), k[b:b + 1].double(), v[b:b + 1].double(), causal=causal,
                                       return_lse=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref, rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=1e-4, atol=1e-4)

