"""Invariant 2: no micro-batch holds more than its token budget; an over-budget sequence is an
error at planning time naming it. Plus: micro-batch counts are minimal where that is checkable,
and every data-parallel rank gets the same number of micro-batches."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packrl.seqlen.balance import balance_ranks
from packrl.seqlen.microbatch import plan_microbatches


def ffd_count(lengths: list[int], cap: int) -> int:
    """Independent first-fit-decreasing bin count."""
    loads: list[int] = []
    for n in sorted(lengths, reverse=True):
        for b, load in enumerate(loads):
            if load + n <= cap:
                loads[b] += n
                break
        else:
            loads.append(n)
    return len(loads)


def optimal_count(lengths: list[int], cap: int) -> int:
    """Brute force over assignments (small inputs only)."""
    best = len(lengths)

    def go(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(lengths):
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + lengths[i] <= cap:
                loads[b] += lengths[i]
                go(i + 1, loads)
                loads[b] -= lengths[i]
        go(i + 1, loads + [lengths[i]])

    go(0, [])
    return best


@st.composite
def batches(draw, max_n: int = 40):
    cap = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, cap), min_size=1, max_size=max_n))
    return lengths, cap


@settings(max_examples=300, deadline=None)
@given(batches(), st.booleans())
def test_no_microbatch_exceeds_budget_and_count_is_never_worse_than_ffd(batch, balance):
    lengths, cap = batch
    plan = plan_microbatches(lengths, cap, balance=balance)
    assert all(t <= cap for t in plan.num_tokens())
    assert sorted(plan.order) == list(range(len(lengths)))
    lower = max(math.ceil(sum(lengths) / cap), sum(1 for n in lengths if 2 * n > cap))
    assert lower <= plan.num_microbatches <= ffd_count(lengths, cap)
    if ffd_count(lengths, cap) == lower:  # FFD-feasible at the lower bound: we must match it
        assert plan.num_microbatches == lower


@settings(max_examples=200, deadline=None)
@given(batches(max_n=8))
def test_count_is_optimal_on_small_batches(batch):
    lengths, cap = batch
    assert plan_microbatches(lengths, cap).num_microbatches == optimal_count(lengths, cap)


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(1, 4))
def test_ranks_get_equal_microbatch_counts_within_budget(batch, num_ranks):
    lengths, cap = batch
    if len(lengths) < num_ranks:
        with pytest.raises(ValueError, match="ranks"):
            balance_ranks(lengths, num_ranks, cap)
        return
    plan = balance_ranks(lengths, num_ranks, cap)
    counts = {p.num_microbatches for p in plan.ranks}
    assert len(counts) == 1
    assert all(t <= cap for p in plan.ranks for t in p.num_tokens())
    assert sorted(i for p in plan.ranks for i in p.order) == list(range(len(lengths)))
    assert all(len(p.order) >= 1 for p in plan.ranks)


def test_eight_sevens_under_budget_eight_need_eight_microbatches():
    plan = plan_microbatches([7] * 8, 8)
    assert plan.num_microbatches == 8
    assert plan.num_tokens() == [7] * 8


def test_sequence_over_budget_is_named_at_planning_time():
    with pytest.raises(ValueError) as err:
        plan_microbatches([3, 9, 2], 8)
    message = str(err.value)
    assert "sequence 1" in message and "9 tokens" in message and "train.max_tokens_per_microbatch=8" in message


def test_over_budget_error_names_the_given_key():
    with pytest.raises(ValueError, match="train.max_tokens_per_logprob_microbatch=4"):
        plan_microbatches([5], 4, budget_key="train.max_tokens_per_logprob_microbatch")


@pytest.mark.parametrize(
    ("lengths", "cap", "match"),
    [([], 8, "empty batch"), ([3, 0], 8, "sequence 1 has length 0"), ([3, -2], 8, "length -2"),
     ([3], 0, "must be a positive integer"), ([3.5], 8, "length 3.5")],
)
def test_bad_input_is_a_value_error(lengths, cap, match):
    with pytest.raises(ValueError, match=match):
        plan_microbatches(lengths, cap)


def test_balancing_flattens_cost_without_adding_microbatches():
    lengths = [500, 480, 30, 20, 25, 470, 15, 35, 490, 40]
    flat = plan_microbatches(lengths, 1100, balance=True)
    first_fit = plan_microbatches(lengths, 1100, balance=False)
    assert flat.num_microbatches == first_fit.num_microbatches
    assert max(flat.costs()) <= max(first_fit.costs())


def test_fixed_count_larger_than_batch_gives_empty_microbatches():
    plan = plan_microbatches([4, 4], 8, num_microbatches=3)
    assert plan.num_microbatches == 3 and sorted(plan.num_tokens()) == [0, 4, 4]
    with pytest.raises(ValueError, match="cannot split"):
        plan_microbatches([8, 8, 8], 8, num_microbatches=2)


def test_large_batches_plan_without_deep_recursion():
    lengths = [(i * 7919) % 900 + 50 for i in range(4096)]
    plan = balance_ranks(lengths, 8, 8192)
    assert len({p.num_microbatches for p in plan.ranks}) == 1
    assert all(t <= 8192 for p in plan.ranks for t in p.num_tokens())


# Grouped caps: a second budget per micro-batch over items that sequences share, e.g. a
# vision-language model's vision-encoder patches of the distinct images each holds (a group's
# sequences share their prompt's images).

PATCH_LIMIT = dict(name="vision_patches", budget_key="train.max_vision_patches_per_microbatch", unit="vision-encoder patches",
                   fix="lower data.max_image_tokens / data.image.max_pixels")


def patch_cap(patches, keys, max_patches):
    """The vision-patch cap as `packrl.config.grouped_caps.grouped_cap_limits` builds it, over ``patches`` per sequence."""
    from packrl.seqlen.microbatch import CapLimit

    return CapLimit(cap=max_patches, **PATCH_LIMIT).over(patches, keys)


def distinct_load(mb, cap) -> int:
    """Independent count: each key's load once."""
    return sum(dict((cap.keys[i], cap.loads[i]) for i in mb).values())


