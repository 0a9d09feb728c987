"""Triton sampler: one program per row (for few rows a row's first passes cut over several programs), a
few passes over the logits, no noise tensor, no sort.

`sample(logits, rows)` is `reference.sample_ref` (plugins/README.md `sample`):

* greedy rows (temperature 0): one pass, the first argmax;
* every sampled row, pass 1: the row's top score and, without top-k, the Gumbel race over the whole row,
  its noise made in registers from Philox (`tl.randint4x`, key = the request's seed, counter = (id // 4,
  draw counter)), so a token depends on its own row, seed and counter only; rows without top-k or
  top-p are done;
* top-k, by a pivot and one gathering pass: the first pass also keeps the maxima of groups of its lanes;
  the k-th largest of those maxima over the whole row is a score at least k entries reach (each of those
  groups holds one); the pivot is the lowest score of its cut key's bin of `PIVOT_DIGITS` leading digits
  (two histograms, not four, for a few more entries), so the entries at or above it hold the top k, and
  with the row's groups well above k they are only a few more than k (`PIVOT_GROUPS`). One pass gathers
  them (`_gather_kernel`); the row's program then finds the k-th smallest cut key among them by a radix
  select in registers (`DIGITS` digits, a histogram each; counts are integers, so the cut is exact),
  races the kept ones and runs any top-p rounds over them, all without reading the row again. A row
  whose gathered entries would not fit `CANDIDATES` (a k of about a thousand or more, or many keys tied at
  the pivot) runs the same select over its gathered list in memory (`LISTED` ids), a digit a
  pass, then the race and the rounds a pass each. A row the gathering pass leaves without a list (its k
  above the groups' count: no pivot; or its entries overflow the list) lists its own: the bin of the
  `PIVOT_DIGITS` leading digits that holds its k-th key by a histogram pass a digit over its row, and, where
  those histograms count at most LISTED entries up to that bin's end, one more pass listing them (3 passes
  over the row where the cut and race took 5, and every top-p round one more); else (a saturated k-th key,
  or more than LISTED entries within a sixteenth of a score unit of it) its cut goes on from those digits,
  and it races and runs its rounds, over its whole row;
* top-p, by rejection instead of a sort: the race winner j over a candidate set that holds the nucleus
  is in the nucleus iff the integer mass of the entries likelier than j is < top_p x the kept mass; if
  it is, j is the argmax over the nucleus too (the nucleus is a subset), else the nucleus lies within
  the entries likelier than j, which become the next candidates. Each round is one pass (the test of j
  and the race for the next candidate together); a round succeeds with probability about top_p or more
  (the nucleus's share of the candidates) and the candidates shrink every round, so it ends, after at
  most about 1 / top_p rounds on average (1.1 at top_p 0.9).

Every pass keeps its state per lane (running maxima, race winners, masses, counts) and reduces once at
its end. With few rows (`first_pass_splits`) the first pass, the top-k gathering pass and the first
`SPLIT_ROUNDS` top-p rounds of rows without top-k run over chunks of the row in one program each
(`_first_pass_kernel`, `_gather_kernel`, `_round_kernel`); each program and the row's program after them
combine the chunks' results (maxima, sums, the earliest chunk among equal race values, so the token is
the same however the row is cut; the gathered entries' order does not matter), and the row's program
runs any top-p rounds past those alone. Launches read shapes only (no `.item()`), so they can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import SAMPLE_KEY_MAX, SAMPLE_KEY_SCALE, SAMPLE_MASS_SCALE
from .launch import sm_count


SCALE_KEY = tl.constexpr(float(SAMPLE_KEY_SCALE))
KEY_MAX = tl.constexpr(SAMPLE_KEY_MAX)
SCALE_MASS = tl.constexpr(float(SAMPLE_MASS_SCALE))
DIGIT_BITS = tl.constexpr(6)  # the top-k cut's radix: a histogram a digit of this many bits of the 24-bit keys
DIGITS = tl.constexpr(4)
BINS = tl.constexpr(1 << DIGIT_BITS.value)
assert SAMPLE_KEY_MAX == (1 << DIGIT_BITS.value * DIGITS.value) - 1
# Group maxima a row's first pass keeps for the top-k pivot (over all its chunks), and the entries at or above the
# pivot its row's program takes in registers. From N(0, 1), N(0, 4^2) and Gumbel logits over 262,144 ids, cut in 1,
# 2, 5 or 32 chunks, 20 draws each, the exact k-th of a row's 2,048 group maxima gathers at most 54 entries for
# k = 50, 68 for k = 64 and 287 for k = 256 (export/results, "The sampler's top-k by a pivot"; the two-digit pivot
# adds its bin's entries above it); a k near the groups' count, or many keys tied at the pivot, can overflow the
# registers' CANDIDATES and then takes passes over the list.
PIVOT_GROUPS = 2048
# The pivot's leading digits: with all 4 (the exact k-th group maximum) the gathering pass took 12.7 / 71.8 us at
# 1 / 64 rows on an H100, with 2 11.5 / 65.3 (export/results, "The sampler's top-k by a pivot").
PIVOT_DIGITS = tl.constexpr(2)
# A row's gathered entries' ids are kept up to LISTED in memory; the row's program takes up to CANDIDATES of them
# in registers, and between the two runs its cut, race and rounds as passes over the list: on an H100, k = 1,000
# took 0.038 / 0.147 / 0.382 ms at 1 / 64 / 256 rows so, its row's program 14 / 21 / 33 us where over the whole row
# it took 711 / 964 / 1,225. (Keeping each id's score beside it cost the gathering pass 14 registers, a program an
# SM, and top-k 50 40 %: export/results, "The sampler's large top-k".)
CANDIDATES = 1024
LISTED = 16384


@triton.jit
def _scores(row_ptr, base, V, inv_temp, BLOCK: tl.constexpr):
    """(ids, in-range mask, scores logits * inv_temp; -inf past the vocabulary)."""
    idx = base + tl.arange(0, BLOCK)
    ok = idx < V
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
    return idx, ok, x * inv_temp


@triton.jit
def _entries(row_ptr, ids_ptr, LISTED: tl.constexpr, base, hi, inv_temp, BLOCK: tl.constexpr):
    """(ids, in-range mask, scores) of tile `base`: of the row (ids base ..), or with LISTED of its gathered
    list (ids_ptr: entries base .. of the list, `hi` of them)."""
    if LISTED:
        i = base + tl.arange(0, BLOCK)
        ok = i < hi
        idx = tl.load(ids_ptr + i, mask=ok, other=0)
        s = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
    else:
        idx, ok, s = _scores(row_ptr, base, hi, inv_temp, BLOCK)
    return idx, ok, s


@triton.jit
def _to_gumbel(r):
    return -tl.log(-tl.log(tl.uint_to_uniform_float(r)))


@triton.jit
def _gumbel(seed, counter, base, BLOCK: tl.constexpr):
    """Gumbel noise of ids base .. base + BLOCK - 1 (base a multiple of 4): reference.sample_noise_ref."""
    n = (base // 4 + tl.arange(0, BLOCK // 4)).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, (counter << 32) + n)
    return _to_gumbel(tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK]))


@triton.jit
def _gumbel_at(seed, counter, idx):
    """Gumbel noise of any ids `idx`: the Philox word id % 4 of counter id // 4, as `_gumbel` lays them out."""
    r0, r1, r2, r3 = tl.randint4x(seed, (counter << 32) + (idx // 4).to(tl.int64))
    j = idx % 4
    return _to_gumbel(tl.where(j == 0, r0, tl.where(j == 1, r1, tl.where(j == 2, r2, r3))))


@triton.jit
def _keys(s, ok, top):
    """Cut key and integer mass of scores `s` (reference.sample_keys_ref); past the vocabulary the key is
    one above the largest, so no bound counts it."""
    d = top - s
    key = tl.minimum(d * SCALE_KEY, KEY_MAX).to(tl.int32)
    mass = (tl.exp(-d) * SCALE_MASS).to(tl.int32)
    return tl.where(ok, key, KEY_MAX + 1), mass


@triton.jit
def _lane_race(z, idx, best, win, ORDERED: tl.constexpr = True):
    """Per lane, keep the larger race value and its id (the earlier id on a tie: `ORDERED` ids only grow in a
    lane; a gathered list's come in any order)."""
    better = z > best
    if not ORDERED:
        better = better | ((z == best) & (idx < win))
    return tl.where(better, z, best), tl.where(better, idx, win)


@triton.jit
def _race_result(best, win):
    """(value, id) of the race from its per-lane state: the largest value, the smallest id holding it."""
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, win, 2147483647), 0)


