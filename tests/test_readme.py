"""The README's CPU examples run as written."""
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section whose heading starts with ``section``."""
    match = re.search(rf"^## {re.escape(section)}.*?$(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README has no section {section!r}"
    return re.findall(r"^```python\n(.*?)^```", match.group(1), re.S | re.M)


@pytest.mark.parametrize("section", ["Quick start", "Packed sequences", "Programmable attention", "The emulator"])
def test_examples_run(section):
    blocks = python_blocks(section)
    assert blocks
    for code in blocks:
        exec(compile(code, f"README.md ({section})", "exec"), {})


def test_pytorch_example_runs():
    """The PyTorch block (on the CPU here: the NumPy backend), where torch is installed."""
    pytest.importorskip("torch")
    blocks = python_blocks("PyTorch and JAX")
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md (PyTorch and JAX)", "exec"), {})
