"""Batched GEMM: the persistent Triton kernel under the interpreter (fp16; bf16 with the
interpreter's tl.dot mended) against float64 on odd M and tails of every tile, several
matrices a program, views (a transposed B, a slice of a bigger batch) read in place and
unaligned ones copied; empty sizes; refusals; every autotune config compiled for sm_90
within 227 KB of shared memory, on wgmma fed by TMA. On a GPU: 64 x 1024^3 and odd shapes
in bf16 against float64, and every config."""

import pytest
import torch

from kforge.kernels.gemm_batched.bmm import CONFIGS, bmm, bmm_flops
from kforge.runtime.interpreter import mend_bf16_dot
from triton_sm90 import compile_sm90, spec


def _inputs(batch, m, n, k, dtype, device="cpu", seed=9):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, m, k, generator=g).to(dtype=dtype, device=device),
            torch.randn(batch, k, n, generator=g).to(dtype=dtype, device=device))


def _check(c, a, b):
    expected = a.double() @ b.double()
    assert c.shape == expected.shape and c.dtype == a.dtype
    # fp32 sums of exact products, one rounding (the interpreter truncates bf16: 2^-7)
    rtol = 1e-3 if a.dtype == torch.float16 else 8e-3
    torch.testing.assert_close(c.double(), expected, rtol=rtol, atol=rtol * a.shape[2] ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 37, 40, 72), (2, 64, 64, 64), (1, 5, 8, 200), (9, 33, 16, 8)], ids=str)
def test_bmm_matches_float64(shape, dtype, nan_outputs):
    mend_bf16_dot()
    a, b = _inputs(*shape, dtype)
    _check(bmm(a, b), a, b)


def test_views_are_read_in_place_or_copied():
    a, b = _inputs(4, 40, 48, 64, torch.float16)
    _check(bmm(a, b.transpose(1, 2).contiguous().transpose(1, 2)), a, b)  # B column-major: copied
    big_a, big_b = _inputs(6, 40, 48, 64, torch.float16)
    _check(bmm(big_a[1:5], big_b[::2][:3].repeat(2, 1, 1)[:4]), big_a[1:5], big_b[::2][:3].repeat(2, 1, 1)[:4])
    padded = torch.zeros(4, 40, 72, dtype=torch.float16)
    padded[..., :64] = a
    _check(bmm(padded[..., :64], b), a, b)  # rows 144 bytes apart: 16-byte aligned, read in place


def test_empty_sizes_and_refusals():
    a, b = _inputs(2, 3, 8, 0, torch.float16)
    assert torch.equal(bmm(a, b), torch.zeros(2, 3, 8, dtype=torch.float16))
    assert bmm(*_inputs(0, 3, 8, 8, torch.float16)).shape == (0, 3, 8)
    a, b = _inputs(2, 3, 8, 16, torch.float16)
    for args, message in [((a[0], b[0]), "takes a \\(BATCH, M, K\\)"), ((a.float(), b.float()), "float16, bfloat16"),
                          ((a, b.bfloat16()), "share one dtype"), ((a, b[:1]), "batch or inner dimensions differ"),
                          ((a[..., :12], b[:, :12]), "multiples of 8")]:
        with pytest.raises(ValueError, match=message):
            bmm(*args)
    assert bmm_flops(64, 1024, 1024, 1024) == 2 * 64 * 1024**3


@pytest.mark.slow
def test_every_config_compiles_for_sm90_on_wgmma_fed_by_tma_within_shared_memory():
    names = ("batch", "M", "N", "K", "sa_b", "sa_m", "sb_b", "sb_k", "sc_b", "sc_m")
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", **{name: "i32" for name in names}}
    aligned = ("a_ptr", "b_ptr", "c_ptr", "N", "K", "sa_b", "sa_m", "sb_b", "sb_k", "sc_b", "sc_m")
    found = compile_sm90([
        spec(str(i), "kforge.kernels.gemm_batched.bmm", "bmm_persistent", types, {**config.kwargs, "NUM_PROGRAMS": 132},
             aligned=aligned, num_warps=config.num_warps, num_stages=config.num_stages)
        for i, config in enumerate(CONFIGS)])
    for label, kernel in found.items():
        assert kernel["shared"] <= 227 * 1024 and kernel["spills"] == 0, (CONFIGS[int(label)], kernel)
        assert kernel["hgmma"] > 0 and kernel["tma"] > 0, (CONFIGS[int(label)], kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1024, 1024, 1024), (3, 1000, 1032, 520), (200, 17, 64, 64),
                                   (1, 4096, 4096, 4096)], ids=str)
def test_bmm_on_the_gpu_matches_float64(shape):
    a, b = _inputs(*shape, torch.bfloat16, "cuda")
    expected = a.double() @ b.double()
    torch.testing.assert_close(bmm(a, b).double(), expected, rtol=1.6e-2, atol=0.125)
    # again: the tuned pick, launched directly
    torch.testing.assert_close(bmm(a, b).double(), expected, rtol=1.6e-2, atol=0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_every_config_is_correct_on_the_gpu(index):
    a, b = _inputs(5, 300, 264, 200, torch.bfloat16, "cuda")
    config = dict(CONFIGS[index].kwargs, num_warps=CONFIGS[index].num_warps, num_stages=CONFIGS[index].num_stages)
    torch.testing.assert_close(bmm(a, b, config=config).double(), a.double() @ b.double(), rtol=1.6e-2, atol=0.125)