@triton.jit
def _race_pass(row_ptr, lo, hi, inv_t, top, seed, counter, race_bound, mass_bound, BLOCK: tl.constexpr,
               ids_ptr=None, LISTED: tl.constexpr = False):
    """One pass over ids lo .. hi-1 (with LISTED, over entries lo .. hi-1 of the row's gathered list): the race
    winner among entries with key < race_bound and its race value, their integer mass, and the integer mass of
    the entries with key < mass_bound. State stays per lane until the end (one reduction per pass, not per
    tile); a lane's int32 masses hold V / BLOCK * 2^18 < 2^31."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    win = tl.zeros([BLOCK], tl.int32)
    below_race = tl.zeros([BLOCK], tl.int32)
    below_mass = tl.zeros([BLOCK], tl.int32)
    for base in range(lo, hi, BLOCK):
        idx, ok, s = _entries(row_ptr, ids_ptr, LISTED, base, hi, inv_t, BLOCK)
        key, mass = _keys(s, ok, top)
        if LISTED:  # a list's ids come in any order
            noise = _gumbel_at(seed, counter, idx)
        else:
            noise = _gumbel(seed, counter, base, BLOCK)
        best, win = _lane_race(tl.where(key < race_bound, s + noise, float("-inf")), idx, best, win, not LISTED)
        below_race += tl.where(key < race_bound, mass, 0)
        below_mass += tl.where(key < mass_bound, mass, 0)
    value, w = _race_result(best, win)
    return w, value, tl.sum(below_race.to(tl.int64), 0), tl.sum(below_mass.to(tl.int64), 0)


@triton.jit
def _digit_histogram(key, prefix, level):
    """The histogram of digit `level` (0 the highest) of the cut keys `key` whose higher digits are `prefix`.
    A key past the vocabulary (KEY_MAX + 1) has highest bits above any prefix's. (Fewer, wider digits trade
    histograms for work: a warp's histogram costs a vote a bit and a count a bin.)"""
    shift = DIGIT_BITS * (DIGITS - 1 - level)
    return tl.histogram((key >> shift) & (BINS - 1), BINS, mask=(key >> (shift + DIGIT_BITS)) == prefix)


