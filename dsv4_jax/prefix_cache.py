"""The prefix cache: a conversation is prefilled once.

A DeepSeek-V4 sequence's whole state at position p is one row of a DecodeState: the compressed entries before p,
the window ring of the last 128 tokens, the compressors' pending tokens, the MTP block's window and streams, the
position. Any part but the compressed entries is overwritten by later tokens, so a prefix cannot be shared in
blocks the way plain attention's KV can; but the row itself can be kept. The cache keeps such rows, each a snapshot
of a sequence after it consumed exactly the tokens of its key, in a device pool (a DecodeState of `slots` rows, made
on first use), and a new prompt continues from the longest key that prefixes it: its row is copied into the
request's state (`state.copy_row`, a `dynamic_update_slice` on the device; no host round trip) and only the rest of
the prompt is prefilled. The result is the state prefilling the whole prompt gives, up to the chunked prefill's
float rounding (tests/test_prefix_cache.py checks every kind of boundary).

What is kept (Model.prefill_prompts: Model.generate and the server): every prompt but its last token, and the end
of every completion the device finished itself (the tokens its state consumed: the prompt and all but the last
generated token; Model.generate and the server's scheduler keep them, not those a stop string ended on the host).
The last token is always prefilled (its logits give the first sampled token), and a chat's next prompt extends its
last prompt but that last token: the official encoder ends a thinking-mode prompt with <think> and renders the
same turn in the history as </think> and the reply (in chat mode the next prompt extends the whole last prompt, and
one token more is prefilled than strictly needed). So a conversation's every turn continues from the previous
turn's prompt, and a prompt sent again prefills one token.

Memory: `max_bytes` of rows (each one sequence of max_seq_len capacity: Model.state_bytes(1)), least recently used
evicted first. A snapshot is copied out when a request starts, so no running request depends on the pool and any
entry may be evicted at any time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import numpy as np

from .state import DecodeState, copy_row


@dataclasses.dataclass
class Entry:
    slot: int                      # its row in the pool
    track_mtp: bool                # whether the MTP block's window was kept current (speculative decoding needs it)


@functools.partial(jax.jit, donate_argnames=("dst",))
def _copy_row(dst: DecodeState, src: DecodeState, src_row, dst_row) -> DecodeState:
    return copy_row(dst, src, src_row, dst_row)


def _index(i: int) -> jax.Array:
    """A row index as a device scalar, sent explicitly (no implicit transfer: callers may run under
    jax.transfer_guard("disallow"))."""
    return jax.device_put(np.int32(i))


class PrefixCache:
    """Snapshots of decode-state rows keyed by the token ids they consumed (tuples), least recently used first out.
    `make_pool(rows)` makes an empty DecodeState of that many rows (the model's layout); `row_bytes` is one row's
    size."""

    def __init__(self, max_bytes: int, row_bytes: int, make_pool):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix cache size must be a number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.row_bytes = row_bytes
        self.slots = max_bytes // row_bytes
        self._make_pool = make_pool
        self._pool: DecodeState | None = None
        self._entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        self._free = list(range(self.slots))
        self.hits = self.misses = self.cached_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    def lookup(self, tokens, track_mtp: bool = False) -> tuple[Entry | None, int]:
        """The entry whose key is the longest prefix of `tokens` shorter than them (at least the last token is
        prefilled; a request that tracks the MTP window only from entries that did), and its length (0: none).
        Counts a hit or a miss."""
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) < 2:                  # nothing shorter to continue from (e.g. a batch's padding rows)
            return None, 0
        best, best_len = None, 0
        for key, entry in self._entries.items():
            n = len(key)
            if n <= best_len or n >= len(tokens):
                continue
            if track_mtp and not entry.track_mtp:
                continue
            if tokens[:n] == key:
                best, best_len = key, n
        if best is None:
            self.misses += 1
            return None, 0
        self._entries.move_to_end(best)
        self.hits += 1
        self.cached_tokens += best_len
        return self._entries[best], best_len

    def restore(self, entry: Entry, state: DecodeState, row: int) -> DecodeState:
        """`state` (donated) with row `row` replaced by the entry's snapshot."""
        return _copy_row(state, self._pool, _index(entry.slot), _index(row))

    def save(self, tokens, state: DecodeState, row: int, track_mtp: bool) -> None:
        """Keep row `row` of `state` (not donated), which consumed exactly `tokens`. An existing entry of the same
        key is kept (refreshed), unless this one also kept the MTP window and it did not."""
        if not self.enabled or not len(tokens):
            return
        key = tuple(int(t) for t in tokens)
        entry = self._entries.get(key)
        if entry is not None and (entry.track_mtp or not track_mtp):
            self._entries.move_to_end(key)
            return
        if entry is not None:                          # replaced by one that also kept the MTP window
            self._free.append(self._entries.pop(key).slot)
        if not self._free:
            _, evicted = self._entries.popitem(last=False)
            self._free.append(evicted.slot)
        if self._pool is None:
            self._pool = self._make_pool(self.slots)
        slot = self._free.pop()
        self._pool = _copy_row(self._pool, state, _index(row), _index(slot))
        self._entries[key] = Entry(slot, track_mtp)

    def clear(self) -> None:
        self._entries.clear()
        self._free = list(range(self.slots))

    def info(self) -> dict:
        """What /health shows: entries, the bytes the pool holds (allocated on first use), hits, misses and the
        prompt tokens served from the cache."""
        return {"entries": len(self._entries), "slots": self.slots, "max_bytes": self.max_bytes,
                "bytes": self.slots * self.row_bytes if self._pool is not None else 0,
                "hits": self.hits, "misses": self.misses, "cached_tokens": self.cached_tokens}
