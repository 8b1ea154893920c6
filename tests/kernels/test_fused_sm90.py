"""The fused kernels compiled for the H100 (sm_90) on any machine, in a subprocess with the
interpreter off: every tile config of the two GEMMs, in every mode that may use it, fits
the 227 KB of shared memory a block may have, runs on wgmma fed by TMA and spills nothing
(erf GELU with a bias included: gemm_epilogue.py says what it took); every streaming
kernel at the level-2 sizes compiles without spills."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_PRELUDE = textwrap.dedent(r"""
    import json, os, re
    os.environ["TRITON_INTERPRET"] = "0"
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kforge.runtime.cuda import Cubin, resources, sass

    def build(fn, types, constants, warps, stages=3):
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        cubin = Cubin(Path(fn.__name__), "sm_90", (), "", kernel.asm["cubin"], "")
        (used,) = resources(cubin).values()
        code = sass(cubin)
        count = lambda pattern: len(re.findall(pattern, code))
        return dict(local=used.local_bytes + used.stack_bytes, spills=count(r"\b(STL|LDL)\b"),
                    hgmma=count(r"\bHGMMA\b"), tma=count(r"\bUTMALDG\b"), shared=kernel.metadata.shared)
""")

_GEMMS = _PRELUDE + textwrap.dedent(r"""
    from kforge.kernels.fused import gemm_epilogue as ge, linear_cross_entropy as lce
    found = []
    types = {name: "*bf16" for name in ("a_ptr", "b_ptr", "up_ptr", "c_ptr", "bias_ptr", "res_ptr")}
    types.update(M="i32", N="i32", K="i32")
    modes = [("bias", "gelu_tanh", False, True, False), ("residual", "none", False, False, True),
             ("gated", "silu", True, False, False)]
    for label, activation, gated, bias, residual in modes:
        for c in ge.configs_for(ge.CONFIGS, gated, residual):
            constants = dict(c.kwargs, NUM_PROGRAMS=132, ACTIVATION=activation, HAS_BIAS=bias, HAS_RESIDUAL=residual,
                             GATED=gated)
            found.append([f"{label} {c}", build(ge.gemm_epilogue_kernel, types, constants, c.num_warps, c.num_stages)])
    for c in ge.configs_for(ge.CONFIGS, False, False, "gelu"):
        constants = dict(c.kwargs, NUM_PROGRAMS=132, ACTIVATION="gelu", HAS_BIAS=True, HAS_RESIDUAL=False, GATED=False)
        found.append([f"gelu+bias {c}", build(ge.gemm_epilogue_kernel, types, constants, c.num_warps, c.num_stages)])
    types = dict(x_ptr="*bf16", w_ptr="*bf16", target_ptr="*i64", max_ptr="*fp32", sum_ptr="*fp32",
                 target_logit_ptr="*fp32", T="i32", V="i32", D="i32")
    for c in lce.CONFIGS:
        found.append([f"lse {c}", build(lce.lse_partials_kernel, types, dict(c.kwargs, NUM_PROGRAMS=132), c.num_warps,
                                        c.num_stages)])
    print(json.dumps(found))