@triton.jit
def _pick_digit(counts, prefix, k_left):
    """The digit whose bin holds the k_left-th smallest key of `counts`: (prefix extended by it, the rank
    of that key within the bin)."""
    cum = tl.cumsum(counts, 0)
    below = cum < k_left
    return prefix * BINS + tl.sum(below.to(tl.int32), 0), k_left - tl.sum(tl.where(below, counts, 0), 0)


@triton.jit
def _bin_end(prefix, LEVELS: tl.constexpr):
    """The largest key whose first LEVELS digits are `prefix`."""
    low: tl.constexpr = DIGIT_BITS * (DIGITS - LEVELS)
    return ((prefix + 1) << low) - 1


@triton.jit
def _kth_key(key, k, LEVELS: tl.constexpr = DIGITS):
    """The k-th smallest of the cut keys `key` (a tensor in registers; 1 <= k <= their count), or with LEVELS
    below DIGITS the largest key of the bin of its first LEVELS digits (at least k keys are at most that)."""
    prefix = tl.zeros([], tl.int32)
    k_left = k.to(tl.int32)
    for level in tl.static_range(LEVELS):
        prefix, k_left = _pick_digit(_digit_histogram(key, prefix, level), prefix, k_left)
    return _bin_end(prefix, LEVELS)


@triton.jit
def _row_digits(row_ptr, ids_ptr, LISTED: tl.constexpr, n, inv_t, top, prefix, k_left, first, last,
                BLOCK: tl.constexpr):
    """Digits first .. last-1 of the k_left-th smallest cut key among the entries, of a whole row of n (with
    LISTED, of its gathered list's n), whose higher digits are `prefix`, read from memory, a pass a digit:
    (prefix extended by them, the key's rank within that bin, the bin's count)."""
    in_bin = tl.zeros([], tl.int32)
    for level in range(first, last):
        counts = tl.zeros([BINS], tl.int32)
        for base in range(0, n, BLOCK):
            idx, ok, s = _entries(row_ptr, ids_ptr, LISTED, base, n, inv_t, BLOCK)
            key, _ = _keys(s, ok, top)
            counts += _digit_histogram(key, prefix, level)
        prefix, k_left = _pick_digit(counts, prefix, k_left)
        in_bin = tl.sum(tl.where(tl.arange(0, BINS) == prefix % BINS, counts, 0), 0)
    return prefix, k_left, in_bin


