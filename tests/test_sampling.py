"""Temperature, top-k and top-p filtering."""
import pytest
import torch

from dspark.sampling import BatchSampling, SamplingParams, argmax_last, filter_logits, logits_to_probs


def test_top_k_and_top_p_per_row():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]], [[0.5, 0.3, 0.15, 0.05]], [[0.5, 0.3, 0.15, 0.05]]]))
    out = filter_logits(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.8, 0.81]))
    kept = torch.isfinite(out[:, 0]).tolist()
    assert kept[0] == [True, True, False, False]
    assert kept[1] == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept[2] == [True, True, True, False]


def test_greedy_rows_are_one_hot_and_temperature_sharpens():
    logits = torch.tensor([[[1.0, 2.0, 0.5]], [[1.0, 2.0, 0.5]], [[1.0, 2.0, 0.5]]])
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)]
    probs = logits_to_probs(logits, BatchSampling.from_params(params, "cpu"))
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1, 0], torch.softmax(logits[1, 0], -1))
    assert probs[2, 0, 1] > probs[1, 0, 1]


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_last_gives_argmax_indices_with_ties_nan_and_infinities(dtype):
    """`argmax_last` (the max reduction's indices, faster on a CPU) is x.argmax(-1) index for index: the first
    of tied maxima, a NaN taken as the largest, rows of -inf, any leading shape and strided views."""
    g = torch.Generator().manual_seed(0)
    cases = [torch.randint(0, 3, (40, 5, 300), generator=g).to(dtype),  # many ties
             torch.randn(16, 8192, generator=g).to(dtype)]
    inf = torch.full((6, 50), float("-inf"), dtype=dtype)
    inf[1:, 7] = 0.0
    nan = torch.randn(4, 100, generator=g).to(dtype)
    nan[0, 5] = nan[0, 9] = float("nan")
    nan[2, 3] = float("inf")
    cases += [inf, nan, torch.randn(8, 6, 64, generator=g).to(dtype).transpose(0, 1)[:, :, 1:]]
    for x in cases:
        assert torch.equal(argmax_last(x), x.argmax(-1))
