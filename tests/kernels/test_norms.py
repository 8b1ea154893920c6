"""RMSNorm and LayerNorm: the Triton kernel under the interpreter (fp16, fp32) against a float64
reference on odd hidden sizes, ragged leading shapes, residual on/off, LayerNorm bias on/off,
both the whole-row and the looped path; the variance when the mean is large; strided inputs;
refusals; tile choices; byte counts; kforge.ops.rms_norm / layer_norm as custom ops under
torch.compile. On a GPU: bf16/fp16/fp32 at Llama sizes against float64."""

import pytest
import torch

from kforge.kernels.serving import norms
from kforge.kernels.serving.norms import (layer_norm_forward, layer_norm_min_bytes, layer_norm_reference,
                                          norm_config, rms_norm_forward, rms_norm_min_bytes, rms_norm_reference)
from kforge.ops.norms import layer_norm, rms_norm

# fp16/bf16: the output is rounded once (half an ulp: 2^-11 / 2^-9 relative; rtol twice that),
# everything before it is fp32;
# fp32: a few ulps of arithmetic plus the reductions' rounding (~log2(H) ulps of the sums), and
# where w * normed and b cancel, a few ulps of the terms (|terms| up to ~10: atol 1e-5).
TOLERANCE = {torch.float16: dict(rtol=1e-3, atol=1e-5), torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=4e-3, atol=1e-5)}
# leading shape and hidden: rows packed 2 to a program with a tail row (1000), a ragged
# leading shape with a 4099 row padded to 8192, 16 rows of 130 to a program with a tail
SHAPES = [(7, 1000), (2, 3, 4099), (17, 130)]


def _inputs(shape, dtype, device="cpu", seed=0, offset=3.0):
    """x with a per-row offset (so LayerNorm has a mean to remove), a residual, weight and bias."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(shape, generator=g) + offset * torch.randn((*shape[:-1], 1), generator=g)
    residual = torch.randn(shape, generator=g)
    weight, bias = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
    return [t.to(dtype=dtype, device=device) for t in (x, residual, weight, bias)]


def _run_and_check(kind, x, residual, weight, bias, eps, **launch):
    """Run our kernel, check against the float64 reference taken on the h our kernel returns."""
    if kind == "rms":
        got = rms_norm_forward(x, weight, eps, residual, **launch)
    else:
        got = layer_norm_forward(x, weight, bias, eps, residual, **launch)
    out, h = got if residual is not None else (got, x)
    if residual is not None:  # the new residual is x + residual rounded to x's dtype, exactly
        assert h.dtype == x.dtype and torch.equal(h, x + residual)
    if kind == "rms":
        expected = rms_norm_reference(h.double(), weight.double(), eps)
    else:
        expected = layer_norm_reference(h.double(), weight.double(), None if bias is None else bias.double(), eps)
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[x.dtype])


NORMS = [("rms", False), ("layer", True), ("layer", False)]  # (kind, with bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind,with_bias", NORMS, ids=["rms", "layer+bias", "layer"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_norm_kernel_matches_float64_with_whole_rows_in_registers(shape, kind, with_bias, with_residual, dtype,
                                                                   nan_outputs):
    assert not norm_config(shape[-1]).looped
    x, residual, weight, bias = _inputs(shape, dtype)
    # eps = 0.1 moves the result by ~1% (mean square ~10): a kernel that drops it fails
    _run_and_check(kind, x, residual if with_residual else None, weight, bias if with_bias else None, 0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind,with_bias", NORMS, ids=["rms", "layer+bias", "layer"])
@pytest.mark.slow
def test_norm_kernel_matches_float64_when_rows_loop_over_chunks(kind, with_bias, with_residual, dtype, nan_outputs):
    config = norm_config(1000, block_size=128)
    assert config.looped and config.block_h == 128  # 8 chunks, the last one 104 long
    x, residual, weight, bias = _inputs((3, 1000), dtype, seed=1)
    _run_and_check(kind, x, residual if with_residual else None, weight, bias if with_bias else None, 0.1,
                   block_size=128)


@pytest.mark.parametrize("block_size", [None, 128])
def test_layer_norm_variance_survives_a_mean_a_hundred_thousand_times_the_spread(block_size):
    """E[h^2] - E[h]^2 in fp32 would return noise here; the chunks' means also differ (a ramp),
    so the looped path's merge must carry the between-chunk term."""
    g = torch.Generator().manual_seed(2)
    x = 1000.0 + 0.01 * torch.randn(2, 1000, generator=g) + torch.linspace(-0.02, 0.02, 1000)
    weight = torch.ones(1000)
    out = layer_norm_forward(x, weight, eps=0.0, block_size=block_size)
    expected = layer_norm_reference(x.double(), weight.double(), eps=0.0)
    # fp32 inputs near 1000 carry 3e-5 of absolute rounding against a 0.015 spread
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2)