@triton.jit
def _append(ids_ptr, start, near, idx, L: tl.constexpr):
    """Store the ids `idx` whose `near` is 1, in order, at list positions start .. (the first L of the list)."""
    at = start + tl.cumsum(near, 0) - 1
    tl.store(ids_ptr + at, idx, mask=(near > 0) & (at < L))


@triton.jit
def _list_row(row_ptr, ids_ptr, V, inv_t, top, bound, L: tl.constexpr, BLOCK: tl.constexpr):
    """A top-k row's own gathering, for a row the gathering pass left without a list: the ids of the entries whose
    key is at most `bound`, listed in order (the first L of them) in one pass; returns how many there are."""
    n = tl.zeros([], tl.int32)
    for base in range(0, V, BLOCK):
        idx, ok, s = _scores(row_ptr, base, V, inv_t, BLOCK)
        near = (_keys(s, ok, top)[0] <= bound).to(tl.int32)
        _append(ids_ptr, n, near, idx, L)
        n += tl.sum(near, 0)
    return n


@triton.jit
def _row_settings(rows_ptr, R, r, V):
    """(temperature, top_p, top_k, seed, counter, fp32 scale of the logits, race over every entry in the
    first pass, noise in that race) of row r: greedy rows race their plain logits; a row without the race
    (sampled, 0 < top_k < V) is a top-k row."""
    temp = tl.load(rows_ptr + r).to(tl.float64, bitcast=True)
    top_p = tl.load(rows_ptr + R + r).to(tl.float64, bitcast=True)
    top_k = tl.load(rows_ptr + 2 * R + r)
    seed = tl.load(rows_ptr + 3 * R + r)
    counter = tl.load(rows_ptr + 4 * R + r)
    sampled = temp > 0
    inv_t = (1.0 / tl.where(sampled, temp, 1.0)).to(tl.float32)  # the reciprocal in fp64 (IEEE), then fp32
    race_all = (top_k <= 0) | (top_k >= V) | (temp <= 0)
    return temp, top_p, top_k, seed, counter, inv_t, race_all, sampled & race_all


@triton.jit
def _first_pass(row_ptr, lo, hi, inv_t, seed, counter, race_all, noisy, BLOCK: tl.constexpr):
    """Over ids lo .. hi-1: each lane's top score and, when `race_all`, the race winner (with noise when
    `noisy`, else the plain argmax) and its value."""
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    win = tl.zeros([BLOCK], tl.int32)
    for base in range(lo, hi, BLOCK):
        idx, ok, s = _scores(row_ptr, base, hi, inv_t, BLOCK)
        top = tl.maximum(top, s)
        if race_all:
            z = s
            if noisy:
                z = s + _gumbel(seed, counter, base, BLOCK)
            best, win = _lane_race(z, idx, best, win)
    value, w = _race_result(best, win)
    return top, value, w


@triton.jit
def _first_pass_kernel(x_ptr, rows_ptr, part_ptr, wins_ptr, lanes_ptr, count_ptr, R, V, stride_x, CHUNK, S,
                       G: tl.constexpr, BLOCK: tl.constexpr):
    """The first pass of row program_id(0) over its chunk program_id(1): part[0 | 1][r, c] = top, race value;
    wins[0][r, c] = race winner; with G (> 0), for a top-k row, lanes[r, c] = the maxima of its G groups of
    lanes, and the row's count of gathered entries zeroed."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp, top_p, top_k, seed, counter, inv_t, race_all, noisy = _row_settings(rows_ptr, R, r, V)
    row_ptr = x_ptr + r.to(tl.int64) * stride_x
    lo = c * CHUNK
    top, best, win = _first_pass(row_ptr, lo, tl.minimum(lo + CHUNK, V), inv_t, seed, counter, race_all, noisy,
                                 BLOCK)
    at = r * S + c
    tl.store(part_ptr + at, tl.max(top, 0))
    tl.store(part_ptr + R * S + at, best)
    tl.store(wins_ptr + at, win)
    if G > 0:
        if race_all == 0:
            tl.store(lanes_ptr + at * G + tl.arange(0, G), tl.max(tl.reshape(top, [G, BLOCK // G]), 1))
        if c == 0:
            tl.store(count_ptr + r, 0)


@triton.jit
def _earliest_best(best_ptr, win_ptr, r, S, SP: tl.constexpr):
    """The winner of row r's chunks: the earliest chunk holding the best race value."""
    c = tl.arange(0, SP)
    bests = tl.load(best_ptr + r * S + c, mask=c < S, other=float("-inf"))
    first = tl.min(tl.where(bests == tl.max(bests, 0), c, SP), 0)
    return tl.load(win_ptr + r * S + tl.minimum(first, S - 1))


