"""DAPO soft overlong punishment (Yu et al., arXiv 2503.14476, Eq. 13).

With ``L_max = max_response_tokens`` and ``L_cache = buffer_tokens``, a response of ``L``
tokens gets, scaled by ``penalty_factor``:

    0                                   L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
    -1                                  L > L_max

A linear ramp over the last ``L_cache`` tokens of the budget tells the policy "shorter" before
the hard cut, instead of a cliff. ``buffer_tokens = 0`` turns it off.

    L (max 100, buffer 20, factor 1.0)   80    90     100    120
    penalty                              0.0   -0.5   -1.0   -1.0
"""

from __future__ import annotations


def soft_overlong_penalty(response_tokens: int, max_response_tokens: int, buffer_tokens: int, penalty_factor: float) -> float:
    """The overlong penalty of one response (<= 0), added to its reward.

    Args:
        response_tokens: tokens in the response (an EOS that ended it included).
        max_response_tokens: the budget the response was sampled with (``rollout.max_response_tokens``,
            or the current stage's under ``rollout.max_response_tokens_schedule``).
        buffer_tokens: ``reward.overlong_buffer_tokens``; 0 = off.
        penalty_factor: ``reward.overlong_penalty_factor``, the penalty at and beyond the budget.

    Returns:
        A float in ``[-penalty_factor, 0]``.

    Raises:
        ValueError: ``buffer_tokens`` outside ``[0, max_response_tokens]``.
    """
    if not 0 <= buffer_tokens <= max_response_tokens:
        raise ValueError(
            f"reward.overlong_buffer_tokens={buffer_tokens} must be in [0, rollout.max_response_tokens={max_response_tokens}]; "
            "set reward.overlong_buffer_tokens below the response budget"
        )
    if buffer_tokens == 0:
        return 0.0
    start = max_response_tokens - buffer_tokens
    if response_tokens <= start:
        return 0.0
    if response_tokens > max_response_tokens:
        return -float(penalty_factor)
    return (start - response_tokens) / buffer_tokens * float(penalty_factor)
