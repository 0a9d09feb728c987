"""Rank builders that fail on purpose, for tests/test_parallel.py. A spawned rank imports this module
by name (the test's sys.path travels with it), so it holds only importable top-level functions."""
from __future__ import annotations

import time

from g4rt.runtime.engines.parallel import build_rank_engine


def fail_loading_on_rank1(spec, rank):
    if rank == 1:
        raise RuntimeError("injected load failure on rank 1")
    return build_rank_engine(spec, rank)


def hang_loading_on_rank1(spec, rank):
    if rank == 1:
        time.sleep(600)
    return build_rank_engine(spec, rank)


class FailAtStep:
    """An engine whose `fail_at`-th step raises (its first steps run normally)."""

    def __init__(self, engine, fail_at: int, rank: int):
        self.engine, self.fail_at, self.rank, self.steps = engine, fail_at, rank, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, batch, seq_ids=(), feed=None):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError(f"injected step failure on rank {self.rank}")
        return self.engine.step(batch, seq_ids, feed)


def fail_step3_on_rank1(spec, rank):
    engine = build_rank_engine(spec, rank)
    return FailAtStep(engine, 3, rank) if rank == 1 else engine


def fail_step3_on_rank0(spec, rank):
    engine = build_rank_engine(spec, rank)
    return FailAtStep(engine, 3, rank) if rank == 0 else engine