@triton.jit
def _chunk_sum(ptr, r, S, SP: tl.constexpr):
    c = tl.arange(0, SP)
    return tl.sum(tl.load(ptr + r * S + c, mask=c < S, other=0), 0)


@triton.jit
def _chunk_max(ptr, r, S, SP: tl.constexpr):
    c = tl.arange(0, SP)
    return tl.max(tl.load(ptr + r * S + c, mask=c < S, other=float("-inf")), 0)


@triton.jit
def _gather_kernel(x_ptr, rows_ptr, part_ptr, lanes_ptr, count_ptr, cand_ptr, R, V, stride_x, CHUNK, S,
                   G: tl.constexpr, SP: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
    """For a top-k row program_id(0): the pivot, the largest key in the bin of `PIVOT_DIGITS` leading digits
    that holds the k-th smallest cut key of its chunks' group maxima, then over chunk program_id(1) the ids of the
    entries whose key is at most the pivot, appended to cand[r] (the first L of them) behind the row's count,
    which counts them all. A k above the groups' count has no pivot: its row's count says L + 1 (an overflowed
    list), and its program lists its own entries or cuts its whole row (`_sample_kernel`)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp, top_p, top_k, seed, counter, inv_t, race_all, noisy = _row_settings(rows_ptr, R, r, V)
    if (race_all == 0) & (top_k > S * G):
        if c == 0:
            tl.store(count_ptr + r, L + 1)
    elif race_all == 0:
        row_ptr = x_ptr + r.to(tl.int64) * stride_x
        top = _chunk_max(part_ptr, r, S, SP)
        g = tl.arange(0, SP * G)
        maxima = tl.load(lanes_ptr + r * S * G + g, mask=g < S * G, other=float("-inf"))
        pivot = _kth_key(_keys(maxima, g < S * G, top)[0], top_k, PIVOT_DIGITS)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        # Two stages: the next tile's loads stay in flight across this tile's block-wide count and its barrier,
        # which otherwise make every warp wait for the slowest load a tile (the pass at 64 / 256 rows: 64 / 160
        # -> 57 / 145 us on an H100, export/results "The e4m3 arena on an H200").
        for base in tl.range(lo, hi, BLOCK, num_stages=2):
            idx, ok, s = _scores(row_ptr, base, hi, inv_t, BLOCK)
            near = (_keys(s, ok, top)[0] <= pivot).to(tl.int32)
            n = tl.sum(near, 0)
            if n > 0:
                _append(cand_ptr + r * L, tl.atomic_add(count_ptr + r, n), near, idx, L)


@triton.jit
def _gathered_draw(row_ptr, cand_ptr, n, inv_t, top, top_k, top_p, seed, counter, C: tl.constexpr):
    """The token of a top-k row from its n (<= C) gathered entries, which hold every entry whose key is at
    most the row's k-th smallest: that key, the race over the kept entries and the top-p rounds, as the
    row's passes would find them, in registers."""
    i = tl.arange(0, C)
    ok = i < n
    idx = tl.load(cand_ptr + i, mask=ok, other=0)
    s = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
    key, mass = _keys(s, ok, top)
    bound = _kth_key(key, top_k) + 1
    z = s + _gumbel_at(seed, counter, idx)
    _, win = _race_result(tl.where(key < bound, z, float("-inf")), idx)
    if top_p < 1.0:
        kept = tl.sum(tl.where(key < bound, mass, 0).to(tl.int64), 0)
        raced = bound
        done = tl.zeros([], tl.int32)
        while done == 0:
            key_win = tl.minimum(tl.min(tl.where(ok & (idx == win), key, KEY_MAX + 1), 0), raced - 1)
            likelier = tl.sum(tl.where(key < key_win, mass, 0).to(tl.int64), 0)
            done = (likelier.to(tl.float64) < top_p * kept.to(tl.float64)).to(tl.int32)
            _, nxt = _race_result(tl.where(key < key_win, z, float("-inf")), idx)
            win = tl.where(done != 0, win, nxt)
            raced = key_win
    return win


@triton.jit
def _key_of(row_ptr, win, inv_t, top, raced):
    """The cut key of candidate `win`, kept below the bound it was raced under (so bounds only fall)."""
    key, _ = _keys(tl.load(row_ptr + win).to(tl.float32) * inv_t, True, top)
    return tl.minimum(key, raced - 1)


@triton.jit
def _replay(part_ptr, wins_ptr, mass_ptr, row_ptr, r, S, RS, inv_t, top, top_p, win, raced, active,
            SP: tl.constexpr, ROUNDS: tl.constexpr):
    """Row r's top-p rounds 0 .. ROUNDS-1 as the split programs ran them (round q tested the candidate
    and raced the next one chunk by chunk: part[2 + q], wins[1 + q], mass[2q | 2q + 1]), for an
    `active` row: (candidate, the bound it was raced under, 1 if a round accepted it)."""
    done = tl.zeros([], tl.int32)
    for q in tl.static_range(ROUNDS):
        likelier = _chunk_sum(mass_ptr + 2 * q * RS, r, S, SP)
        kept = _chunk_sum(mass_ptr + (2 * q + 1) * RS, r, S, SP)
        accept = likelier.to(tl.float64) < top_p * kept.to(tl.float64)
        live = active & (done == 0)
        key_win = _key_of(row_ptr, win, inv_t, top, raced)
        nxt = _earliest_best(part_ptr + (2 + q) * RS, wins_ptr + (1 + q) * RS, r, S, SP)
        done = tl.where(live & accept, 1, done)
        win = tl.where(live & (accept == 0), nxt, win)
        raced = tl.where(live & (accept == 0), key_win, raced)
    return win, raced, done


@triton.jit
def _round_kernel(x_ptr, rows_ptr, part_ptr, wins_ptr, mass_ptr, R, V, stride_x, CHUNK, S,
                  ROUND: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
    """Top-p round ROUND of row program_id(0) over its chunk program_id(1), for rows without top-k of few
    programs: the rounds before it replayed from their chunks' results, then, if none accepted, this round's
    race and masses over the chunk."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp, top_p, top_k, seed, counter, inv_t, race_all, noisy = _row_settings(rows_ptr, R, r, V)
    active = (temp > 0) & race_all & (top_p < 1.0)
    if active:
        row_ptr = x_ptr + r.to(tl.int64) * stride_x
        RS = R * S
        top = _chunk_max(part_ptr, r, S, SP)
        bound = tl.full([], KEY_MAX + 1, tl.int32)
        win = _earliest_best(part_ptr + RS, wins_ptr, r, S, SP)
        win, raced, done = _replay(part_ptr, wins_ptr, mass_ptr, row_ptr, r, S, RS, inv_t, top, top_p, win, bound,
                                   active, SP, ROUND)
        if done == 0:
            key_win = _key_of(row_ptr, win, inv_t, top, raced)
            lo = c * CHUNK
            nxt, best, likelier, kept = _race_pass(row_ptr, lo, tl.minimum(lo + CHUNK, V), inv_t, top, seed,
                                                   counter, key_win, bound, BLOCK)
            at = r * S + c
            tl.store(part_ptr + (2 + ROUND) * RS + at, best)
            tl.store(wins_ptr + (1 + ROUND) * RS + at, nxt)
            tl.store(mass_ptr + 2 * ROUND * RS + at, likelier)
            tl.store(mass_ptr + (2 * ROUND + 1) * RS + at, kept)


@triton.jit
def _passes(row_ptr, ids_ptr, n, part_ptr, wins_ptr, mass_ptr, r, S, RS, inv_t, top, top_k, top_p, seed,
            counter, win, race_all, prefix, k_left, first, LISTED: tl.constexpr, ROUNDS: tl.constexpr,
            SP: tl.constexpr, BLOCK: tl.constexpr):
    """The token of sampled row r by passes over its n entries (the whole row, or with LISTED its gathered list):
    a top-k row's cut (a pass a digit from digit `first`, its key the k_left-th of those with higher digits
    `prefix`) and race, the top-p rounds the split programs ran (ROUNDS), then any further rounds a pass each.
    `win`: the first pass's race winner (rows without top-k)."""
    bound = tl.full([], KEY_MAX + 1, tl.int32)  # candidates: entries with key < bound
    done = tl.zeros([], tl.int32)
    if race_all == 0:
        bound = _row_digits(row_ptr, ids_ptr, LISTED, n, inv_t, top, prefix, k_left, first, DIGITS, BLOCK)[0] + 1
        win, _, _, _ = _race_pass(row_ptr, 0, n, inv_t, top, seed, counter, bound, bound, BLOCK, ids_ptr, LISTED)
    raced = bound  # the bound `win` was raced under: every later bound is strictly below it
    if ROUNDS > 0:  # the rounds the split programs ran
        win, raced, done = _replay(part_ptr, wins_ptr, mass_ptr, row_ptr, r, S, RS, inv_t, top, top_p, win, raced,
                                   race_all & (top_p < 1.0), SP, ROUNDS)
    if top_p < 1.0:
        while done == 0:
            key_win = _key_of(row_ptr, win, inv_t, top, raced)
            nxt, _, likelier, kept = _race_pass(row_ptr, 0, n, inv_t, top, seed, counter, key_win, bound, BLOCK,
                                                ids_ptr, LISTED)
            done = (likelier.to(tl.float64) < top_p * kept.to(tl.float64)).to(tl.int32)
            win = tl.where(done != 0, win, nxt)
            raced = key_win
    return win


@triton.jit
def _sample_kernel(x_ptr, rows_ptr, part_ptr, wins_ptr, mass_ptr, count_ptr, cand_ptr, out_ptr, R, V,
                   stride_x, S, STAGED: tl.constexpr, GATHER: tl.constexpr, ROUNDS: tl.constexpr, SP: tl.constexpr,
                   C: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    temp, top_p, top_k, seed, counter, inv_t, race_all, noisy = _row_settings(rows_ptr, R, r, V)
    row_ptr = x_ptr + r.to(tl.int64) * stride_x
    RS = R * S
    if STAGED:  # combine the chunks' first passes
        top = _chunk_max(part_ptr, r, S, SP)
        win = _earliest_best(part_ptr + RS, wins_ptr, r, S, SP)
    else:
        lanes, best, win = _first_pass(row_ptr, 0, V, inv_t, seed, counter, race_all, noisy, BLOCK)
        top = tl.max(lanes, 0)
    if temp > 0:
        gathered = tl.zeros([], tl.int32) + L + 1  # no gathered entries
        if GATHER:
            if race_all == 0:
                gathered = tl.load(count_ptr + r)
        ids_ptr = cand_ptr + r * L
        if gathered <= C:
            win = _gathered_draw(row_ptr, ids_ptr, gathered, inv_t, top, top_k, top_p, seed, counter, C)
        else:
            prefix = tl.zeros([], tl.int32)  # the k-th key's leading digits found so far, and its rank among
            k_left = top_k.to(tl.int32)      # the keys that have them
            first = tl.zeros([], tl.int32)
            if GATHER:
                if (race_all == 0) & (gathered > L):  # no list from the gathering pass: the row's own, if it fits
                    prefix, k_left, in_bin = _row_digits(row_ptr, ids_ptr, False, V, inv_t, top, prefix, k_left, 0,
                                                         PIVOT_DIGITS, BLOCK)
                    first += PIVOT_DIGITS
                    if top_k - k_left + in_bin <= L:  # the entries up to the end of the k-th key's bin
                        gathered = _list_row(row_ptr, ids_ptr, V, inv_t, top, _bin_end(prefix, PIVOT_DIGITS), L,
                                             BLOCK)
            if gathered <= L:
                win = _passes(row_ptr, ids_ptr, gathered, part_ptr, wins_ptr, mass_ptr, r, S, RS, inv_t, top,
                              top_k, top_p, seed, counter, win, race_all, prefix, k_left, first, True, 0, SP, BLOCK)
            else:
                win = _passes(row_ptr, ids_ptr, V, part_ptr, wins_ptr, mass_ptr, r, S, RS, inv_t, top, top_k,
                              top_p, seed, counter, win, race_all, prefix, k_left, first, False, ROUNDS, SP, BLOCK)
    tl.store(out_ptr + r, win.to(tl.int64))


# Top-p rounds the split programs run for rows without top-k; a row that needs more goes on alone in its row's
# program, which is then the step's slowest part (a round over the whole row in one program: 136-194 us of 64 rows'
# 0.35-0.41 ms at top_p 0.9 on an H100, where a row needs a third round with probability about 0.1^2). With 4, 64
# rows of top-p 0.9 take 0.26 ms against 0.35 with 2 (export/results, "The sampler's top-k cut by a radix select").
SPLIT_ROUNDS = 4


def first_pass_splits(rows: int, vocab: int, block: int, device: torch.device) -> int:
    """Programs per row for the split passes: enough for about two per SM over all rows, each at least
    four tiles long; 1 (no split) from twice the SMs' worth of rows up. Only speed depends on it, so off
    CUDA it assumes 8 SMs (short interpreter runs)."""
    sms = sm_count(device) if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(vocab, 4 * block), triton.cdiv(2 * sms, rows), 64))