def test_strided_rows_are_read_in_place_and_unviewable_inputs_are_copied():
    x, residual, weight, bias = _inputs((4, 3, 72), torch.float32)
    wide = torch.randn(4, 3, 100)
    wide[..., :72] = x
    sliced = wide[..., :72]  # rows 100 apart: one stride, read where they lie
    assert norms._rows(sliced).data_ptr() == sliced.data_ptr()
    permuted = x.transpose(0, 1).contiguous().transpose(0, 1)  # no single row stride: copied
    for view in (sliced, permuted):
        _run_and_check("layer", view, residual, weight, bias, 1e-5)
        _run_and_check("rms", view, None, weight, None, 1e-6)


def test_fp32_weights_under_fp16_activations_a_single_1d_row_and_empty_inputs():
    x, residual, weight, bias = _inputs((5, 300), torch.float16)
    _run_and_check("layer", x, residual, weight.float(), bias.float(), 1e-5)
    _run_and_check("rms", x[0], residual[0], weight, None, 1e-6)
    empty = torch.empty(0, 3, 64, dtype=torch.float16)
    out, h = rms_norm_forward(empty, torch.ones(64, dtype=torch.float16), residual=empty)
    assert out.shape == h.shape == (0, 3, 64)


def test_tiles_hold_whole_rows_up_to_16k_then_loop_in_4k_chunks():
    assert norm_config(128) == norms.NormConfig(block_rows=16, block_h=128, looped=False, num_warps=4)
    assert norm_config(4096) == norms.NormConfig(block_rows=1, block_h=4096, looped=False, num_warps=8)
    assert norm_config(4099).block_h == 8192 and norm_config(8192).num_warps == 16
    assert norm_config(16384) == norms.NormConfig(block_rows=1, block_h=16384, looped=False, num_warps=16)
    assert norm_config(28672) == norms.NormConfig(block_rows=1, block_h=4096, looped=True, num_warps=8)
    assert norm_config(4096, block_size=1024) == norms.NormConfig(1, 1024, True, 4)
    assert not norm_config(4096, block_size=4096).looped


def test_bad_inputs_are_refused_before_any_kernel_runs():
    x, residual, weight, bias = _inputs((4, 64), torch.float32)
    cases = [
        (dict(x=x[:, :0], weight=weight[:0]), "non-empty last"),
        (dict(weight=weight[:32]), r"weight must have shape \(64,\)"),
        (dict(bias=bias[:1]), r"bias must have shape \(64,\)"),
        (dict(residual=residual[:2]), "residual must match x"),
        (dict(residual=residual.half()), "residual must match x"),
        (dict(x=x.int()), "x must be a floating-point"),
        (dict(weight=weight.to("meta")), "weight is on meta"),
        (dict(eps=-1e-5), "eps must be a finite number >= 0"),
        (dict(eps=float("nan")), "eps must be a finite number >= 0"),
    ]
    for change, message in cases:
        args = dict(x=x, weight=weight, bias=bias, residual=residual, eps=1e-5) | change
        with pytest.raises(ValueError, match=message):
            layer_norm_forward(**args)
        with pytest.raises(ValueError, match=message):
            layer_norm(**args)
    with pytest.raises(ValueError, match="the kernel takes float16, bfloat16 or float32 x"):
        rms_norm_forward(x.double(), weight.double())
    with pytest.raises(ValueError, match="power of two >= 16"):
        rms_norm_forward(x, weight, block_size=100)


