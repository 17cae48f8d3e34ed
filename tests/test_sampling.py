"""Temperature, top-k and top-p filtering."""
import pytest
import torch

from dspark.sampling import BatchSampling, SamplingParams, filter_logits, logits_to_probs


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
