"""Where the CUDA C sources live: the installed package data, else the source tree."""
from __future__ import annotations

from pathlib import Path


def kernel_dir() -> Path:
    installed = Path(__file__).resolve().parent / "kernels"
    if installed.is_dir():
        return installed
    source_tree = Path(__file__).resolve().parent.parent / "kernels"
    if source_tree.is_dir():
        return source_tree
    raise FileNotFoundError(f"cupy_attn's CUDA sources are missing: looked in {installed} and {source_tree}")
