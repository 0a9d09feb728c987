"""Admission: what a request is promised, and whether the shared frame pool can promise it.

A request is admitted only when both cache groups can honour what it may need, counted in frames
of the one shared pool (`pages.FramePool`):

* full group: `pages_for(full, prompt + max_new_tokens)` -- every position it may ever write
  (reserved now, leased lazily as positions reach the pages);
* sliding group: at most `geometry.sliding_pages_per_request(chunk)` resident pages (the window's
  W-1 old positions plus the largest chunk it computes in one step, +1 for a window that does not
  start on a page boundary), and never more than its whole length needs.

The chunk size is therefore a *capacity* parameter: every admitted request is charged sliding pages
for its largest chunk. Because the sum of promises never exceeds the pool, a lease inside a promise
cannot fail and no request is ever preempted. A request whose promise exceeds the whole pool is
refused at once (`RequestTooLarge`); one that merely does not fit now waits in the queue.
"""
from __future__ import annotations

from dataclasses import dataclass

from g4rt.models.layout import PageGeometry


class RequestTooLarge(ValueError):
    """The request could not run even alone in an empty pool."""


@dataclass(frozen=True)
class Promise:
    full_pages: int
    sliding_pages: int

    @property
    def frames(self) -> int:
        return self.full_pages + self.sliding_pages


def promise_for(geometry: PageGeometry, prompt_len: int, max_new_tokens: int, chunk: int) -> Promise:
    """Frames one request may hold at once (see the module docstring for why each term)."""
    layout = geometry.layout
    total = prompt_len + max_new_tokens
    full = geometry.pages_for("full", total) if layout.full.layers else 0
    sliding = 0
    if layout.sliding.layers:
        largest_chunk = max(1, min(chunk, prompt_len))
        sliding = min(geometry.pages_for("sliding", total), geometry.sliding_pages_per_request(largest_chunk))
    return Promise(full, sliding)


def check_fits(promise: Promise, num_frames: int, prompt_len: int, max_new_tokens: int, chunk: int) -> None:
    """Raise `RequestTooLarge` naming the numbers when `promise` exceeds the whole pool."""
    if promise.frames > num_frames:
        raise RequestTooLarge(
            f"request needs {promise.frames} frames ({promise.full_pages} full-attention pages for "
            f"prompt {prompt_len} + max_new_tokens {max_new_tokens}, {promise.sliding_pages} sliding pages "
            f"for chunk {chunk}) but the pool has only {num_frames} frames in all; "
            f"shorten the prompt or max_new_tokens, or give the arena more memory")
