"""The counter-based draws of the verification kernels: Triton's `tl.rand` (under the
interpreter, and compiled on a GPU) against `philox_uniforms` on the host, bit for bit, for
64-bit seeds and counters that cross 2^32; known answers; the draws' range and uniformity;
refused seeds."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kforge.kernels.speculative.draws import philox_uniforms


@triton.jit
def _rand_kernel(out_ptr, seed, offset, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.rand(seed, offset + i), mask=i < n)


def _triton_draws(seed: int, offset: int, n: int, device: str = "cpu") -> torch.Tensor:
    out = torch.full((n,), -1.0, device=device)
    _rand_kernel[(triton.cdiv(n, 256),)](out, seed, offset, n, BLOCK=256)
    return out


@pytest.mark.parametrize("seed, offset", [(0, 0), (1, 5), (123456789, 2**31 - 100), (2**40 + 3, 2**32 - 300),
                                          (2**63 - 1, 2**40)])
def test_triton_rand_and_the_host_philox_agree_bit_for_bit(seed, offset):
    got = _triton_draws(seed, offset, 1000)
    assert torch.equal(got, philox_uniforms(seed, offset, (1000,)))


def test_known_answers_and_the_row_major_layout():
    # tl.rand(0, 0..2) in Triton 3.6; a change of the generator (here or in Triton) shows
    assert philox_uniforms(0, 0, (3,)).tolist() == [0.7980929017066956, 0.055517591536045074, 0.03889884054660797]
    grid = philox_uniforms(9, 100, (4, 5))
    assert torch.equal(grid[2], philox_uniforms(9, 100 + 2 * 5, (5,))), "entry (b, j) is counter offset + b W + j"


def test_draws_are_uniform_on_the_unit_interval():
    draws = philox_uniforms(2026, 0, (200_000,)).double()
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    counts = torch.histc(draws, bins=20, min=0.0, max=1.0)
    expected = len(draws) / 20
    statistic = float(((counts - expected) ** 2 / expected).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor(19 / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
    assert pvalue > 1e-4, f"chi-square over 20 bins: p = {pvalue:.2e}"
    # neighbouring counters are not correlated (a lag-1 correlation of ~1/sqrt(n) at most)
    assert abs(float(torch.corrcoef(torch.stack([draws[:-1], draws[1:]]))[0, 1])) < 5 / len(draws) ** 0.5
    # the largest uniform: 2^31 - 1 rounds to 2^31 in float32, times float32(4.6566127342e-10) < 2^-31
    assert float(torch.tensor(2**31 - 1, dtype=torch.int32).float() * torch.tensor(4.6566127342e-10)) < 1.0


@pytest.mark.parametrize("seed, offset", [(-1, 0), (2**63, 0), (0, -5), (1.5, 0), (True, 0)])
def test_seeds_and_offsets_outside_int64_are_refused(seed, offset):
    with pytest.raises(ValueError, match=r"must be an integer in \[0, 2\^63\)"):
        philox_uniforms(seed, offset, (4,))


@pytest.mark.gpu
def test_the_compiled_kernel_draws_what_the_host_computes():
    for seed, offset in [(0, 0), (2**40 + 3, 2**32 - 300_000)]:
        got = _triton_draws(seed, offset, 1_000_000, "cuda")
        assert torch.equal(got.cpu(), philox_uniforms(seed, offset, (1_000_000,)))
