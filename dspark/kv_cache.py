"""A KV cache whose layers grow in place: appends write into spare capacity instead of copying the cache.

Hugging Face's `DynamicLayer` concatenates every pass's keys and values onto the cache, so each decoding step
copies the whole cache of every layer (rows × slots × KV width): at 64 rows of 200 slots on a small model
that is tens of MB per step, a cost that grows with the slots a pass spans. `HeadroomLayer` keeps its
keys and values as prefix views of larger buffers and writes a pass's new slots after them; only when the
buffer is full (or the batch's rows were re-indexed, compacted or joined, which make new tensors anyway) is
it re-homed into a buffer with room for `max(64, half)` more slots.

Rows have headroom too: the buffers hold `max(4, rows // 4)` spare rows, so requests joining the batch are
written after the running rows (`extend_rows`) and rows leaving it are filled by rows moved from the end
(`select_rows` with an index that keeps every row in place or takes it from past the new end): neither copies
the rows that stay, where a re-homing join or selection copies the whole cache of every layer.

`CausalLM` manipulates the layers' `keys` / `values` directly (row selection, compaction, joins, dropping
trailing slots); any of those either keeps a prefix view (fewer rows, slicing off trailing slots) or makes a new
tensor, which the next `update` notices and re-homes. Rows and slots past a view's end are free to overwrite:
nothing else holds views of them.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

MIN_HEADROOM = 64  # slots added beyond what a re-homed layer needs, at least
MIN_ROW_HEADROOM = 4  # spare rows beyond what a re-homed layer holds, at least (a quarter of its rows when more)


def _row_capacity(rows: int) -> int:
    return rows + max(MIN_ROW_HEADROOM, rows // 4) if rows else 0  # an empty batch holds no memory


def _prefix_of(view: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """Whether `view` is buffer[:m, :, :n] for some m, n (same storage start, same strides and heads)."""
    return (buffer is not None and view.dim() == 4 and view.data_ptr() == buffer.data_ptr()
            and view.shape[0] <= buffer.shape[0] and view.shape[1] == buffer.shape[1]
            and view.shape[3] == buffer.shape[3] and view.stride() == buffer.stride())


class HeadroomLayer(DynamicLayer):
    """A `DynamicLayer` that appends in place into spare capacity (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor) -> "HeadroomLayer":
        """A layer holding these tensors as they are: not views of its buffers, so the first append or row edit
        re-homes them into buffers of its own and never writes into the tensors given."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _rehome(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        capacity = need + max(MIN_HEADROOM, need // 2)
        rows, heads, dim_k, dim_v = like_k.shape[0], like_k.shape[1], like_k.shape[3], like_v.shape[3]
        kbuf = like_k.new_empty(_row_capacity(rows), heads, capacity, dim_k)
        vbuf = like_v.new_empty(_row_capacity(rows), like_v.shape[1], capacity, dim_v)
        if length:
            kbuf[:rows, :, :length] = self.keys
            vbuf[:rows, :, :length] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[:rows, :, :length], vbuf[:rows, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's keys / values after the cached ones; return views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        need = length + key_states.shape[-2]
        rows = key_states.shape[0]
        fits = self._holds_views() and need <= self._kbuf.shape[-2] and self.keys.shape[0] == rows
        if not fits:
            self._rehome(need, key_states, value_states)
        self._kbuf[:rows, :, length:need] = key_states
        self._vbuf[:rows, :, length:need] = value_states
        self.keys, self.values = self._kbuf[:rows, :, :need], self._vbuf[:rows, :, :need]
        return self.keys, self.values

    def with_room(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [R, KV, T + extra, hd] of the cached keys / values followed by `extra` scratch slots, for a pass
        to write its own keys and values into and attend over without copying the cache (`torch.cat` would). The
        cache's length stays T: the next `update` writes over the scratch slots."""
        length = self.keys.shape[-2]
        rows, need = self.keys.shape[0], length + extra
        if not (self._holds_views() and need <= self._kbuf.shape[-2]):
            self._rehome(need, self.keys, self.values)
        return self._kbuf[:rows, :, :need], self._vbuf[:rows, :, :need]

    def _holds_views(self) -> bool:
        """Whether keys / values are still prefix views of this layer's buffers."""
        return _prefix_of(self.keys, self._kbuf) and _prefix_of(self.values, self._vbuf)

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None

    # ---------------------------------------------------------------- batch edits that write into a new buffer
    def _fresh(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys, self.values
        capacity = width + max(MIN_HEADROOM, width // 2)
        self._kbuf = k.new_empty(_row_capacity(rows), k.shape[1], capacity, k.shape[3])
        self._vbuf = v.new_empty(_row_capacity(rows), v.shape[1], capacity, v.shape[3])
        return self._kbuf[:rows, :, :width], self._vbuf[:rows, :, :width]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (in that order). In place when every kept row either stays where it is or comes
        from past the new end (rows leaving, filled from the end: only the moved rows are copied); otherwise
        copied once into a buffer with room to grow."""
        if self.keys is None or self.keys.dim() != 4:
            return
        rows, width = len(index), self.keys.shape[2]
        picks = index.tolist()
        # in place unless the batch shrank to under half its buffer's rows (then the copy gives memory back)
        if (self._holds_views() and 2 * rows >= self._kbuf.shape[0]
                and all(i == j or i >= rows for j, i in enumerate(picks))):
            moved = [(j, i) for j, i in enumerate(picks) if i != j]
            if moved:  # destinations and sources are disjoint rows of the buffer
                dst = torch.tensor([j for j, _ in moved], device=index.device)
                src = torch.tensor([i for _, i in moved], device=index.device)
                self._kbuf[dst, :, :width] = self._kbuf[src, :, :width]
                self._vbuf[dst, :, :width] = self._vbuf[src, :, :width]
            self.keys, self.values = self._kbuf[:rows, :, :width], self._vbuf[:rows, :, :width]
            return
        keys, values = self._fresh(rows, width)
        torch.index_select(self.keys, 0, index, out=keys)
        torch.index_select(self.values, 0, index, out=values)
        self.keys, self.values = keys, values

    def gather_slots(self, order: torch.Tensor) -> None:
        """Keep slots order[r] of each row r ([rows, width] slot indices), copied once into a new buffer."""
        if self.keys is None or self.keys.dim() != 4:
            return
        rows, width = order.shape
        k_src, v_src = self.keys, self.values
        keys, values = self._fresh(rows, width)
        torch.gather(k_src, 2, order.view(rows, 1, width, 1).expand(-1, k_src.shape[1], -1, k_src.shape[3]), out=keys)
        torch.gather(v_src, 2, order.view(rows, 1, width, 1).expand(-1, v_src.shape[1], -1, v_src.shape[3]), out=values)
        self.keys, self.values = keys, values

    def stack_rows(self, parts: list[tuple[torch.Tensor | None, torch.Tensor | None, int]], width: int,
                   right: bool = False) -> None:
        """Become the rows of `parts` one after another ([(keys, values, rows)], keys None for rows that never
        ran a pass), each padded with zero slots to `width` (right: every part after the first padded on the
        left, its slots ending at `width`); copied once into a buffer with room to grow."""
        like_k = next(k for k, _, _ in parts if k is not None)
        like_v = next(v for _, v, _ in parts if v is not None)
        if self.keys is None or self.keys.dim() != 4:
            self.keys, self.values = like_k, like_v
        keys, values = self._fresh(sum(n for _, _, n in parts), width)
        start = 0
        for i, (k, v, n) in enumerate(parts):
            used = 0 if k is None else k.shape[2]
            lo = width - used if right and i else 0
            for buf, src in ((keys, k), (values, v)):
                rows = buf[start : start + n]
                rows[:, :, :lo] = 0  # padding slots are masked; zeros keep them finite
                rows[:, :, lo + used :] = 0
                if src is not None:
                    rows[:, :, lo : lo + used] = src
            start += n
        self.keys, self.values = keys, values
        if not self.is_initialized:
            self.is_initialized = True
            self.device = like_k.device

    def extend_rows(self, keys: torch.Tensor | None, values: torch.Tensor | None, rows: int, width: int,
                    right: bool = False) -> None:
        """Append `rows` rows (their keys / values, None for rows that never ran a pass) after this layer's rows,
        every row padded with zero slots to `width` (right: the new rows padded on the left, their slots ending
        at `width`; this layer's rows are padded on the right either way). In place when the buffers have the
        spare rows and slots (only the new rows and the widened slots are written); otherwise re-homed with
        `stack_rows`."""
        if self.keys is None or self.keys.dim() != 4:
            raise ValueError("extend_rows needs a layer that has run a pass")
        mine, have = self.keys.shape[0], self.keys.shape[2]
        if not (self._holds_views() and mine + rows <= self._kbuf.shape[0] and have <= width <= self._kbuf.shape[2]):
            self.stack_rows([(self.keys, self.values, mine), (keys, values, rows)], width, right=right)
            return
        for buf in (self._kbuf, self._vbuf):
            buf[:mine, :, have:width] = 0  # padding slots are masked; zeros keep them finite
        used = 0 if keys is None else keys.shape[2]
        lo = width - used if right else 0
        for buf, src in ((self._kbuf, keys), (self._vbuf, values)):
            new = buf[mine : mine + rows]
            new[:, :, :lo] = 0  # padding slots are masked; zeros keep them finite
            new[:, :, lo + used : width] = 0
            if src is not None:
                new[:, :, lo : lo + used] = src
        total = mine + rows
        self.keys, self.values = self._kbuf[:total, :, :width], self._vbuf[:total, :, :width]


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers append in place (sliding-window layers, which
    crop themselves, stay Hugging Face's)."""
    cache = DynamicCache(config=config)
    cache.layers = [HeadroomLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
