"""Cache layers that append in place: the same logits as Hugging Face's concatenating layers through every
cache operation of `CausalLM`, and no copy of the cache on an ordinary pass."""
import torch
from transformers import DynamicCache, Qwen3Config
from transformers.cache_utils import DynamicLayer

import dspark.target
from dspark.kv_cache import HeadroomLayer, new_cache
from dspark.target import CausalLM
from tests.conftest import tiny_qwen3


def script(lm: CausalLM, seed: int) -> list[torch.Tensor]:
    """Uneven appends, rollbacks, rows leaving (re-indexed, and filled from the end), new rows joining from a
    second wrapper (narrower and wider than the batch), a compaction: the logits of every pass."""
    gen = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(0, 96, (n,), generator=gen).tolist()

    outs = []
    lm.reset(3)
    outs.append(lm.forward([toks(9), toks(2), toks(5)]).logits)
    for step in range(12):
        counts = [int(torch.randint(0, 5, (1,), generator=gen)) for _ in range(lm.batch_size)]
        outs.append(lm.forward([toks(c) for c in counts]).logits)
        keep = [int(n) - c // 2 for n, c in zip(lm.lengths, counts)]
        lm.truncate(keep)
        if step == 3:
            lm.select([2, 0])
        if step == 5:  # two requests join with their own prefilled cache
            side = lm.empty_like()
            side.reset(2)
            side.forward([toks(4), toks(11)])
            lm.extend(side.take([1, 0]))
        if step == 7:  # row 1 leaves and the last row takes its place
            lm.select([0, lm.batch_size - 1, *range(2, lm.batch_size - 1)])
        if step == 8:
            lm.compact()
        if step == 10:  # a prompt wider than the batch joins
            side = lm.empty_like()
            side.reset(1)
            side.forward([toks(lm.valid.shape[1] + 7)])
            lm.extend(side)
    return outs


def test_in_place_layers_give_the_logits_of_concatenating_ones(monkeypatch):
    model = tiny_qwen3()
    mine = script(CausalLM(model, compact_slack=3), seed=1)
    monkeypatch.setattr(dspark.target, "new_cache", lambda config: DynamicCache(config=config))
    ref_lm = CausalLM(model, compact_slack=3)
    ref = script(ref_lm, seed=1)
    assert not any(isinstance(layer, HeadroomLayer) for layer in ref_lm.cache.layers)  # the reference is HF's
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_passes_write_into_spare_capacity_and_batch_edits_copy_once():
    model = tiny_qwen3()
    lm = CausalLM(model)
    lm.reset(8)
    lm.forward([[1, 2, 3]] + [[4]] * 7)
    layer = lm.cache.layers[0]
    assert isinstance(layer, HeadroomLayer)
    buffer = layer._kbuf
    assert buffer.shape[2] >= layer.keys.shape[2] + 64 and buffer.shape[0] >= 8 + 4  # room to grow
    for _ in range(5):
        lm.forward([[5]] * 4 + [[6, 7]] * 4)
    assert layer._kbuf is buffer and layer.keys.data_ptr() == buffer.data_ptr()  # appended in place
    assert layer.keys.shape[2] == 3 + 5 * 2
    lm.truncate([5, 6] * 4)  # trailing slots dropped: still a prefix view, the next pass overwrites them
    lm.forward([[8]] * 8)
    assert layer._kbuf is buffer
    lm.select([0, 7, 2, 3, 4, 5, 6])  # row 1 leaves, the last takes its place: in place, one row moved
    assert layer._kbuf is buffer and layer.keys.shape[0] == 7 and layer.keys.data_ptr() == buffer.data_ptr()
    lm.forward([[10]] * 7)
    assert layer._kbuf is buffer
    side = lm.empty_like()
    side.reset(1)
    side.forward([[1, 2]])
    lm.extend(side)  # a join into the spare rows: in place, only the joining row is written
    assert lm.cache.layers[0] is layer and layer._kbuf is buffer and layer.keys.shape[0] == 8
    lm.forward([[3]] * 8)
    assert layer._kbuf is buffer
    lm.select([1, 0, 2, 3, 4, 5, 6, 7])  # rows re-ordered: copied once into a new buffer, which passes append to
    selected = layer._kbuf
    assert selected is not buffer and layer.keys.data_ptr() == selected.data_ptr()
    lm.forward([[5]] * 8)
    assert layer._kbuf is selected
    crowd = lm.empty_like()
    crowd.reset(selected.shape[0])
    crowd.forward([[1]] * selected.shape[0])
    lm.extend(crowd)  # more rows than the spare ones: re-homed into a larger buffer
    joined = layer._kbuf
    assert joined is not selected and joined.shape[0] > lm.batch_size and layer.keys.data_ptr() == joined.data_ptr()
    layer = lm.cache.layers[0]
    lm.compact()  # a compaction gathers into a new buffer
    assert layer._kbuf is not joined and layer.keys.data_ptr() == layer._kbuf.data_ptr()
    lm.select(list(range(3)))  # the batch shrinks under half its buffer: copied, giving the memory back
    assert layer._kbuf.shape[0] < joined.shape[0] // 2
    lm.select([])
    assert layer._kbuf.numel() == 0  # an empty batch holds no KV memory


def test_new_cache_keeps_sliding_window_layers_as_they_are():
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8,
                         layer_types=["full_attention", "sliding_attention"])
    hf = DynamicCache(config=config)
    mine = new_cache(config)
    assert type(hf.layers[1]) is not DynamicLayer  # HF's sliding layer, which crops itself
    assert isinstance(mine.layers[0], HeadroomLayer) and type(mine.layers[1]) is type(hf.layers[1])
