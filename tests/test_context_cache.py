"""The block drafters' context cache: every row keeps exactly its own appended K/V, in order, through appends,
rows leaving and joining, compaction and subsets; ordinary appends and edits write in place."""
import torch

from dspark.drafters.context_cache import ContextCache

LAYERS, HEADS, DIM = 2, 1, 4


def chunk(gen: torch.Generator, rows: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, HEADS, width, DIM, generator=gen), torch.randn(rows, HEADS, width, DIM, generator=gen))
            for _ in range(LAYERS)]


def append(cache: ContextCache, history: list[list[list[tuple[torch.Tensor, torch.Tensor]]]],
           kv: list[tuple[torch.Tensor, torch.Tensor]], counts: list[int]) -> None:
    """Append to the cache and to the expected per-row histories (history[row][layer] = [(k, v) per slot])."""
    cache.append(kv, torch.tensor(counts))
    for r, c in enumerate(counts):
        for layer, (k, v) in enumerate(kv):
            history[r][layer].extend((k[r, :, j], v[r, :, j]) for j in range(c))


def check(cache: ContextCache, history) -> None:
    assert cache.lengths.tolist() == [len(h[0]) for h in history]
    assert cache.dense == bool(cache.valid.all())
    for layer, (k, v) in enumerate(cache.kv):
        assert k.shape[0] == len(history) and k.shape[2] == cache.valid.shape[1]
        for r, row in enumerate(history):
            slots = cache.valid[r].nonzero().flatten()
            want_k = torch.stack([kk for kk, _ in row[layer]], 1) if row[layer] else torch.zeros(HEADS, 0, DIM)
            want_v = torch.stack([vv for _, vv in row[layer]], 1) if row[layer] else torch.zeros(HEADS, 0, DIM)
            assert torch.equal(k[r][:, slots], want_k) and torch.equal(v[r][:, slots], want_v)


def test_every_row_keeps_its_own_context_through_every_edit():
    gen = torch.Generator().manual_seed(0)
    cache = ContextCache(compact_slack=3)
    history = [[[] for _ in range(LAYERS)] for _ in range(3)]
    append(cache, history, chunk(gen, 3, 6), [6, 2, 4])
    check(cache, history)
    for step in range(14):
        counts = torch.randint(1, 5, (len(history),), generator=gen).tolist()
        append(cache, history, chunk(gen, len(history), max(counts)), counts)
        if step == 2:  # row 0 leaves, the last row fills its place
            cache.select([2, 1])
            history = [history[2], history[1]]
        if step == 4:  # two rows join, one wider than the batch
            fresh = ContextCache()
            joining = [[[] for _ in range(LAYERS)] for _ in range(2)]
            width = cache.valid.shape[1] + 5
            append(fresh, joining, chunk(gen, 2, width), [3, width])
            cache.extend(fresh)
            history += joining
        if step == 6:  # rows re-ordered
            cache.select([3, 0, 2, 1])
            history = [history[i] for i in (3, 0, 2, 1)]
        if step == 8:
            cache.compact()
        if step == 10:  # a narrow row joins a wide batch
            fresh = ContextCache()
            joining = [[[] for _ in range(LAYERS)]]
            append(fresh, joining, chunk(gen, 1, 2), [2])
            cache.extend(fresh)
            history += joining
        check(cache, history)


def test_appends_and_row_edits_write_in_place_and_subsets_copy():
    gen = torch.Generator().manual_seed(1)
    cache = ContextCache()
    history = [[[] for _ in range(LAYERS)] for _ in range(8)]
    append(cache, history, chunk(gen, 8, 5), [5] * 8)
    append(cache, history, chunk(gen, 8, 1), [1] * 8)  # first append after the prompt: re-homed with headroom
    layer = cache.layers[0]
    buffer = layer._kbuf
    for _ in range(6):  # rounds append into the spare slots
        append(cache, history, chunk(gen, 8, 3), torch.randint(1, 4, (8,), generator=gen).tolist())
    assert layer._kbuf is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    cache.select([0, 7, 2, 3, 4, 5, 6])  # row 1 leaves, the last fills its place: in place
    history = [history[i] for i in (0, 7, 2, 3, 4, 5, 6)]
    assert layer._kbuf is buffer
    fresh = ContextCache()
    joining = [[[] for _ in range(LAYERS)]]
    append(fresh, joining, chunk(gen, 1, 4), [4])
    cache.extend(fresh)  # into a spare row: in place
    history += joining
    assert cache.layers[0] is layer and layer._kbuf is buffer
    check(cache, history)
    before = [(k.clone(), v.clone()) for k, v in cache.kv]
    part = cache.subset([5, 2])
    part.append(chunk(gen, 2, 2), torch.tensor([2, 1]))  # the subset grows on its own
    part.select([1])
    for (k, v), (k0, v0) in zip(cache.kv, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # the original is untouched
    check(cache, history)
    cache.select([])
    assert cache.layers[0]._kbuf.numel() == 0 and cache.lengths.numel() == 0  # an empty batch holds no memory


def test_rooms_give_scratch_slots_after_the_context_without_copying_it_and_appends_write_over_them():
    gen = torch.Generator().manual_seed(2)
    cache = ContextCache()
    history = [[[] for _ in range(LAYERS)] for _ in range(3)]
    append(cache, history, chunk(gen, 3, 4), [4, 2, 3])
    append(cache, history, chunk(gen, 3, 2), [2, 2, 1])  # re-homed with headroom
    buffer, width = cache.layers[0]._kbuf, cache.valid.shape[1]
    rooms = cache.rooms(3)
    for (k, v), (ck, cv) in zip(rooms, cache.kv):
        assert k.shape[2] == width + 3 and k.data_ptr() == ck.data_ptr() and v.data_ptr() == cv.data_ptr()
        assert torch.equal(k[:, :, :width], ck) and torch.equal(v[:, :, :width], cv)  # the context, in place
        k[:, :, width:] = 7.0  # a draft pass writes its block's keys there
        v[:, :, width:] = 7.0
    assert cache.layers[0]._kbuf is buffer and cache.valid.shape[1] == width  # not copied, not kept
    check(cache, history)
    append(cache, history, chunk(gen, 3, 3), [3, 1, 2])  # the next append writes over the scratch
    check(cache, history)
    part = cache.subset([2, 0])  # a subset holds copies: its room is its own, the cache stays as it was
    before = [(k.clone(), v.clone()) for k, v in cache.kv]
    for k, v in part.rooms(2):
        k[:, :, -2:] = -1.0
    for (k, v), (k0, v0) in zip(cache.kv, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
