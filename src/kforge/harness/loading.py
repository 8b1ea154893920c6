"""Importing user files and calling user code, turning every failure into a clear error."""

from __future__ import annotations

import hashlib
import importlib.util
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import torch

from kforge.errors import KforgeError, describe_exception, error_kind

T = TypeVar("T")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def import_user_file(path: Path, error: type[KforgeError], what: str) -> ModuleType:
    """Import `path` as a fresh module (never a cached one), its folder on sys.path meanwhile.

    The module gets a unique name and is registered in sys.modules, because Triton's
    @jit reads a kernel's source through its module, and dataclasses need it too.
    """
    path = Path(path).resolve()
    if path.is_dir():
        raise error(f"{what} {path} is a folder, not a Python file")
    if not path.is_file():
        raise error(f"{what} file not found: {path}")
    name = f"kforge_user_{what}_{file_sha256(path)[:16]}_{id(object())}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise error(f"{what} file is not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a user file that exits is broken
        sys.modules.pop(name, None)
        summary, details = describe_exception(exc, path)
        raise error(f"{what} failed to import: {summary}", details) from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def call_user(
    fn: Callable[..., T], *args: Any, error: type[KforgeError], stage: str, user_file: Path | None
) -> T:
    """Call user code; any exception it raises becomes `error` naming the stage."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        summary, details = describe_exception(exc, user_file)
        raise error(f"{stage}: {summary}", details, kind=error_kind(exc)) from None


def seed_everything(seed: int) -> None:
    """Seed every generator a problem might draw from: torch (all devices), numpy, random."""
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp32_means_fp32() -> None:
    """Both workers start with fp32 convolutions and RNNs in fp32: PyTorch's default lets
    cuDNN round them to tf32 (10-bit mantissa, as coarse as fp16), which gate 1's fp32
    bound (problem.DEFAULT_TOLERANCE) exists to catch. cuBLAS matmuls are fp32 by default."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