def test_min_bytes_count_each_stream_once_and_the_weight_once():
    assert rms_norm_min_bytes(8, 4096, torch.bfloat16, residual=False) == 2 * 8 * 4096 * 2 + 4096 * 2
    assert rms_norm_min_bytes(8, 4096, torch.bfloat16, residual=True) == 4 * 8 * 4096 * 2 + 4096 * 2
    assert rms_norm_min_bytes(8, 4096, torch.bfloat16, False, weight_dtype=torch.float32) == 2 * 8 * 4096 * 2 + 4096 * 4
    assert layer_norm_min_bytes(8, 1000, torch.float32, residual=True) == 4 * 8 * 1000 * 4 + 2 * 1000 * 4
    assert layer_norm_min_bytes(8, 1000, torch.float32, residual=False, bias=False) == 2 * 8 * 1000 * 4 + 1000 * 4


# --- the custom ops ----------------------------------------------------------------------------

def test_ops_pass_opcheck():
    x, residual, weight, bias = _inputs((3, 5, 48), torch.float32)
    torch.library.opcheck(torch.ops.kforge.rms_norm.default, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.kforge.fused_add_rms_norm.default, (x, residual, weight, 1e-6))
    torch.library.opcheck(torch.ops.kforge.layer_norm.default, (x, weight, None, 1e-5))
    torch.library.opcheck(torch.ops.kforge.fused_add_layer_norm.default, (x, residual, weight, bias, 1e-5))


def test_ops_compile_into_one_graph_and_match_eager_pytorch():
    x, residual, weight, bias = _inputs((2, 7, 96), torch.float32)

    def block(x, residual):  # a pre-norm block's two norms, the residual stream threaded through
        normed, h = rms_norm(x, weight, 1e-6, residual=residual)
        out, h = layer_norm(normed * 2, weight, bias, residual=h)
        return out, h, rms_norm(out, weight), layer_norm(out, weight)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    h1 = x + residual
    n1 = h1 * torch.rsqrt(h1.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    h2 = n1 * 2 + h1
    out = torch.nn.functional.layer_norm(h2, (96,), weight, bias, 1e-5)
    expected = (out, h2, out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * weight,
                torch.nn.functional.layer_norm(out, (96,), weight, None, 1e-5))
    for got, want in zip(compiled(x, residual), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ops_on_cpu_and_in_float64_run_the_reference():
    x, residual, weight, bias = _inputs((4, 33), torch.float64)
    out, h = layer_norm(x, weight, bias, 1e-5, residual)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x + residual, (33,), weight, bias, 1e-5))
    assert torch.equal(h, x + residual)


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind,with_bias", NORMS, ids=["rms", "layer+bias", "layer"])
@pytest.mark.parametrize("hidden", [4096, 8192, 5120, 4099, 16384, 28672])
def test_norm_kernel_on_the_gpu_matches_float64(hidden, kind, with_bias, with_residual, dtype):
    x, residual, weight, bias = _inputs((3, 700, hidden), dtype, "cuda")  # 2100 rows: every SM busy
    _run_and_check(kind, x, residual if with_residual else None, weight, bias if with_bias else None, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind,with_bias", NORMS, ids=["rms", "layer+bias", "layer"])
def test_looped_path_on_the_gpu_matches_float64(kind, with_bias, dtype):
    x, residual, weight, bias = _inputs((1000, 8192), dtype, "cuda", seed=1)
    for block_size in (1024, 4096):
        _run_and_check(kind, x, residual, weight, bias if with_bias else None, 1e-5, block_size=block_size)
        _run_and_check(kind, x, None, weight, bias if with_bias else None, 1e-5, block_size=block_size)


@pytest.mark.gpu
def test_ops_on_the_gpu_run_our_kernels_and_compile_with_inductor():
    x, residual, weight, bias = _inputs((4, 512, 4096), torch.bfloat16, "cuda")
    assert norms.norm_config(4096).block_h == 4096

    def block(x, residual):
        normed, h = rms_norm(x, weight, residual=residual)
        return layer_norm(normed, weight, bias), h

    out, h = torch.compile(block, fullgraph=True)(x, residual)
    assert torch.equal(h, x + residual)
    normed, _ = rms_norm(x, weight, residual=residual)  # eager: the compiled graph must run the same kernels
    torch.testing.assert_close(normed.double(), rms_norm_reference(h.double(), weight.double(), 1e-6),
                               **TOLERANCE[torch.bfloat16])
    # The layer norm is checked on the very bf16 rows it was given: one bf16 step of
    # difference in `normed` would move an output by a step of its own, far past rtol.
    torch.testing.assert_close(out.double(), layer_norm_reference(normed.double(), weight.double(), bias.double()),
                               **TOLERANCE[torch.bfloat16])