def pivot_groups(splits: int, block: int) -> int:
    """Groups of lanes a chunk's first pass keeps the maxima of: `PIVOT_GROUPS` over the row's `splits` chunks (a
    power of two, at most a lane each)."""
    return min(block, triton.next_power_of_2(triton.cdiv(PIVOT_GROUPS, splits)))


def sample(logits: torch.Tensor, rows: torch.Tensor, block: int = 2048, num_warps: int = 8,
           out: torch.Tensor | None = None, splits: int | None = None, nucleus: bool = True,
           top_k: bool = True) -> torch.Tensor:
    """Token ids int64 [R] for logits [R, V] and rows int64 [5, R] on its device; `out` (int64 [R]) to
    write them into (the bench poisons it first); `splits` overrides `first_pass_splits`. `nucleus`
    False (the caller knows no row has top_p < 1) skips the split top-p rounds' launches and `top_k`
    False (no row has top_k > 0) the gathering pass's; only speed depends on them (a row's program runs any
    cut or rounds left, over its whole row). With `top_k` the first pass runs as its own launch even for
    rows of one program (a chunk a row), for the gathering pass after it.

    The tile (2,048 ids, 8 warps) is the H200 sweep's fastest at 262,144 ids, with the same tokens as
    1,024 (export/results, "The sampler kernel")."""
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device) if out is None else out
    if R == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows = rows.contiguous()
    splits = first_pass_splits(R, V, block, logits.device) if splits is None else splits
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block  # whole tiles, so ids stay 4-aligned per tile
    splits = triton.cdiv(V, chunk)
    staged = splits > 1 or top_k
    n = R * splits if staged else 1
    rounds = SPLIT_ROUNDS if splits > 1 and nucleus else 0
    groups = pivot_groups(splits, block) if top_k else 0
    dev = logits.device
    part = torch.empty((2 + rounds) * n, dtype=torch.float32, device=dev)
    wins = torch.empty((1 + rounds) * n, dtype=torch.int32, device=dev)
    mass = torch.empty(max(2 * rounds * n, 1), dtype=torch.int64, device=dev)
    lanes = torch.empty(max(groups * n, 1), dtype=torch.float32, device=dev)
    count = torch.empty(R if top_k else 1, dtype=torch.int32, device=dev)
    cand = torch.empty(R * LISTED if top_k else 1, dtype=torch.int32, device=dev)
    # No fused multiply-adds: keys and race values round as the reference's separate ops do.
    opts = dict(num_warps=num_warps, enable_fp_fusion=False)
    sp = triton.next_power_of_2(splits)
    args = (R, V, logits.stride(0), chunk, splits)
    if staged:
        _first_pass_kernel[(R, splits)](logits, rows, part, wins, lanes, count, *args, G=groups, BLOCK=block, **opts)
    if top_k:
        _gather_kernel[(R, splits)](logits, rows, part, lanes, count, cand, *args, G=groups, SP=sp, L=LISTED,
                                    BLOCK=block, **opts)
    for q in range(rounds):
        _round_kernel[(R, splits)](logits, rows, part, wins, mass, *args, ROUND=q, SP=sp, BLOCK=block, **opts)
    _sample_kernel[(R,)](logits, rows, part, wins, mass, count, cand, out, R, V, logits.stride(0), splits,
                         STAGED=staged, GATHER=top_k, ROUNDS=rounds, SP=sp, C=CANDIDATES, L=LISTED, BLOCK=block,
                         **opts)
    return out
