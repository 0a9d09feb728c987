"""PagedStep (the step graph over the paged arena) vs the linear reference cache: bitwise-equal logits.

Sequences are prefilled in chunks and decoded together in one varlen batch; pages come from a
shuffled pool, sliding pages behind the window are returned and reused, and the arena starts as NaN
so any read of a slot that was never written poisons the result. The tiny config covers KV-shared
layers (which read their source's offsets), k_eq_v, both page sizes and both head dims."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from g4rt.models.checkpoint import load_model, write_random_checkpoint
from g4rt.models.config import load_config
from g4rt.models.layout import PageGeometry, torch_dtype
from g4rt.models.linear_cache import LinearCache
from g4rt.models.paged import PagedStep
from g4rt.models.step import StepBatch
from g4rt.models.tiny import TINY_CONFIG

PAGE = 4


class Pages:
    """Just enough page management for the test: per sequence, logical page -> frame per group."""

    def __init__(self, geo: PageGeometry, num_frames: int, seed: int):
        self.geo, self.window = geo, geo.layout.sliding.window
        self.free = list(range(num_frames))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[tuple, dict[int, int]] = {}

    def _lease(self, sid, group, first, last):
        table = self.tables.setdefault((sid, group), {})
        for page in [p for p in table if p < first]:  # behind the window: back to the pool
            self.free.append(table.pop(page))
        for page in range(first, last + 1):
            if page not in table:
                table[page] = self.free.pop(0)
        return table

    def batch(self, seqs: list[tuple[int, list[int], int]]) -> StepBatch:
        """seqs: (seq_id, token ids, first position) -> the StepBatch of one step."""
        cols = {k: [] for k in ("tok", "pos", "cu", "kv", "s_first", "s_slots", "f_slots", "rows")}
        s_rows, f_rows, cols["cu"] = [], [], [0]
        for sid, toks, p0 in seqs:
            kv = p0 + len(toks)
            for group, first_pos, slots, rows in (("sliding", max(0, p0 - (self.window - 1)), "s_slots", s_rows),
                                                  ("full", 0, "f_slots", f_rows)):
                size = self.geo.page_tokens[group]
                first = first_pos // size
                table = self._lease(sid, group, first, (kv - 1) // size)
                rows.append([table[p] for p in range(first, (kv - 1) // size + 1)])
                cols[slots] += [table[p // size] * size + p % size for p in range(p0, kv)]
                if group == "sliding":
                    cols["s_first"].append(first)
            cols["tok"] += toks
            cols["pos"] += list(range(p0, kv))
            cols["kv"].append(kv)
            cols["cu"].append(cols["cu"][-1] + len(toks))
            cols["rows"].append(cols["cu"][-1] - 1)

        def table(rows):
            width = max(map(len, rows))
            return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)

        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        return StepBatch(i32(cols["tok"]), i32(cols["pos"]), i32(cols["cu"]), i32(cols["kv"]), table(s_rows),
                         i32(cols["s_first"]), i32(cols["s_slots"]), table(f_rows), i32(cols["f_slots"]),
                         i32(cols["rows"]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal arenas, byte for byte (NaN slots never written included; any KV dtype)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dataclasses.replace(load_config(TINY_CONFIG), dtype="float32")
    return write_random_checkpoint(cfg, tmp_path_factory.mktemp("paged"), seed=9, dtype="float32")


@torch.no_grad()
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_paged_step_equals_linear_cache(checkpoint, kv_dtype):
    """Also with a 1-byte KV arena under fp32 weights: the linear cache stores its rows as the arena does."""
    model = load_model(checkpoint, kv_dtype=kv_dtype)
    geo = PageGeometry.build(model.layout, page_tokens=PAGE)
    assert geo.page_tokens["full"] != geo.page_tokens["sliding"]  # both page sizes are exercised
    pages = Pages(geo, num_frames=40, seed=5)
    kv = torch_dtype(model.layout.dtype, kv=True)
    assert kv == (torch.float32 if kv_dtype is None else torch.float8_e4m3fn)
    arena = torch.full((40, geo.frame_elems), float("nan"), dtype=kv)
    paged, functional = PagedStep(model, geo), PagedStep(model, geo, functional=True)
    linear = LinearCache(kv)
    arena_into = arena.clone()  # the same steps through attention_into (the piecewise graphs' callback)
    g = torch.Generator().manual_seed(0)
    prompt = {sid: torch.randint(3, 512, (n,), generator=g).tolist() for sid, n in ((0, 16), (1, 6), (2, 9))}
    # (seq, how many tokens) per step: chunked prefill, a late joiner, then decode together.
    plan = [[(0, 11), (1, 6)], [(0, 5), (1, 1), (2, 9)]] + [[(0, 1), (1, 1), (2, 1)]] * 10
    pos, pending, checked = {0: 0, 1: 0, 2: 0}, dict(prompt), 0
    for step in plan:
        seqs = []
        for sid, n in step:
            toks, pending[sid] = pending[sid][:n], pending[sid][n:]
            seqs.append((sid, toks, pos[sid]))
        batch = pages.batch(seqs)

        linear.begin_step([s for s, _, _ in seqs], [len(t) for _, t, _ in seqs])
        ref = model.logits(model(batch.token_ids, batch.positions, linear)[batch.logits_rows.long()])
        before = arena.clone()
        fl, new_arena = functional(arena, *batch.tensors())
        assert same_bits(arena, before), "functional mode mutated its input"
        out = paged(arena, *batch.tensors())
        assert torch.equal(out, ref), f"paged logits differ from linear at step {checked}"
        assert torch.equal(fl, out)
        assert same_bits(new_arena, arena)
        assert not out.isnan().any()
        attend = paged.attention_into(arena_into, *batch.tensors()[2:-1])

        def into(layer, q, k, v):
            o = torch.full_like(q, float("nan"))  # poisoned: every row must be written
            assert attend(layer, q, k, v, o) is o
            return o
        hidden = model(batch.token_ids, batch.positions, into)
        assert torch.equal(model.logits(hidden[batch.logits_rows.long()]), out)
        assert same_bits(arena_into, arena)
        checked += 1
        for (sid, toks, p0), nxt in zip(seqs, out.argmax(-1).tolist()):
            pos[sid] = p0 + len(toks)
            if not pending[sid]:
                pending[sid] = [nxt]
    with pytest.raises(ValueError, match="functional"):
        functional.attention_into(arena, *batch.tensors()[2:-1])
    assert max(pos.values()) > 3 * geo.layout.sliding.window  # several windows: sliding pages were recycled
