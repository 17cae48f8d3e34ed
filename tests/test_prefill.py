"""The prefill pass's width: short prompts are not padded to a long one, budgets and caps hold."""
from __future__ import annotations

import pytest

from dspark.engine.prefill import PASS_SLOTS, prefill_width


def fed(todo, width):
    return sum(min(t, width) for t in todo)


def test_a_long_prompt_does_not_pad_the_short_ones_to_its_length():
    todo = [36, 314, 23]
    width = prefill_width(todo)
    assert width == 36  # the two short prompts finish in this pass; the long one continues later
    assert fed(todo, width) / (len(todo) * width) > 0.85
    assert fed(todo, 314) / (len(todo) * 314) < 0.4  # what feeding every prompt to its end would waste


def test_prompts_of_equal_length_go_in_one_pass():
    assert prefill_width([40, 40, 40]) == 40
    assert prefill_width([300]) == 300


def test_the_width_maximises_prompt_tokens_per_modelled_cost():
    todo = [5, 9, 30, 31, 33, 120, 374]
    width = prefill_width(todo)
    score = lambda w: fed(todo, w) / (PASS_SLOTS + len(todo) * w)  # noqa: E731
    assert all(score(width) >= score(w) for w in range(1, max(todo) + 1))


@pytest.mark.parametrize("todo", [[36, 314, 23], [300], [10] * 8, [1, 2, 3, 500, 7]])
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_the_pass_spans_at_most_the_slot_budget(todo, budget):
    width = prefill_width(todo, budget)
    assert 1 <= width and len(todo) * width <= max(budget, len(todo))


def test_a_cap_bounds_the_width_and_nothing_fits_under_a_zero_cap():
    assert prefill_width([300, 20], cap=50) <= 50
    assert prefill_width([300, 20], cap=0) == 0
    assert prefill_width([]) == 0


def test_more_rows_than_the_budget_still_feed_one_token_each():
    assert prefill_width([50] * 40, slot_budget=16) == 1
