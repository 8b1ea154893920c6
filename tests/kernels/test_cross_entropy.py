"""Cross-entropy: the Triton kernels under the interpreter (fp16, fp32, bf16 logits; int64 and
int32 targets) against F.cross_entropy in float64 for the three reductions, on rows walked in
one chunk and in several with a tail, with ignored targets (some rows, every row), targets at
both ends of the vocabulary; out-of-range targets give NaN without being read; leading
shapes; refusals. On a GPU: Llama 3's vocabulary in bf16 and fp32."""

import pytest
import torch

from kforge.kernels.reductions.cross_entropy import (cross_entropy_forward, cross_entropy_min_bytes,
                                                     cross_entropy_reference)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN of out-of-range targets
# logits are exact in every dtype; fp32 log-sum-exps of up to thousands of terms: ~1e-6 relative
TOLERANCE = dict(rtol=2e-6, atol=2e-6)
CASES = [((7, 1000), None), ((5, 300), 64), ((3, 2, 130), 32), ((4, 9000), None)]


def _inputs(shape, dtype, device="cpu", seed=2, ignored=0.2):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(shape, generator=g)).to(dtype=dtype, device=device)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets[torch.rand(shape[:-1], generator=g) < ignored] = -100
    return logits, targets.to(device)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,chunk", CASES, ids=str)
@pytest.mark.slow
def test_cross_entropy_matches_float64(shape, chunk, dtype, reduction, nan_outputs):
    logits, targets = _inputs(shape, dtype)
    out = cross_entropy_forward(logits, targets, reduction=reduction, chunk=chunk)
    expected = cross_entropy_reference(logits, targets, reduction=reduction)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, **TOLERANCE)


def test_targets_at_both_ends_int32_targets_and_another_ignore_index():
    logits, _ = _inputs((4, 300), torch.float32)
    targets = torch.tensor([0, 299, 7, 299], dtype=torch.int32)
    for ignore in (-100, 7):
        out = cross_entropy_forward(logits, targets, ignore_index=ignore, reduction="none", chunk=64)
        expected = cross_entropy_reference(logits, targets, ignore_index=ignore, reduction="none")
        torch.testing.assert_close(out.double(), expected, **TOLERANCE)


def test_every_target_ignored_gives_nan_mean_and_zero_sum_as_eager():
    logits, _ = _inputs((3, 50), torch.float32)
    targets = torch.full((3,), -100)
    assert torch.isnan(cross_entropy_forward(logits, targets)) and torch.isnan(cross_entropy_reference(logits, targets))
    assert cross_entropy_forward(logits, targets, reduction="sum") == 0


def test_out_of_range_targets_give_nan_rows_and_leave_the_others_alone(nan_outputs):
    logits, _ = _inputs((4, 100), torch.float32)
    targets = torch.tensor([3, 100, -5, 99])
    out = cross_entropy_forward(logits, targets, reduction="none")
    assert torch.isnan(out[1]) and torch.isnan(out[2])
    torch.testing.assert_close(out[[0, 3]].double(), cross_entropy_reference(logits[[0, 3]], targets[[0, 3]],
                                                                             reduction="none"), **TOLERANCE)


def test_loss_of_a_worked_example():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    targets = torch.tensor([1, 0])
    lse1 = torch.log(torch.tensor(torch.e ** 2 + 3, dtype=torch.float64))
    expected = torch.stack((torch.log(torch.tensor(4.0, dtype=torch.float64)), lse1 - 2))
    torch.testing.assert_close(cross_entropy_forward(logits, targets, reduction="none").double(), expected,
                               rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused_before_any_kernel_runs():
    logits, targets = _inputs((4, 10), torch.float32)
    for args, kwargs, message in [((logits, targets.float()), {}, "int64 or int32"),
                                  ((logits, targets[:3]), {}, "must match the logits' leading shape"),
                                  ((logits, targets), {"reduction": "avg"}, "reduction must be one of"),
                                  ((logits.double(), targets), {}, "float16, bfloat16 or float32"),
                                  ((logits, targets), {"chunk": 100}, "power of two")]:
        with pytest.raises(ValueError, match=message):
            cross_entropy_forward(*args, **kwargs)


def test_min_bytes_read_the_logits_and_targets_once():
    assert cross_entropy_min_bytes(4096, 128256, torch.bfloat16) == 4096 * 128256 * 2 + 8 * 4096 + 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(4096, 128256), (333, 32000), (17, 1000)], ids=str)
def test_cross_entropy_on_the_gpu_matches_float64(shape, dtype):
    logits, targets = _inputs(shape, dtype, "cuda")
    for reduction in ("mean", "none"):
        out = cross_entropy_forward(logits, targets, reduction=reduction)
        torch.testing.assert_close(out.double(), cross_entropy_reference(logits, targets, reduction=reduction),
                                   rtol=1e-5, atol=1e-5)
