"""Implicit-GEMM conv2d: the Triton kernel under the interpreter (fp16; bf16 with the
interpreter's tl.dot mended) against float64 convolution, channels-last and NCHW inputs,
3x3/1x1/4x4 kernels, stride 1/2/4, padding 0/1/2, channel counts that are not multiples of
the tiles; the weight's GEMM layout; every output written; refusals; every autotune config
compiled for sm_90 within the H100's 227 KB of shared memory, on wgmma fed by cp.async.
On a GPU: ResNet-50 shapes in bf16 against float64, every config."""

import pytest
import torch

from kforge.kernels.conv.conv2d import CONFIGS, INTERPRETER_CONFIG, conv2d_flops, conv2d_nhwc, conv_weight_matrix
from kforge.runtime.interpreter import mend_bf16_dot
from triton_sm90 import compile_sm90, spec

# (N, C, H, W, K, R, S, stride, padding)
SHAPES = [(2, 16, 9, 7, 24, 3, 3, 1, 1), (1, 20, 10, 7, 8, 3, 3, 2, 1), (2, 8, 6, 6, 40, 1, 1, 1, 0),
          (1, 3, 16, 16, 32, 4, 4, 4, 0), (1, 5, 5, 5, 3, 3, 3, 1, 2)]


def _inputs(shape, dtype, device="cpu", seed=8, channels_last=True):
    n, c, h, w, k, r, s, _, _ = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g).to(dtype=dtype, device=device)
    weight = (torch.randn(k, c, r, s, generator=g) / (c * r * s) ** 0.5).to(dtype=dtype, device=device)
    return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), weight


def _expected(x, weight, stride, padding):
    return torch.nn.functional.conv2d(x.double(), weight.double(), stride=stride, padding=padding)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_conv_matches_float64(shape, dtype, nan_outputs):
    mend_bf16_dot()
    x, weight = _inputs(shape, dtype)
    stride, padding = shape[-2:]
    out = conv2d_nhwc(x, weight, stride=stride, padding=padding)
    expected = _expected(x, weight, stride, padding)
    assert out.shape == expected.shape and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    # fp32 sums of products exact in fp32, one rounding (the interpreter truncates bf16: 2^-7)
    rtol = 1e-3 if dtype == torch.float16 else 8e-3
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * 0.1)


def test_nchw_input_cached_weight_and_a_tile_config():
    shape = (2, 16, 9, 7, 24, 3, 3, 1, 1)
    x, weight = _inputs(shape, torch.float16, channels_last=False)
    matrix = conv_weight_matrix(weight)
    assert matrix.shape == (3 * 3 * 16, 24) and torch.equal(matrix[(1 * 3 + 2) * 16 + 5], weight[:, 5, 1, 2])
    out = conv2d_nhwc(x, weight, padding=1, weight_matrix=matrix, config={**INTERPRETER_CONFIG, "BLOCK_C": 32})
    torch.testing.assert_close(out.double(), _expected(x, weight, 1, 1), rtol=1e-3, atol=1e-4)


def test_bad_inputs_are_refused_before_any_kernel_runs():
    x, weight = _inputs((1, 4, 5, 5, 8, 3, 3, 1, 1), torch.float16)
    for args, kwargs, message in [((x[0], weight), {}, "must be \\(N, C, H, W\\)"),
                                  ((x.float(), weight.float()), {}, "float16, bfloat16"),
                                  ((x, weight.to(torch.bfloat16)), {}, "share one dtype"),
                                  ((x, weight[:, :3]), {}, "groups are not supported"),
                                  ((x, weight), {"stride": 0}, "stride must be an int >= 1"),
                                  ((x, weight), {"padding": -1}, "padding an int >= 0"),
                                  ((x[:, :, :2, :2], weight), {}, "does not fit"),
                                  ((x, weight), {"weight_matrix": torch.zeros(3, 8, dtype=torch.float16)},
                                   "weight_matrix must be conv_weight_matrix")]:
        with pytest.raises(ValueError, match=message):
            conv2d_nhwc(*args, **kwargs)
    assert conv2d_flops(256, 128, 28, 28, 128, 3, 3) == 2 * 256 * 28 * 28 * 128 * 128 * 9


@pytest.mark.slow
def test_every_config_compiles_for_sm90_on_wgmma_fed_by_cp_async_within_shared_memory():
    names = ("batch", "channels", "height", "width", "out_channels", "out_h", "out_w", "sx_n", "sx_h", "sx_w",
             "so_n", "so_p", "so_q", "padding")
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", **{name: "i32" for name in names}}
    aligned = ("x_ptr", "w_ptr", "out_ptr", "channels", "out_channels", "sx_n", "sx_h", "sx_w", "so_n", "so_p", "so_q")
    found = compile_sm90([
        spec(str(i), "kforge.kernels.conv.conv2d", "conv2d_nhwc_kernel", types,
             {**config.kwargs, "R": 3, "S": 3, "sx_c": 1, "so_k": 1, "stride": 1}, aligned=aligned,
             num_warps=config.num_warps, num_stages=config.num_stages)
        for i, config in enumerate(CONFIGS)])
    for label, kernel in found.items():
        assert kernel["shared"] <= 227 * 1024 and kernel["spills"] == 0, (CONFIGS[int(label)], kernel)
        assert kernel["hgmma"] > 0 and kernel["ldgsts"] > 0, (CONFIGS[int(label)], kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 128, 28, 28, 128, 3, 3, 1, 1), (32, 64, 56, 56, 64, 3, 3, 1, 1),
                                   (16, 256, 14, 14, 256, 3, 3, 2, 1), (7, 24, 11, 13, 40, 1, 1, 1, 0)], ids=str)
def test_conv_on_the_gpu_matches_float64(shape):
    x, weight = _inputs(shape, torch.bfloat16, "cuda")
    stride, padding = shape[-2:]
    expected = _expected(x, weight, stride, padding)
    torch.testing.assert_close(conv2d_nhwc(x, weight, stride=stride, padding=padding).double(), expected,
                               rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_every_config_is_correct_on_the_gpu(index):
    shape = (3, 96, 13, 11, 72, 3, 3, 1, 1)
    x, weight = _inputs(shape, torch.bfloat16, "cuda")
    config = dict(CONFIGS[index].kwargs, num_warps=CONFIGS[index].num_warps, num_stages=CONFIGS[index].num_stages)
    torch.testing.assert_close(conv2d_nhwc(x, weight, padding=1, config=config).double(), _expected(x, weight, 1, 1),
                               rtol=1e-2, atol=1e-2)
