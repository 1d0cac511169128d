"""DAPO soft overlong penalty (arXiv 2503.14476, Eq. 13): the table of `packrl.reward.overlong`."""

from __future__ import annotations

import pytest

from packrl.reward import soft_overlong_penalty


@pytest.mark.parametrize(
    "tokens, max_tokens, buffer, factor, penalty",
    [
        (50, 100, 20, 1.0, 0.0),
        (80, 100, 20, 1.0, 0.0),  # at the ramp start
        (81, 100, 20, 1.0, -0.05),
        (90, 100, 20, 1.0, -0.5),
        (100, 100, 20, 1.0, -1.0),  # at the budget
        (120, 100, 20, 1.0, -1.0),  # beyond
        (90, 100, 20, 0.5, -0.25),
        (100, 100, 100, 2.0, -2.0),
        (0, 100, 100, 1.0, 0.0),
        (100, 100, 0, 1.0, 0.0),  # buffer 0: off
        (500, 100, 0, 1.0, 0.0),
    ],
)
def test_penalty_table(tokens, max_tokens, buffer, factor, penalty):
    assert soft_overlong_penalty(tokens, max_tokens, buffer, factor) == pytest.approx(penalty)


@pytest.mark.parametrize("buffer", [-1, 101])
def test_buffer_outside_the_budget(buffer):
    with pytest.raises(ValueError, match=r"reward.shaping.overlong.buffer_tokens=.* rollout.max_response_tokens=100"):
        soft_overlong_penalty(50, 100, buffer, 1.0)
