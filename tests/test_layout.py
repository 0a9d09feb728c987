"""KVLayout / PageGeometry for the four published configs against the hand arithmetic of
gemma4-spec.md §4 (bytes per token, per-request bytes at 262,144 positions, cache-owning layers,
KV sources) and the page-geometry invariants every kernel relies on."""
from __future__ import annotations

import pytest

from g4rt.models.config import PUBLISHED, load_config
from g4rt.models.layout import KVLayout, PageGeometry, frame_stride

CTX = 262_144

# size: (bytes/token, keep-all bytes @262,144, sliding-ring bytes @262,144), spec §4 tables.
SPEC_BYTES = {
    "e2b": (18_432, 4_831_838_208, 1_616_904_192),
    "e4b": (57_344, 15_032_385_536, 4_315_938_816),
    "26b-a4b": (225_280, 59_055_800_320, 5_578_424_320),
    "31b": (901_120, 236_223_201_280, 22_313_697_280),
}
# size: (sliding B/layer/token, full B/layer/token, #sliding owners, full owners)
SPEC_GROUPS = {
    "e2b": (1_024, 2_048, 12, (4, 9, 14)),
    "e4b": (2_048, 4_096, 20, (5, 11, 17, 23)),
    "26b-a4b": (8_192, 4_096, 25, (5, 11, 17, 23, 29)),
    "31b": (16_384, 8_192, 50, tuple(range(5, 60, 6))),
}
# size: (first KV-shared layer, source of shared sliding layers, source of shared full layers)
SPEC_SHARING = {"e2b": (15, 13, 14), "e4b": (24, 22, 23)}


def layout(name: str) -> KVLayout:
    return KVLayout.from_config(load_config(name))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bytes_match_spec(name):
    lay = layout(name)
    per_token, keep_all, ring = SPEC_BYTES[name]
    assert lay.bytes_per_token == per_token
    assert lay.request_bytes(CTX, keep_all=True) == keep_all
    assert lay.request_bytes(CTX, keep_all=False) == ring


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_cache_groups_match_spec(name):
    lay = layout(name)
    s_bytes, f_bytes, n_sliding, full = SPEC_GROUPS[name]
    assert lay.sliding.bytes_per_token_per_layer == s_bytes
    assert lay.full.bytes_per_token_per_layer == f_bytes
    assert len(lay.sliding.layers) == n_sliding
    assert lay.full.layers == full
    assert (lay.sliding.head_dim, lay.full.head_dim) == (256, 512)


def test_e2b_owners_exactly():
    lay = layout("e2b")
    assert lay.sliding.layers == (0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_kv_sources(name):
    lay = layout(name)
    n = len(lay.layers)
    first, s_src, f_src = SPEC_SHARING.get(name, (n, None, None))
    for l in lay.layers:
        if l.index < first:
            assert l.owns_cache and l.source == l.index
        else:
            assert not l.owns_cache
            assert l.source == (s_src if l.sliding else f_src)
            assert lay.layers[l.source].sliding == l.sliding


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("page_tokens", [1, 4, 16, 64])
def test_page_geometry_invariants(name, page_tokens):
    lay = layout(name)
    geo = PageGeometry.build(lay, page_tokens=page_tokens)
    for group in lay.groups:
        tokens = geo.page_tokens[group.name]
        block = tokens * group.num_kv_heads * group.head_dim
        spans = sorted(span for i in group.layers for span in
                       ((geo.offsets[i][0], geo.offsets[i][0] + block), (geo.offsets[i][1], geo.offsets[i][1] + block)))
        assert spans[0][0] == 0
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{name} {group.name}: blocks overlap"
        assert spans[-1][1] <= geo.frame_elems, f"{name} {group.name}: blocks overflow the frame"
        assert 0 < tokens * group.bytes_per_token <= geo.frame_bytes()  # a page fits its frame
    # Every layer reads the offsets of the cache it attends over.
    for l in lay.layers:
        assert geo.layer_offsets(l.index) == geo.offsets[l.source]
    # The frame is the larger group's page, padded to a stride no memory-stack count divides (frame_stride).
    assert geo.frame_elems == frame_stride(max(geo.page_tokens[g.name] * g.bytes_per_token // g.dtype_bytes
                                               for g in lay.groups))


def _odd(n):
    while n % 2 == 0:
        n //= 2
    return n


# elements asked -> the padded frame, worked by hand: the granule is the largest power of two at most 1/512 of the
# frame (16 at least); the granule count steps up until its odd factor has no 3 or 5.
STRIDES = [(1, 16), (3, 16), (48, 64),  # 16-element granules: 3 -> 4
           (80, 112),  # 5 -> 6 (odd 3) -> 7
           (8192, 8192), (2**23, 2**23),  # powers of two stay
           (102_400, 102_656), (409_600, 410_624), (6_553_600, 6_569_984),  # 800 granules (odd 25) -> 802 (401)
           (6_553_601, 6_569_984),  # 801 granules (9 x 89) -> 802
           (3 * 2**20, 3_149_824), (15 * 2**20, 15_745_024)]  # 768 -> 769, 960 -> 961 (31 x 31)


@pytest.mark.parametrize("elems, want", STRIDES)
def test_frame_stride_keeps_three_and_five_out_of_the_odd_factor(elems, want):
    """The padded frame holds the page, keeps rows a multiple of 16 elements (the kernels' vector loads), costs at
    most 3 % beyond the smallest frames, and its odd factor has no 3 or 5: a stride of 1,280 KiB or a multiple of it
    read 24 % slower on an H100, the 31B's 12.5 MiB frame among them."""
    got = frame_stride(elems)
    assert got == want
    assert got >= elems and got % 16 == 0 and _odd(got) % 3 and _odd(got) % 5
    assert elems < 2048 or got - elems <= 0.03 * elems


def test_frame_stride_of_the_31b():
    """The 31B's sliding page of 50 layers (12.5 MiB in bf16, 800 granules of 16 KiB: 25 odd) grows to 802
    granules (401 odd), 12,832 KiB; the e4m3 arena's to 6,416 KiB; a power of two stays as it is."""
    assert frame_stride(6_553_600) * 2 == 12_832 * 1024
    assert PageGeometry.build(layout("31b")).frame_bytes() == 12_832 * 1024
    e4m3 = KVLayout.from_config(load_config("31b"), "float8_e4m3fn")
    assert PageGeometry.build(e4m3).frame_bytes() == 6_416 * 1024
    assert frame_stride(2**20) == 2**20


@pytest.mark.parametrize("page_tokens, align, message", [(0, 16, "page_tokens must be positive, got 0"),
                                                          (16, -4, "align must be positive, got -4")])
def test_page_geometry_names_the_bad_setting(page_tokens, align, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        PageGeometry.build(layout("31b"), page_tokens, align)