""")

_STREAMING = _PRELUDE + textwrap.dedent(r"""
    from kforge.kernels.fused import (add_rms_norm_fp8 as arf, bias_act as ba, causal_conv1d as cc,
                                      linear_cross_entropy as lce, qk_norm_rope as qr, sandwich_norm as sn,
                                      scaled_softmax as ss, swiglu_fp8 as sf)
    i32, found = "i32", {}
    fp8 = dict(FP8_MAX=448.0, MANT=3, BIAS=7, MAX_MAG=0x7E, HARDWARE_CVT=True)
    found["merge"] = build(lce.lse_merge_kernel, dict(max_ptr="*fp32", sum_ptr="*fp32", target_logit_ptr="*fp32",
                           target_ptr="*i64", loss_ptr="*fp32", T=i32, tiles_v=i32, ignore_index=i32),
                           dict(BLOCK_T=lce.MERGE_ROWS, BLOCK_TILES=lce.MERGE_TILES), 4)
    for n in (2048, 8192, ss.MAX_ROW):
        rows, block, warps = ss.softmax_tile(n)
        found[f"softmax {n}"] = build(ss.scaled_softmax_kernel, dict(s_ptr="*bf16", p_ptr="*bf16", n_rows=i32, n_q=i32,
                                      n_k=i32, row_stride=i32, scale="fp32"),
                                      dict(CAUSAL=True, BLOCK_ROWS=rows, BLOCK_K=block), warps)
    channels, length = cc.conv_tile(4096)
    found["conv"] = build(cc.causal_conv1d_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16",
                          channels=i32, length=i32, batch_stride=i32, channel_stride=i32),
                          dict(TAPS=4, HAS_BIAS=True, SILU=True, BLOCK_C=channels, BLOCK_L=length), 4)
    ints = {name: i32 for name in ("n_q_heads", "n_k_heads", "seq_len", "q_batch_stride", "q_seq_stride",
                                   "q_head_stride", "k_batch_stride", "k_seq_stride", "k_head_stride", "max_position",
                                   "half")}
    for norm in (True, False):
        found[f"qk_norm_rope norm={norm}"] = build(qr.qk_norm_rope_kernel, dict(
            q_ptr="*bf16", k_ptr="*bf16", q_out_ptr="*bf16", k_out_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16",
            pos_ptr="*i64", table_ptr="*fp32", eps="fp32", **ints), dict(NORM=norm, HEADS_BLOCK=8, HALF_BLOCK=64), 4)
    rows, block, warps = arf.norm_tile(8192)
    found["add_rms_norm_fp8"] = build(arf.add_rms_norm_fp8_kernel, dict(
        x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", q_ptr="*u8", scale_ptr="*fp32", h_ptr="*i16", n_rows=i32,
        hidden=i32, x_stride=i32, res_stride=i32, eps="fp32"), dict(**fp8, BLOCK_ROWS=rows, BLOCK_H=block), warps)
    rows, block = sf.swiglu_fp8_tile(14336)
    found["swiglu_fp8"] = build(sf.swiglu_fp8_kernel, dict(
        x_ptr="*bf16", q_ptr="*u8", scale_ptr="*fp32", n_rows=i32, hidden=i32, x_stride=i32),
        dict(**fp8, GROUP_SIZE=128, BLOCK_ROWS=rows, BLOCK_H=block), 4)
    rows, block, warps = sn.norm_tile(3584)
    found["sandwich_norm"] = build(sn.sandwich_norm_kernel, dict(
        x_ptr="*bf16", res_ptr="*bf16", w_post_ptr="*bf16", w_pre_ptr="*bf16", y_ptr="*bf16", h_ptr="*bf16",
        n_rows=i32, hidden=i32, x_stride=i32, res_stride=i32, offset="fp32", eps="fp32"),
        dict(BLOCK_ROWS=rows, BLOCK_H=block), warps)
    rows, block = ba.bias_act_tile(16384)
    found["bias_act gelu"] = build(ba.bias_act_kernel, dict(
        x_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", n_rows=i32, n_cols=i32, x_stride=i32),
        dict(ACTIVATION="gelu", BLOCK_ROWS=rows, BLOCK_N=block), 4)
    print(json.dumps(found))
""")


def _run(script: str):
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_gemm_tile_in_every_mode_fits_an_h100_and_runs_on_wgmma_and_tma():
    found = _run(_GEMMS)
    assert len(found) >= 30
    for label, kernel in found:
        assert 0 < kernel["shared"] <= 227 * 1024, (label, kernel)
        assert kernel["hgmma"] > 0 and kernel["tma"] > 0, (label, kernel)
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)


@pytest.mark.slow
def test_every_streaming_kernel_compiles_for_sm90_without_spills():
    found = _run(_STREAMING)
    assert len(found) == 11
    for label, kernel in found.items():
        assert kernel["spills"] == 0 and kernel["local"] == 0, (label, kernel)
