"""Prompt lookup finds the continuation of the most recent earlier suffix match."""
from dspark.drafters.ngram import lookup_continuation


def test_longest_suffix_wins_and_most_recent_match():
    seq = [1, 2, 3, 9, 2, 3, 7, 8, 5, 2, 3]
    assert lookup_continuation(seq, 2, max_n=2) == [7, 8]  # latest earlier "2 3" is followed by 7 8
    assert lookup_continuation([4, 5, 6, 1, 5, 6, 2, 6], 3, max_n=3) == [2, 6]  # "6" -> latest match at index 5
    assert lookup_continuation([1, 2, 3], 4) == []
    assert lookup_continuation([7], 4) == []
    assert lookup_continuation([1, 2, 1, 2, 1, 2], 3, max_n=2) == [1, 2]