@st.composite
def vision_batches(draw, max_n: int = 40):
    lengths, cap = draw(batches(max_n))
    group = draw(st.integers(1, 4))
    max_patches = draw(st.integers(1, 500))
    per_prompt = draw(st.lists(st.one_of(st.just(0), st.integers(1, max_patches)), min_size=len(lengths), max_size=len(lengths)))
    keys = tuple(i // group for i in range(len(lengths)))
    return lengths, cap, patch_cap(tuple(per_prompt[k] for k in keys), keys, max_patches)


@settings(max_examples=300, deadline=None)
@given(vision_batches(), st.booleans())
def test_no_microbatch_exceeds_either_budget(batch, balance):
    lengths, cap, vision = batch
    plan = plan_microbatches(lengths, cap, balance=balance, caps=[vision])
    assert all(t <= cap for t in plan.num_tokens())
    assert all(distinct_load(mb, vision) <= vision.limit.cap for mb in plan.microbatches)
    assert sorted(plan.order) == list(range(len(lengths)))
    assert plan.num_microbatches <= len(lengths)
    assert plan.num_microbatches >= max(math.ceil(sum(lengths) / cap), math.ceil(distinct_load(range(len(lengths)), vision)
                                                                                  / vision.limit.cap))


@settings(max_examples=150, deadline=None)
@given(vision_batches(), st.integers(1, 4))
def test_ranks_get_equal_counts_within_both_budgets(batch, num_ranks):
    lengths, cap, vision = batch
    if len(lengths) < num_ranks:
        return
    plan = balance_ranks(lengths, num_ranks, cap, caps=[vision])
    assert len({p.num_microbatches for p in plan.ranks}) == 1
    for p in plan.ranks:
        assert all(t <= cap for t in p.num_tokens())
        assert all(distinct_load(mb, vision) <= vision.limit.cap for mb in p.microbatches)
    assert sorted(i for p in plan.ranks for i in p.order) == list(range(len(lengths)))


def test_a_group_shares_its_images_patches_in_one_microbatch():
    # 2 prompts x 3 responses, 600 patches per prompt: a group fits one 1,000-patch micro-batch
    # (encoded once), two groups do not
    vision = patch_cap((600,) * 6, (0, 0, 0, 1, 1, 1), 1000)
    plan = plan_microbatches([10] * 6, 1000, caps=[vision])
    assert plan.num_microbatches == 2
    assert sorted(sorted(vision.keys[i] for i in mb) for mb in plan.microbatches) == [[0, 0, 0], [1, 1, 1]]
    assert plan_microbatches([10] * 6, 1000).num_microbatches == 1  # the token budget alone


def test_images_over_the_patch_budget_are_named_at_planning_time():
    vision = patch_cap((100, 100, 900, 900), (0, 0, 1, 1), 800)
    for plan in (lambda: plan_microbatches([5] * 4, 100, caps=[vision]), lambda: balance_ranks([5] * 4, 2, 100, caps=[vision])):
        with pytest.raises(ValueError) as err:
            plan()
        message = str(err.value)
        assert "sequence 3" in message and "900 vision-encoder patches" in message
        assert "train.max_vision_patches_per_microbatch=800" in message
