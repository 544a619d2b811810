"""The lr schedule (engram/optim/builder.py lr_lambda) as docs/config_reference.md states it."""

from __future__ import annotations

import math

import pytest

from engram.optim.builder import lr_lambda


@pytest.mark.parametrize("decay", ["cosine", "linear"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (2, 10), (5, 60), (3, 5)])
def test_warmup_then_decay_to_the_final_lr(decay, warmup, total):
    f = [lr_lambda(s, warmup, total, decay, 0.1) for s in range(total)]
    assert f[:warmup] == pytest.approx([(s + 1) / (warmup + 1) for s in range(warmup)])
    assert f[warmup] == 1.0  # the first step after warmup runs at the peak
    assert f[-1] == pytest.approx(0.1)  # the last step reaches min_lr_ratio x peak
    assert all(a >= b for a, b in zip(f[warmup:-1], f[warmup + 1 :], strict=True))  # decays


def test_cosine_midpoint_and_single_decay_step():
    # T - W - 1 = 8 decay intervals: step W + 4 is halfway, cos(pi / 2) = 0.
    assert lr_lambda(6, 2, 11, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_lambda(4, 2, 11, "linear", 0.0) == pytest.approx(1 - 2 / 8)
    assert lr_lambda(2, 2, 3, "cosine", 0.1) == 1.0  # one step after warmup: the peak
    assert lr_lambda(7, 2, 10, "constant", 0.1) == 1.0
    assert math.isclose(lr_lambda(0, 4, 10, "cosine", 0.1), 0.2)
