"""SwiGLU: the Triton kernel under the interpreter (fp16, fp32) against a float64 reference on odd
widths, ragged leading shapes, several row and column blocks; the gate-first convention by hand;
strided inputs; large gates; refusals; byte counts; kforge.ops.swiglu as a custom op under
torch.compile. On a GPU: bf16/fp16/fp32 at Llama MLP widths against float64."""

import math

import pytest
import torch

from kforge.kernels.serving.swiglu import swiglu_forward, swiglu_min_bytes, swiglu_reference, swiglu_tile
from kforge.ops.swiglu import swiglu

# the output is rounded once (half an ulp: 2^-11 fp16, 2^-9 bf16, 2^-24 fp32), after fp32 math
# (sigmoid's exp a few ulps): rtol twice the rounding, atol for outputs near 0
TOLERANCE = {torch.float16: dict(rtol=1e-3, atol=1e-5), torch.float32: dict(rtol=1e-5, atol=1e-6),
             torch.bfloat16: dict(rtol=4e-3, atol=1e-5)}
# (leading shape, H, block_size): 2 rows a program with a tail row; a ragged leading shape
# with H = 4099 over three 2048 column blocks; 32 rows of H = 37 to a program; 5 column
# blocks of 64 with a 44 tail
CASES = [((7,), 1000, None), ((2, 3), 4099, None), ((5,), 37, None), ((3,), 300, 64)]


def _x(leading, hidden, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn((*leading, 2 * hidden), generator=g)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("leading,hidden,block_size", CASES, ids=str)
def test_swiglu_kernel_matches_float64(leading, hidden, block_size, dtype, nan_outputs):
    x = _x(leading, hidden, dtype)
    out = swiglu_forward(x, block_size=block_size)
    assert out.shape == (*leading, hidden) and out.dtype == dtype
    torch.testing.assert_close(out.double(), swiglu_reference(x.double()), **TOLERANCE[dtype])


def test_gate_is_the_first_half_and_up_the_second():
    x = torch.tensor([[0.0, 2.0, -3.0, 3.0, -1.0, 0.5]])  # gate (0, 2, -3), up (3, -1, 0.5)
    silu = [g / (1 + math.exp(-g)) for g in (0.0, 2.0, -3.0)]
    expected = torch.tensor([[silu[0] * 3.0, silu[1] * -1.0, silu[2] * 0.5]], dtype=torch.float64)
    torch.testing.assert_close(swiglu_forward(x).double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(swiglu_reference(x.double()), expected, rtol=1e-12, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
def test_large_gates_saturate_without_nan():
    gate = torch.tensor([[-90.0, -20.0, 20.0, 90.0]])
    out = swiglu_forward(torch.cat((gate, torch.full_like(gate, 0.5)), dim=1))
    # sigmoid(-90) = 1 / (1 + e^90): e^90 overflows fp32 to inf, so silu(-90) is -90 * 0, not NaN
    torch.testing.assert_close(out, torch.tensor([[-0.0, -20 * math.exp(-20) * 0.5, 10.0, 45.0]]), rtol=1e-6,
                               atol=1e-30)


def test_strided_rows_are_read_in_place_and_unviewable_inputs_are_copied():
    x = _x((4, 3), 60, torch.float32)
    wide = torch.randn(4, 3, 130)
    wide[..., :120] = x
    permuted = x.transpose(0, 1).contiguous().transpose(0, 1)
    for view in (wide[..., :120], permuted):
        torch.testing.assert_close(swiglu_forward(view), swiglu_reference(x), rtol=1e-6, atol=1e-7)


def test_tiles_hold_2048_outputs():
    assert swiglu_tile(14336) == (1, 2048)
    assert swiglu_tile(1000) == (2, 1024)
    assert swiglu_tile(37) == (32, 64)
    assert swiglu_tile(300, block_size=64) == (32, 64)


def test_bad_inputs_are_refused_before_any_kernel_runs():
    x = _x((4,), 8, torch.float32)
    for bad, message in [(x[:, :7], "even, non-empty last"), (x[:, :0], "even, non-empty last"),
                         (torch.tensor(1.0), "even, non-empty last"), (x.int(), "floating-point")]:
        with pytest.raises(ValueError, match=message):
            swiglu_forward(bad)
        with pytest.raises(ValueError, match=message):
            swiglu(bad)
    with pytest.raises(ValueError, match="the kernel takes float16, bfloat16 or float32 x"):
        swiglu_forward(x.double())
    with pytest.raises(ValueError, match="power of two >= 16"):
        swiglu_forward(x, block_size=48)


def test_min_bytes_read_both_halves_and_write_one():
    assert swiglu_min_bytes(4096, 14336, torch.bfloat16) == 4096 * (2 * 14336 + 14336) * 2
    assert swiglu_min_bytes(3, 10, torch.float32) == 3 * 30 * 4


# --- the custom op -----------------------------------------------------------------------------

def test_op_passes_opcheck_compiles_into_one_graph_and_runs_the_reference_on_cpu():
    x = _x((2, 5), 24, torch.float32)
    torch.library.opcheck(torch.ops.kforge.swiglu.default, (x,))
    compiled = torch.compile(lambda t: swiglu(t * 2) + 1, backend="aot_eager", fullgraph=True)
    gate, up = (x * 2).chunk(2, dim=-1)
    torch.testing.assert_close(compiled(x), torch.nn.functional.silu(gate) * up + 1, rtol=1e-6, atol=1e-6)
    x64 = x.double()
    torch.testing.assert_close(swiglu(x64), swiglu_reference(x64), rtol=0, atol=0)


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden", [14336, 11008, 28672, 4099, 128])
def test_swiglu_kernel_on_the_gpu_matches_float64(hidden, dtype):
    x = _x((2, 1100), hidden, dtype, "cuda")
    torch.testing.assert_close(swiglu_forward(x).double(), swiglu_reference(x.double()), **TOLERANCE[dtype])


@pytest.mark.gpu
def test_op_on_the_gpu_runs_our_kernel_and_compiles_with_inductor():
    x = _x((4, 512), 14336, torch.bfloat16, "cuda")
    out = torch.compile(lambda t: swiglu(t), fullgraph=True)(x)
    torch.testing.assert_close(out.double(), swiglu_reference(x.double()), **TOLERANCE[torch.bfloat16])
