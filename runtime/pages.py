"""The block pool: frames of the arena, leased page by page to both cache groups.

Pool topology (decided here; numbers from models/layout.py):

* **One pool of equal frames shared by both groups.** A frame holds one page of either group
  (`PageGeometry`), so a frame the sliding group returns can be leased next step by the full group of
  another request: memory moves between the groups as the workload moves between short and long
  contexts. Each request holds two page tables (one per group) with different lifetimes: the full
  group keeps every page until the request ends, the sliding group keeps only its trailing pages.

Simpler options and the failure mode that rules each out:

* *One block table for both groups* (one assignment list per request, a block held or released for
  both groups at once): the sliding group can then only drop a page when the full group does, i.e.
  never before the request ends, so sliding layers hold every position. Gemma 4 31B at 262,144
  positions needs 220 GiB per request that way, against ~21 GiB when the sliding group keeps only
  its window: the declared context is unreachable on any single device.
* *Two statically split pools* (SGLang's `swa_full_tokens_ratio`, TRT-LLM's pool ratio): the split
  is right for one workload only. When traffic shifts to long contexts the full pool runs dry and
  requests wait while the sliding pool sits idle (and the reverse for many short requests); the
  ratio has to be tuned per workload and still starves one side structurally.
* *Per-stream rings* (a fixed window of slots per batch slot): every stream slot reserves a whole
  window whether its request is 10 tokens or 100,000, the reservation exists even when the slot is
  idle, and one stream's unused ring cannot be lent to another. Capacity is `slots × window`
  regardless of use.

Correctness rules kept here, not in the scheduler:

* A frame is never handed out twice (`FramePool` tracks what is leased and refuses double frees).
* A request never holds more frames than it was promised at admission (`RequestPages` checks every
  lease against its reservation), and the pool never promises more frames than it has, so a lease
  inside a promise cannot fail.
* Writing a position whose page is not leased (past the request's pages, or below the sliding
  group's resident window) raises `PastPagesError` instead of producing a slot.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from g4rt.models.layout import PageGeometry


class PoolError(RuntimeError):
    """The allocator's bookkeeping was violated (double free, over-promise): a runtime bug."""


class PastPagesError(IndexError):
    """A step would read or write a position the request holds no page for."""


class FramePool:
    """Free list of arena frame ids, shared by both cache groups, plus the reservation ledger.

    `reserve`/`unreserve` count frames promised to admitted requests; the pool refuses a promise it
    could not keep. `shuffle_seed` hands frames out in a seeded random order (tests use it so that
    later requests land on frames earlier ones returned, in no particular order).
    """

    def __init__(self, num_frames: int, shuffle_seed: int | None = None):
        if num_frames <= 0:
            raise ValueError(f"num_frames must be positive, got {num_frames}")
        self.num_frames = num_frames
        self._rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
        self._free = list(range(num_frames - 1, -1, -1))  # pop() hands out frame 0 first
        self._leased: set[int] = set()
        self.reserved = 0

    # ---- frames ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_leased(self) -> int:
        return len(self._leased)

    def take(self) -> int:
        if not self._free:
            raise PoolError("frame pool exhausted: a lease outside its reservation")
        i = self._rng.randrange(len(self._free)) if self._rng else len(self._free) - 1
        self._free[i], self._free[-1] = self._free[-1], self._free[i]
        frame = self._free.pop()
        self._leased.add(frame)
        return frame

    def give(self, frame: int) -> None:
        if frame not in self._leased:
            raise PoolError(f"frame {frame} returned but not leased (double free?)")
        self._leased.remove(frame)
        self._free.append(frame)

    def free_frames(self) -> list[int]:
        return list(self._free)

    # ---- promises ----------------------------------------------------------------------------
    @property
    def unreserved(self) -> int:
        return self.num_frames - self.reserved

    def can_reserve(self, n: int) -> bool:
        return n <= self.unreserved

    def reserve(self, n: int) -> None:
        if not self.can_reserve(n):
            raise PoolError(f"cannot promise {n} frames: {self.unreserved} of {self.num_frames} unpromised")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        if n > self.reserved:
            raise PoolError(f"unreserving {n} frames but only {self.reserved} promised")
        self.reserved -= n


