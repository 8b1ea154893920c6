"""Cross-entropy from hidden states without the logits (`kernels/fused/linear_cross_entropy.py`):
under the interpreter, per-token losses against float64 (fp16, and bf16 with the interpreter's
dot mended) on row, vocabulary and K tails; targets in the first and the last column;
ignored tokens; the mean; logits large enough to overflow exp without the max; a merge of
more vocabulary tiles than one step takes; every partial written (poisoned buffers); bad
inputs refused. On a GPU: every config, and Llama-3-8B's LM head at 4096 tokens."""

from __future__ import annotations

import pytest
import torch

from kforge.kernels.fused.linear_cross_entropy import (CONFIGS, MERGE_TILES, SHARED_LIMIT, linear_cross_entropy,
                                                       linear_cross_entropy_min_bytes,
                                                       linear_cross_entropy_reference, shared_bytes)
from kforge.runtime.interpreter import mend_bf16_dot

# fp32 logits from exact fp16/bf16 products, exp and log in fp32: ~1e-6 of the loss
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
SMALL = {"BM": 16, "BN": 32, "BK": 32}


def _operands(t, v, d, dtype=torch.float16, device="cpu", seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(t, d, generator=g)
    w = torch.randn(v, d, generator=g) / d**0.5
    targets = torch.randint(0, v, (t,), generator=g)
    return x.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device), targets.to(device)


def test_per_token_losses_match_float64_on_tails(nan_outputs):
    # T = 37 = 2 * 16 + 5, V = 301 = 9 * 32 + 13, D = 40 = 32 + 8; the first and last column as targets
    x, w, targets = _operands(37, 301, 40)
    targets[0], targets[1] = 0, 300
    got = linear_cross_entropy(x, w, targets, reduction="none", config=SMALL)
    assert got.shape == (37,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), linear_cross_entropy_reference(x, w, targets), **TOLERANCE)


def test_bf16_with_the_interpreters_dot_mended_and_int32_targets(nan_outputs):
    mend_bf16_dot()
    x, w, targets = _operands(20, 100, 48, torch.bfloat16, seed=1)
    got = linear_cross_entropy(x, w, targets.int(), reduction="none")  # the default CPU tile
    torch.testing.assert_close(got.double(), linear_cross_entropy_reference(x, w, targets), **TOLERANCE)


def test_ignored_tokens_lose_nothing_and_leave_the_mean(nan_outputs):
    x, w, targets = _operands(21, 70, 32, seed=2)
    targets[[0, 5, 20]] = -100
    losses = linear_cross_entropy(x, w, targets, reduction="none", config=SMALL)
    assert torch.equal(losses[[0, 5, 20]], torch.zeros(3))
    mean = linear_cross_entropy(x, w, targets, config=SMALL)
    want = torch.nn.functional.cross_entropy(x.double() @ w.double().T, targets)  # ignore_index=-100
    assert mean.dim() == 0
    torch.testing.assert_close(mean.double(), want, **TOLERANCE)
    other = linear_cross_entropy(x, w, torch.where(targets < 0, 7, targets), ignore_index=7, reduction="none",
                                 config=SMALL)
    assert torch.all(other[targets == 7] == 0) and torch.all(other[[0, 5, 20]] == 0)


def test_large_logits_do_not_overflow():
    x, w, targets = _operands(9, 64, 16, torch.float16, seed=3, scale=40.0)
    got = linear_cross_entropy(x, w, targets, reduction="none", config=SMALL)  # logits ~ +-100: exp(100) = inf
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), linear_cross_entropy_reference(x, w, targets), rtol=1e-5, atol=1e-4)


def test_merge_walks_more_tiles_than_one_step(nan_outputs):
    v = (MERGE_TILES + 3) * SMALL["BN"] - 5  # 35 vocabulary tiles, the last one short: two merge steps
    x, w, targets = _operands(3, v, 16, seed=4)
    targets[2] = v - 1
    got = linear_cross_entropy(x, w, targets, reduction="none", config=SMALL)
    torch.testing.assert_close(got.double(), linear_cross_entropy_reference(x, w, targets), **TOLERANCE)


def test_configs_fit_shared_memory_and_min_bytes_count_x_and_w():
    assert CONFIGS and all(shared_bytes(c) <= SHARED_LIMIT for c in CONFIGS)
    assert linear_cross_entropy_min_bytes(4096, 128256, 4096) == (4096 * 4096 + 128256 * 4096) * 2 + 4096 * 8 + 4


def _bad_cases():
    x, w, targets = _operands(4, 16, 16)
    return [
        ((x[0], w, targets), "must be \\(T, D\\)"),
        ((x, w, targets[:3]), "must be \\(T, D\\)"),
        ((x.float(), w.float(), targets), "float16, bfloat16"),
        ((x, w.bfloat16(), targets), "share one dtype"),
        ((x, w, targets.float()), "int32 or int64"),
        ((x, w[:, :8], targets), "D must match"),
        ((torch.zeros(4, 12, dtype=torch.float16), torch.zeros(16, 12, dtype=torch.float16), targets), "multiple of 8"),
        ((torch.zeros(4, 32, dtype=torch.float16)[:, ::2], w, targets), "contiguous"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_are_refused_with_a_clear_error(case):
    args, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(*args)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(*_operands(4, 16, 16), reduction="sum")


# --- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_every_config_is_correct_on_the_gpu():
    x, w, targets = _operands(300, 1000, 520, torch.bfloat16, "cuda", seed=5)  # tails in T, V and D
    targets[:3] = torch.tensor([0, 999, -100])
    want = linear_cross_entropy_reference(x, w, targets)
    for config in CONFIGS:
        tiles = dict(config.kwargs, num_stages=config.num_stages, num_warps=config.num_warps)
        got = linear_cross_entropy(x, w, targets, reduction="none", config=tiles)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_llama3_lm_head_on_the_gpu():
    x, w, targets = _operands(4096, 128256, 4096, torch.bfloat16, "cuda", seed=6)
    targets[::20] = -100
    got = linear_cross_entropy(x, w, targets, reduction="none")
    torch.testing.assert_close(got.double(), linear_cross_entropy_reference(x, w, targets), rtol=1e-5, atol=1e-4)
    mean = linear_cross_entropy(x, w, targets)
    torch.testing.assert_close(mean.double(), got.double().sum() / (targets != -100).sum(), rtol=1e-6, atol=1e-6)
