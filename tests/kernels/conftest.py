"""What the kernel tests share: outputs that start as NaN, so an element a kernel forgets to
write shows instead of passing as leftover zeros or stale values."""

import pytest
import torch


@pytest.fixture
def nan_outputs(monkeypatch):
    """For the test's duration, torch.empty and torch.empty_like hand out floating-point
    tensors filled with NaN (integer ones as they come)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))
