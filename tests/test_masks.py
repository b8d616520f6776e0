"""The explicit mask builders."""
import numpy as np
import pytest

from cupy_attn import masks
from helpers import BF16


def picture(m):
    return ["".join("1" if x else "0" for x in row) for row in m]


def test_causal_pictures():
    # The pictures drawn in the docstrings and the README.
    assert picture(masks.causal_mask(2, 5)) == ["11110", "11111"]
    assert picture(masks.causal_mask(2, 5, "top_left")) == ["10000", "11000"]
    assert picture(masks.causal_mask(4, 2)) == ["00", "00", "10", "11"]
    assert masks.causal_mask(3, 3).tolist() == np.tril(np.ones((3, 3), bool)).tolist()


def test_window_mask():
    assert picture(masks.window_mask(3, 5, 1, 0)) == ["01100", "00110", "00011"]
    assert picture(masks.window_mask(3, 5, None, 1, "top_left")) == ["11000", "11100", "11110"]
    assert masks.window_mask(3, 5, None, None).all()
    # A causal window of 3 keys: the causal band minus everything 3 or more below the diagonal.
    band = masks.causal_mask(6, 9) & ~np.tril(np.ones((6, 9), bool), 9 - 6 - 3)
    assert (masks.window_mask(6, 9, 2, 0) == band).all()


def test_padding_mask():
    m = masks.padding_mask(np.array([0, 2, 4]), 4)
    assert m.shape == (3, 1, 1, 4) and m.dtype == bool
    assert m[:, 0, 0].tolist() == [[False] * 4, [True, True, False, False], [True] * 4]
    assert masks.padding_mask([1], 2).tolist() == [[[[True, False]]]]


def test_combine_and_to_additive():
    c = masks.combine(masks.causal_mask(3, 3), None, masks.padding_mask([2, 3], 3))
    assert c.shape == (2, 1, 3, 3)
    assert c[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    for dtype in (np.float16, BF16, np.float32, np.float64):
        a = masks.to_additive(c, dtype)
        assert a.dtype == dtype
        assert ((a == 0) == c).all() and (a[~c].astype(np.float64) == -np.inf).all()


@pytest.mark.parametrize("builder", [lambda **kw: masks.causal_mask(2, 3, **kw),
                                     lambda **kw: masks.window_mask(2, 3, 1, 1, **kw)])
def test_array_module_choice(builder):
    assert isinstance(builder(), np.ndarray)
    assert isinstance(builder(xp=np), np.ndarray)
    assert isinstance(builder(like=np.zeros(1)), np.ndarray)
