"""Counter-based draws for the verification kernels: the uniform for slot i of a request's
draws is Philox4x32-10 of the counter (offset + i) under the key `seed`, computed where it is
used (Triton's `tl.rand(seed, offset + i)`), so a step needs no tensor of draws, no launch to
fill one, and is reproduced from two integers.

`philox_uniforms(seed, offset, shape)` is the same function on the host, bit for bit: the
references (and the CPU path of `kforge.ops`) take its tensor as their `uniforms`, and a test
holds the kernel and the reference to the same tokens. The layout is row-major: entry
(b, j) of a (B, W) draw is counter offset + b * W + j, so consecutive steps of a generator
that advances `offset` by B * W never reuse a counter.

The seed and offset may also live in device memory: a seed tensor, int64 (seed, offset) on the
inputs' device, which the kernels read when they run. A CUDA graph captured with one replays
with whatever it holds, so a step can advance the offset in place (`state[1] += B * W`)
between replays; integers would be frozen into the graph.

Philox (Salmon et al. 2011), as Triton computes it for 32-bit counters: the state is
(c0, c1, c2, c3) = (counter low 32 bits, counter high 32 bits, 0, 0), the key (k0, k1) =
(seed low, seed high); ten rounds of

    c0, c1, c2, c3 = hi(B c2) ^ c1 ^ k0, lo(B c2), hi(A c0) ^ c3 ^ k1, lo(A c0)
    k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85            (all mod 2^32)

with A = 0xD2511F53, B = 0xCD9E8D57, and the uniform is c0 read as a signed int32 x, folded
to x' = x or -x - 1 (in [0, 2^31)), converted to float32 and times float32(4.6566127342e-10):
never 1.0 (the largest is 1 - 2^-24).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
MASK32 = 0xFFFFFFFF
SEED_LIMIT = 1 << 63  # seeds are non-negative int64s: the kernels take them as one


@triton.jit
def draw(uniforms_row, seed, first, slot, mask, SEEDED: tl.constexpr):
    """The uniform(s) for `slot` (an index or a block of them) of one request: Philox of the
    counter first + slot when SEEDED (first = offset + the request's row x its width, int64),
    else the request's row of the given draws (1.0 where `mask` is off)."""
    if SEEDED:
        return tl.rand(seed, first + slot)
    else:
        return tl.load(uniforms_row + slot, mask=mask, other=1.0)


def check_seed(seed: int | torch.Tensor, offset: int) -> None:
    """Raise ValueError unless seed and offset are integers in [0, 2^63), or the seed is a seed
    tensor (int64 (seed, offset), shape (2,)) and offset is 0 (its values are the kernels' to read:
    checking them would read the device)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or tuple(seed.shape) != (2,):
            raise ValueError(f"a seed tensor holds (seed, offset) as int64 of shape (2,), got {seed.dtype} "
                             f"{tuple(seed.shape)}")
        if offset != 0:
            raise ValueError("with a seed tensor the offset is its second entry: pass offset=0")
        return
    for name, value in (("seed", seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
            raise ValueError(f"{name} must be an integer in [0, 2^63), got {value!r}")


def seed_in_memory(seed: int | torch.Tensor | None, device: torch.device) -> bool:
    """Whether the kernel reads its seed and offset from a seed tensor (on `device`, or ValueError)."""
    if not isinstance(seed, torch.Tensor):
        return False
    if seed.device != device:
        raise ValueError(f"the seed tensor is on {seed.device}, the inputs on {device}")
    return True


def seed_values(seed: int | torch.Tensor, offset: int) -> tuple[int, int]:
    """(seed, offset) as integers, a seed tensor's entries read back (philox_uniforms checks them)."""
    if isinstance(seed, torch.Tensor):
        seed, offset = (int(x) for x in seed.tolist())
    return seed, offset


def philox_uint32(seed: int, counters: np.ndarray) -> np.ndarray:
    """Philox4x32-10's first output word for each counter (uint64 array of values < 2^64) under `seed`."""
    c0 = counters & np.uint64(MASK32)
    c1 = counters >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & MASK32), np.uint64(seed >> 32)
    a, b, mask, shift = np.uint64(ROUND_A), np.uint64(ROUND_B), np.uint64(MASK32), np.uint64(32)
    for _ in range(ROUNDS):
        product_b, product_a = b * c2, a * c0  # exact: both factors < 2^32
        c0, c1, c2, c3 = ((product_b >> shift) ^ c1 ^ k0, product_b & mask,
                          (product_a >> shift) ^ c3 ^ k1, product_a & mask)
        k0, k1 = (k0 + np.uint64(KEY_A)) & mask, (k1 + np.uint64(KEY_B)) & mask
    return c0


def philox_uniforms(seed: int, offset: int, shape: tuple[int, ...], device: torch.device | str = "cpu"
                    ) -> torch.Tensor:
    """float32 uniforms in [0, 1) of `shape`, entry i (row-major) = tl.rand(seed, offset + i)."""
    check_seed(seed, offset)
    count = int(np.prod(shape, dtype=np.int64))
    counters = np.arange(count, dtype=np.uint64) + np.uint64(offset)
    words = philox_uint32(seed, counters).astype(np.int64)
    signed = np.where(words >= 1 << 31, words - (1 << 32), words)
    folded = np.where(signed < 0, -signed - 1, signed).astype(np.int32)
    # the kernel's arithmetic: int32 -> float32 (round to nearest), then a float32 product
    uniforms = torch.from_numpy(folded).float() * torch.tensor(4.6566127342e-10, dtype=torch.float32)
    return uniforms.reshape(shape).to(device)
