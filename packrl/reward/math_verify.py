"""`reward.name=math_verify`: symbolic answer checking with the optional `math-verify` package.

The ground truth is parsed as ``\\boxed{<ground truth>}`` and the response as written; the
package extracts the final LaTeX or plain expression of each and compares them symbolically,
so ``\\frac{1}{2}``, ``0.5`` and ``1/2`` agree. A response with no parseable answer scores 0.0,
a parsed but wrong one ``reward.format_score``. The package is imported on first call, so
packrl does not depend on it; install it with ``pip install math-verify``.
"""

from __future__ import annotations

from packrl.config.schema import RewardConfig
from packrl.reward.registry import register_reward


def _load():
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ValueError(
            "reward.name=math_verify needs the math-verify package, which is not installed; "
            "pip install math-verify, or set reward.name=gsm8k"
        ) from err
    return parse, verify


@register_reward("math_verify", correct_score=1.0)
def math_verify_reward(response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
    """1.0 when the response's final answer equals the ground truth symbolically,
    ``cfg.format_score`` when an answer is found but differs, 0.0 when none is found.

    Raises:
        ValueError: the math-verify package is not installed.
    """
    parse, verify = _load()
    answer = parse(response_text)
    if not answer:
        return 0.0
    gold = parse(f"\\boxed{{{ground_truth}}}")
    return 1.0 if verify(gold, answer) else float(cfg.format_score)


def config_problems(cfg) -> list:
    """At config load: ``reward.name=math_verify`` without the package is a problem (before any model loads)."""
    import importlib.util

    from packrl.errors import ConfigProblem

    if importlib.util.find_spec("math_verify") is None:
        return [ConfigProblem("reward.name", "math_verify", "needs the math-verify package, which is not installed",
                              "pip install math-verify (or pip install -e '.[math]'), or set reward.name=gsm8k")]
    return []