@dataclass
class PageTable:
    """One request's pages in one group: `frames[j]` holds logical page `first_page + j`."""

    page_tokens: int
    frames: list[int] = field(default_factory=list)
    first_page: int = 0

    @property
    def end_page(self) -> int:
        """One past the last leased logical page."""
        return self.first_page + len(self.frames)

    def slot(self, position: int) -> int:
        page, offset = divmod(position, self.page_tokens)
        if not self.first_page <= page < self.end_page:
            raise PastPagesError(
                f"position {position} is on page {page}, but the request holds pages "
                f"[{self.first_page}, {self.end_page}) of {self.page_tokens} positions")
        return self.frames[page - self.first_page] * self.page_tokens + offset

    def slots(self, positions: range) -> list[int]:
        """`slot(p)` for a run of consecutive positions, a page at a time (a prefill chunk's 8k
        positions cost 8k Python calls otherwise: milliseconds before its step can launch)."""
        if positions.step != 1:
            raise ValueError(f"slots takes consecutive positions, got a range of step {positions.step}")
        if not positions:
            return []
        self.slot(positions.stop - 1)  # both ends held: so is every page between them
        out, p, size = [], positions.start, self.page_tokens
        while p < positions.stop:
            base = self.slot(p)
            n = min(size - p % size, positions.stop - p)
            out.extend(range(base, base + n))
            p += n
        return out


class _Group:
    """Leases one group's pages from the shared pool. Subclasses decide what stays resident."""

    name = ""

    def __init__(self, geometry: PageGeometry, pool: FramePool):
        self.pool = pool
        self.page_tokens = geometry.page_tokens[self.name]
        self.active = bool(getattr(geometry.layout, self.name).layers)

    def new_table(self) -> PageTable:
        return PageTable(self.page_tokens)

    def lease_to(self, table: PageTable, end_position: int, budget: "RequestPages") -> None:
        """Lease pages so positions `< end_position` are covered."""
        if not self.active:
            return
        need = -(-end_position // self.page_tokens)
        while table.end_page < need:
            budget.charge(1)
            table.frames.append(self.pool.take())

    def trim(self, table: PageTable, next_position: int, budget: "RequestPages") -> None:
        """Return pages the next step (first query at `next_position`) can no longer read."""

    def release(self, table: PageTable, budget: "RequestPages") -> None:
        for frame in table.frames:
            self.pool.give(frame)
        budget.refund(len(table.frames))
        table.first_page = table.end_page
        table.frames.clear()


class FullGroup(_Group):
    """Full attention: every position stays readable for the request's life."""

    name = "full"


class SlidingGroup(_Group):
    """Sliding attention (window W keys counting the current one): only trailing pages stay."""

    name = "sliding"

    def __init__(self, geometry: PageGeometry, pool: FramePool):
        super().__init__(geometry, pool)
        self.window = geometry.layout.sliding.window

    def trim(self, table: PageTable, next_position: int, budget: "RequestPages") -> None:
        # The next step's first query at p0 sees keys >= p0 - W + 1; a page ending at or below that
        # can never be read again (later queries see even later keys).
        oldest_needed = max(0, next_position - self.window + 1)
        keep_from = oldest_needed // self.page_tokens
        while table.frames and table.first_page < keep_from:
            self.pool.give(table.frames.pop(0))
            budget.refund(1)
            table.first_page += 1
        if not table.frames:
            table.first_page = max(table.first_page, keep_from)


class RequestPages:
    """Both groups' page tables of one request, and the frames it was promised.

    `held` never exceeds `promised`; `release()` returns every frame and the promise at once, and
    is safe to call twice (finish after cancel, failure after finish).
    """

    def __init__(self, geometry: PageGeometry, pool: FramePool, promised: int,
                 groups: tuple[SlidingGroup, FullGroup] | None = None):
        self.pool = pool
        self.sliding_group, self.full_group = groups or (SlidingGroup(geometry, pool), FullGroup(geometry, pool))
        self.sliding = self.sliding_group.new_table()
        self.full = self.full_group.new_table()
        pool.reserve(promised)
        self.promised = promised
        self.held = 0
        self.peak_sliding = 0
        self.released = False

    def charge(self, n: int) -> None:
        if self.held + n > self.promised:
            raise PoolError(f"request would hold {self.held + n} frames but was promised {self.promised}")
        self.held += n

    def refund(self, n: int) -> None:
        self.held -= n

    def prepare(self, start: int, count: int) -> None:
        """Make positions [start, start+count) writable and everything the step reads resident."""
        if self.released:
            raise PastPagesError("request's pages were already released")
        self.sliding_group.trim(self.sliding, start, self)
        self.sliding_group.lease_to(self.sliding, start + count, self)
        self.full_group.lease_to(self.full, start + count, self)
        self.peak_sliding = max(self.peak_sliding, len(self.sliding.frames))

    def trim(self, next_position: int) -> None:
        """After a step: give back sliding pages the next step cannot read (eager, so other
        requests can lease them in the same scheduling round)."""
        self.sliding_group.trim(self.sliding, next_position, self)

    def slots(self, group: str, positions: range) -> list[int]:
        gm = self.sliding_group if group == "sliding" else self.full_group
        if not gm.active:
            return [-1] * len(positions)
        return (self.sliding if group == "sliding" else self.full).slots(positions)

    def release(self) -> None:
        if self.released:
            return
        self.sliding_group.release(self.sliding, self)
        self.full_group.release(self.full, self)
        self.pool.unreserve(self.promised)
        self.released = True
