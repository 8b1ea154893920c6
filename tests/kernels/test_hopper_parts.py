"""The Hopper parts (src/kforge/kernels/hopper/), each compiled alone into a tiny sm_90a kernel on
the CPU: the instructions each part exists to emit are in the machine code (the pipeline's
mbarrier SYNCS ops, TMA's UTMALDG / UTMASTG, wgmma's HGMMA and QGMMA (e4m3), stmatrix's STSM,
ldmatrix's LDSM), and nothing spills. The kernels built on them (gemm_bf16's rungs through
hopper.cuh, quant/fp8_block_gemm.cu) are checked by their own tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kforge.runtime.cuda import compile_cuda, resources, sass

PARTS = Path(__file__).resolve().parents[2] / "src" / "kforge" / "kernels" / "hopper"

# part -> (kernel body, opcodes that must appear in its SASS)
KERNELS = {
    "common.cuh": ("""
extern "C" __global__ void k(u32* out, float a, float b) {
    check_launch(128, 0);
    named_barrier(1, 128);
    out[threadIdx.x] = pack_bf16x2(a, b) + lds_u32(out);
}""", ["BPT.TRAP", "BAR.SYNC", "F2FP.BF16"]),
    "pipeline.cuh": ("""
extern "C" __global__ void k(int* out, int n) {
    __shared__ __align__(8) u64 barriers[2 * 4];
    const StageRing<4, 2> ring(barriers);
    if (threadIdx.x == 0) ring.init(1, 4), fence_barrier_init();
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int it = 0; it < n; ++it) ring.expect(ring.acquire(it), 0);
    } else {
        RingCursor<4> at;
        for (int it = 0; it < n; ++it) ring.wait(at.stage, at.phase), ring.release(at.stage, threadIdx.x % 32), at.advance();
        out[threadIdx.x] = at.stage;
    }
}""", ["SYNCS.EXCH.64", "SYNCS.PHASECHK", "SYNCS.ARRIVE"]),
    "tma.cuh": ("""
extern "C" __global__ void k(const __grid_constant__ TensorMap in, const __grid_constant__ TensorMap out, int col) {
    __shared__ __align__(1024) unsigned char tile[64 * 128];
    __shared__ __align__(8) u64 bar;
    tma_load_2d(tile, in, &bar, col, 0);
    tma_load_2d_multicast(tile, in, &bar, col, 64, 3);
    fence_proxy_async();
    tma_store_2d(out, tile, col, 0);
    bulk_commit();
    bulk_wait_read();
}""", ["UTMALDG.2D", "UTMALDG.2D.MULTICAST", "UTMASTG.2D", "UTMACMDFLUSH"]),
    "wgmma.cuh": ("""
extern "C" __global__ void k(float* out) {
    __shared__ __align__(1024) bf16_bits a[64 * 64], b[128 * 64];
    float d[64], e[64];
    wgmma_fence();
    for (int ks = 0; ks < 4; ++ks) wgmma_m64k16<128, 1>(d, kmajor_desc(a, ks), nmajor_desc<64>(b, ks), ks > 0);
    wgmma_m64n128k32_e4m3(e, fp8_desc(reinterpret_cast<const unsigned char*>(a), 0),
                          fp8_desc(reinterpret_cast<const unsigned char*>(b), 0), 0);
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 64; ++i) out[i * 128 + threadIdx.x] = d[i] + e[i];
}""", ["HGMMA.64x128x16.F32.BF16", "QGMMA.64x128x32.F32.E4M3.E4M3", "WARPGROUP.ARRIVE"]),
    "scheduler.cuh": ("""
extern "C" __global__ void k(int4* out, int tiles_m, int tiles_n, int k_tiles) {
    TileScheduler<1, StreamK<8>> jobs(tiles_m * tiles_n, k_tiles, 1);
    int n = 0;
    for (Job job; jobs.next(job); ++n) {
        int tm, tn;
        tile_coords(job.tile, tiles_m, tiles_n, 8, tm, tn);
        out[blockIdx.x * 64 + n] = make_int4(tm, tn, job.k0, job.k1);
    }
}""", ["STG.E.128"]),
    "epilogue.cuh": ("""
extern "C" __global__ void k(const __grid_constant__ TensorMap c, const float* in, const bf16_bits* bias, int N) {
    __shared__ __align__(1024) bf16_bits buffers[2 * 64 * 64];
    float d[64];
    for (int i = 0; i < 64; ++i) d[i] = in[i * 128 + threadIdx.x];
    EpilogueSlices<64, 2> out(buffers, 0, threadIdx.x);
    for (int sl = 0; sl < 2; ++sl) {
        bf16_bits* slice = out.begin();
        store_cols_swizzled<128, 64, 1, 2>(d, slice, 0, 0, 64 * sl, 64, N, bias);
        out.end(c, slice, 0, 64 * sl);
    }
    out.drain();
}""", ["STSM.16.M88.4", "MUFU.EX2", "UTMASTG.2D"]),
    "norm_a.cuh": ("""
extern "C" __global__ void k(u32* out, u32 gamma) {
    __shared__ __align__(1024) bf16_bits a[64 * 64];
    u32 x[4][4];
    float4 sums = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ldmatrix_a_ktile(a + 16 * (threadIdx.x / 32) * 64, x);
    add_squares(x, sums);
    out[threadIdx.x] = mul_bf16x2(x[0][0], gamma) + __float_as_uint(sums.x + sums.y + sums.z + sums.w);
}""", ["LDSM.16.M88.4", "HFMA2.MMA.BF16_V2"]),
}


@pytest.mark.parametrize("part", sorted(KERNELS))
@pytest.mark.slow
def test_each_part_compiles_alone_to_its_instructions_without_spills(part, tmp_path):
    body, expected = KERNELS[part]
    source = tmp_path / f"{Path(part).stem}_alone.cu"
    source.write_text(f'#include "{PARTS / part}"\n{body}\n')
    cubin = compile_cuda(source, arch="sm_90a", cache=False)
    code = sass(cubin)
    for opcode in expected:
        assert re.search(rf"\b{re.escape(opcode)}\b", code), f"{part}: no {opcode} in the machine code"
    used = resources(cubin)["k"]
    assert (used.spill_stores, used.spill_loads, used.stack_bytes) == (0, 0, 0), part
    assert not re.search(r"\b(STL|LDL)\b", code), f"{part}: local memory in the machine code"


def test_every_part_is_listed_and_says_what_it_is():
    parts = sorted(p.name for p in PARTS.glob("*.cuh"))
    assert parts == sorted(KERNELS)
    for name in parts:
        text = (PARTS / name).read_text()
        assert text.startswith("// Hopper parts"), name
        assert "#pragma once" in text, name
