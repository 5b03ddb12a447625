"""LLaVA preprocessing (mmparity.models.llava.preprocess) against values worked out by hand, the installed
megatron-core, transformers' InternVL / causal-LM loss, and an independent list-based reference.

Hypothesis strategies live here rather than in tests/strategies.py because this file is the only
user so far; move them when a second test needs them.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmparity.models.llava import preprocess as llava

IMG = llava.DEFAULT_IMAGE_TOKEN_INDEX
IGNORE = llava.IGNORE_INDEX

# Deterministic example generation keeps CI reproducible; the inputs inside each example are
# seeded random tensors, so a wrong layout still changes values.
fast = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def mcore_llava():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.multimodal import llava_model
    return llava_model


@pytest.fixture(scope="module")
def hf_pixel_shuffle():
    from transformers.models.internvl.modeling_internvl import InternVLModel

    # The method reads nothing from self; calling it unbound avoids building a model.
    return lambda features, scale: InternVLModel.pixel_shuffle(None, features, scale)


# ------------------------------------------------------------------------------------------
# pixel shuffle
# ------------------------------------------------------------------------------------------

GOLDEN_GRID = torch.arange(24.0).reshape(1, 24, 1)  # a 4x6 grid of arange(24)
GOLDEN_SPATIAL = [
    [0, 1, 6, 7],
    [2, 3, 8, 9],
    [4, 5, 10, 11],
    [12, 13, 18, 19],
    [14, 15, 20, 21],
    [16, 17, 22, 23],
]


def test_pixel_shuffle_golden_4x6():
    out = llava.pixel_shuffle(GOLDEN_GRID, h=4, w=6)
    assert out.shape == (1, 6, 4)
    assert out[0].tolist() == GOLDEN_SPATIAL


def test_pixel_shuffle_version1_orders_blocks_column_major():
    out = llava.pixel_shuffle(GOLDEN_GRID, version=1, h=4, w=6)
    by_block = dict(zip([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)], GOLDEN_SPATIAL))
    column_major = [by_block[(row, col)] for col in range(3) for row in range(2)]
    assert out[0].tolist() == column_major


def test_pixel_shuffle_legacy_layout_groups_consecutive_raster_tokens():
    out = llava.pixel_shuffle(GOLDEN_GRID, h=4, w=6, layout="mcore_legacy")
    assert out[0].tolist() == [list(range(k, k + 4)) for k in range(0, 24, 4)]
    # odd grids are what the legacy layout accepted and the spatial one refuses
    odd = torch.arange(12.0).reshape(1, 12, 1)
    assert llava.pixel_shuffle(odd, h=3, w=4, layout="mcore_legacy").shape == (1, 3, 4)
    with pytest.raises(ValueError, match="divisible by 2"):
        llava.pixel_shuffle(odd, h=3, w=4)


def test_pixel_shuffle_legacy_layout_without_grid_is_spatial():
    x = torch.randn(2, 36, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(llava.pixel_shuffle(x, layout="mcore_legacy"), llava.pixel_shuffle(x))


@fast
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 5),
    r=st.sampled_from([2, 4]),
    channels=st.integers(1, 4),
    tiles=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_pixel_shuffle_matches_transformers_internvl(
    hf_pixel_shuffle, rows, cols, r, channels, tiles, seed
):
    h, w = rows * r, cols * r
    x = torch.randn(tiles, h * w, channels, generator=torch.Generator().manual_seed(seed))
    expected = hf_pixel_shuffle(x.reshape(tiles, h, w, channels), 1 / r)
    expected = expected.reshape(tiles, -1, expected.shape[-1])
    got = llava.pixel_shuffle(x, 1 / r, h=h, w=w)
    assert torch.equal(got, expected)
    if h == w:  # the square default path, as InternVL itself calls it
        assert torch.equal(llava.pixel_shuffle(x, 1 / r), expected)


@fast
@given(
    side=st.sampled_from([2, 4, 6, 8]),
    version=st.sampled_from([1, 2]),
    channels=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_pixel_shuffle_matches_installed_mcore_on_square_grids(
    mcore_llava, side, version, channels, seed
):
    x = torch.randn(2, side * side, channels, generator=torch.Generator().manual_seed(seed))
    expected = mcore_llava.pixel_shuffle(x, 0.5, version)
    assert torch.equal(llava.pixel_shuffle(x, 0.5, version), expected)


def test_installed_mcore_layout_is_detected(mcore_llava):
    import megatron.core

    layout = llava.installed_mcore_pixel_shuffle_layout()
    assert layout in {"spatial", "mcore_legacy", "square_only"}
    if megatron.core.__version__.startswith("0.16."):
        assert layout == "square_only"  # 0.16.1's pixel_shuffle has no h / w parameters


def _spatial(x, scale_factor=0.5, version=2, h=None, w=None):
    return llava.pixel_shuffle(x, scale_factor, version, h=h, w=w)


def _legacy(x, scale_factor=0.5, version=2, h=None, w=None):
    return llava.pixel_shuffle(x, scale_factor, version, h=h, w=w, layout="mcore_legacy")


def _wrong_values(x, scale_factor=0.5, version=2, h=None, w=None):
    return x[:, ::4] * 0


def _rejects_grid(x, scale_factor=0.5, version=2, h=None, w=None):
    raise RuntimeError("no 4x6 grids here")


def _square_only_column_major(x, scale_factor=0.5, version=2):
    return llava.pixel_shuffle(x, version=1)


@pytest.mark.parametrize(
    "candidate, expected",
    [
        (_spatial, "spatial"),
        (_legacy, "mcore_legacy"),
        (_wrong_values, "unknown"),
        (_rejects_grid, "unknown"),
        (_square_only_column_major, "unknown"),
    ],
)
def test_layout_detection_distinguishes_implementations(
    mcore_llava, monkeypatch, candidate, expected
):
    monkeypatch.setattr(mcore_llava, "pixel_shuffle", candidate)
    assert llava.installed_mcore_pixel_shuffle_layout() == expected


@pytest.mark.parametrize(
    "kwargs, shape, message",
    [
        (dict(), (1, 24, 2), "not a square number"),
        (dict(h=4), (1, 24, 2), "both h and w"),
        (dict(h=4, w=4), (1, 24, 2), "has 16 patches"),
        (dict(h=2, w=3), (1, 6, 2), "divisible by 2"),
        (dict(version=3), (1, 16, 2), "version"),
        (dict(layout="raster"), (1, 16, 2), "layout"),
        (dict(scale_factor=0.3), (1, 16, 2), "1/r"),
        (dict(scale_factor=0.0), (1, 16, 2), r"\(0, 1\]"),
        (dict(scale_factor=1.5), (1, 16, 2), r"\(0, 1\]"),
        (dict(), (16, 2), "num_tiles, seq_len, channels"),
        (dict(h=4, w=6, version=1, layout="mcore_legacy"), (1, 24, 2), "version=2"),
        (dict(h=3, w=3, layout="mcore_legacy"), (1, 9, 2), "not divisible by r"),
    ],
)
def test_pixel_shuffle_rejects(kwargs, shape, message):
    with pytest.raises(ValueError, match=message):
        llava.pixel_shuffle(torch.zeros(shape), **kwargs)


@fast
@given(
    grids=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=4),
    version=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pixel_shuffle_dynamic_res_shuffles_each_image_on_its_grid(grids, version, seed):
    patch_dim = 3
    grids = [(2 * rows, 2 * cols) for rows, cols in grids]
    # pixel sizes that are not multiples of the patch: the grid is floor(size / patch)
    sizes = torch.tensor([[rows * patch_dim + 1, cols * patch_dim + 2] for rows, cols in grids])
    total = sum(rows * cols for rows, cols in grids)
    x = torch.randn(2, total, 3, generator=torch.Generator().manual_seed(seed))

    got = llava.pixel_shuffle_dynamic_res(x, sizes, patch_dim, version=version)

    pieces, start = [], 0
    for rows, cols in grids:
        chunk = x[:, start : start + rows * cols]
        start += rows * cols
        pieces.append(llava.pixel_shuffle(chunk, version=version, h=rows, w=cols))
    assert torch.equal(got, torch.cat(pieces, dim=1))
    chunks = torch.split(x, [rows * cols for rows, cols in grids], dim=1)
    by_chunk = llava.pixel_shuffle_dynamic_resolution_chunks(chunks, sizes, patch_dim, 0.5, version)
    assert all(torch.equal(a, b) for a, b in zip(by_chunk, pieces))


def test_pixel_shuffle_dynamic_res_matches_transformers_per_image(hf_pixel_shuffle):
    sizes = torch.tensor([[8, 12], [4, 4], [12, 8]])
    # patch 2: grids 4x6, 2x2, 6x4
    x = torch.randn(1, 4 * 6 + 2 * 2 + 6 * 4, 2, generator=torch.Generator().manual_seed(1))
    got = llava.pixel_shuffle_dynamic_res(x, sizes, 2)
    expected, start = [], 0
    for h, w in (sizes // 2).tolist():
        chunk = x[:, start : start + h * w].reshape(1, h, w, 2)
        start += h * w
        expected.append(hf_pixel_shuffle(chunk, 0.5).reshape(1, -1, 8))
    assert torch.equal(got, torch.cat(expected, dim=1))


def test_pixel_shuffle_dynamic_res_rejects():
    x = torch.zeros(1, 20, 2)
    with pytest.raises(ValueError, match=r"give 8 patches \(\[4, 4\]\) but x has 20"):
        llava.pixel_shuffle_dynamic_res(x, torch.tensor([[4, 4], [4, 4]]), 2)
    with pytest.raises(ValueError, match=r"\[num_images, 2\]"):
        llava.pixel_shuffle_dynamic_res(x, torch.tensor([4, 4]), 2)
    with pytest.raises(ValueError, match="smaller than one patch"):
        llava.pixel_shuffle_dynamic_res(x, torch.tensor([[1, 40]]), 2)
    with pytest.raises(ValueError, match="patch_dim"):
        llava.pixel_shuffle_dynamic_res(x, torch.tensor([[4, 4]]), 0)
    with pytest.raises(ValueError, match="chunk 1 has 3 tokens"):
        llava.pixel_shuffle_dynamic_resolution_chunks(
            [torch.zeros(1, 4, 2), torch.zeros(1, 3, 2)], torch.tensor([[4, 4], [4, 4]]), 2
        )
    with pytest.raises(ValueError, match="1 chunks but 2 image sizes"):
        llava.pixel_shuffle_dynamic_resolution_chunks(
            [torch.zeros(1, 4, 2)], torch.tensor([[4, 4], [4, 4]]), 2
        )


# ------------------------------------------------------------------------------------------
# placeholder expansion: pinned cases
# ------------------------------------------------------------------------------------------


def test_preprocess_notes_worked_example():
    # ids [0,1,2,<img>,4,5,6,7], labels [1..8], 2 tiles of L=3
    ids = torch.tensor([[0, 1, 2, IMG, 4, 5, 6, 7]])
    labels = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    text = torch.arange(8.0).reshape(1, 8, 1).repeat(1, 1, 2)
    image = torch.arange(100.0, 106.0).reshape(3, 2, 1).repeat(1, 1, 2)  # [L, tiles, h]
    out = llava.preprocess_data(image, text, ids, torch.ones(1, 8), labels, IMG, [2])

    assert out.embeddings.shape == (13, 1, 2)
    assert out.embeddings[:, 0, 0].tolist() == [0, 1, 2, 100, 102, 104, 101, 103, 105, 4, 5, 6, 7]
    assert out.labels.tolist() == [[1, 2, IGNORE] + [IGNORE] * 5 + [4, 5, 6, 7, 8]]
    assert out.loss_mask.tolist() == [[1, 1, 0] + [0] * 6 + [1, 1, 1, 1]]
    assert out.input_ids.tolist() == [[0, 1, 2] + [IMG] * 6 + [4, 5, 6, 7]]
    assert out.position_ids.tolist() == [list(range(13))]


def test_preprocess_seed_docstring_example():
    # input_ids [0, 1, -200, 2, 3], labels [1, -200, 2, 3, 4], one slot per image
    ids = torch.tensor([[0, 1, IMG, 2, 3]])
    labels = torch.tensor([[1, IMG, 2, 3, 4]])
    out = llava.preprocess_data(
        torch.full((1, 1, 1), 9.0), torch.zeros(1, 5, 1), ids, torch.ones(1, 5), labels
    )
    assert out.labels.tolist() == [[1, IGNORE, 2, 3, 4]]
    assert out.loss_mask.tolist() == [[1, 0, 0, 1, 1]]


def test_preprocess_pads_shorter_rows_and_truncates():
    ids = torch.tensor([[IMG, 5, 6], [7, 8, 9]])
    labels = torch.tensor([[5, 6, 1], [8, 9, 2]])
    text = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3))
    image = torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(4))
    out = llava.preprocess_data(
        image, text, ids, torch.ones(2, 3), labels, sequence_first=False, pad_token_id=-1
    )
    assert out.embeddings.shape == (2, 5, 4)
    assert torch.equal(out.embeddings[1, 3:], torch.zeros(2, 4))
    assert out.labels[1].tolist() == [8, 9, 2, IGNORE, IGNORE]
    assert out.loss_mask[1].tolist() == [1, 1, 1, 0, 0]
    assert out.input_ids.tolist() == [[IMG, IMG, IMG, 5, 6], [7, 8, 9, -1, -1]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]

    cut = llava.preprocess_data(
        image, text, ids, torch.ones(2, 3), labels, language_max_sequence_length=4
    )
    assert cut.embeddings.shape == (4, 2, 4)
    assert all(t.shape == (2, 4) for t in (cut.labels, cut.loss_mask, cut.input_ids))
    assert torch.equal(cut.embeddings.transpose(0, 1), out.embeddings[:, :4])

    padded = llava.preprocess_data(
        image, text, ids, torch.ones(2, 3), labels,
        language_max_sequence_length=8, pad_to_language_max_sequence_length=True,
    )
    assert padded.labels.shape == (2, 8) and padded.embeddings.shape == (8, 2, 4)


def test_preprocess_text_only_batch_is_unchanged():
    ids = torch.tensor([[3, 4, 5]])
    text = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[4, 5, 6]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    out = llava.preprocess_data(torch.zeros(0, 0, 0), text, ids, mask, labels, num_image_tiles=[])
    assert torch.equal(out.embeddings, text.transpose(0, 1))
    assert torch.equal(out.labels, labels) and torch.equal(out.loss_mask, mask)
    assert torch.equal(out.input_ids, ids)
    none = llava.preprocess_data(None, text, ids, mask, labels)
    assert torch.equal(none.embeddings, out.embeddings)


def test_preprocess_pipeline_stages():
    ids = torch.tensor([[1, IMG, 2]])
    labels, loss_mask = torch.tensor([[9, 2, 3]]), torch.ones(1, 3)
    args = (torch.ones(2, 1, 3), torch.zeros(1, 3, 3), ids, loss_mask, labels)
    first = llava.preprocess_data(*args, post_process=False)
    assert first.embeddings.shape == (4, 1, 3) and first.labels is None
    last = llava.preprocess_data(
        None, None, ids, loss_mask, labels, pre_process=False, img_seq_len=2
    )
    assert last.embeddings is None and last.labels.tolist() == [[IGNORE, IGNORE, 2, 3]]
    middle = llava.preprocess_data(*args, pre_process=False, post_process=False)
    assert middle == (None, None, None, None, None)


def test_preprocess_explicit_counts_and_position_ids():
    ids = torch.tensor([[7, IMG, 8, IMG]])
    position_ids = torch.tensor([[10, 11, 12, 13]])
    image = torch.arange(5.0).reshape(5, 1)  # [num_slots, h]: 2 + 3 slots
    out = llava.preprocess_data(
        image, torch.full((1, 4, 1), -1.0), ids, torch.ones(1, 4), torch.tensor([[1, 2, 3, 4]]),
        media_token_counts=[2, 3], position_ids=position_ids,
    )
    assert out.embeddings[:, 0, 0].tolist() == [-1, 0, 1, -1, 2, 3, 4]
    assert out.position_ids.tolist() == [list(range(10, 17))]
    assert out.labels.tolist() == [[IGNORE, IGNORE, 2, IGNORE, IGNORE, IGNORE, 4]]
    assert out.loss_mask.tolist() == [[0, 0, 0, 0, 0, 0, 0]]


def test_preprocess_gradients_reach_text_and_image_embeddings():
    text = torch.randn(1, 3, 2, requires_grad=True)
    image = torch.randn(2, 1, 2, requires_grad=True)
    out = llava.preprocess_data(image, text, torch.tensor([[1, IMG, 2]]), None, None)
    (out.embeddings * torch.arange(8.0).reshape(4, 1, 2)).sum().backward()
    assert text.grad.abs().sum() > 0 and image.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(input_ids=torch.tensor([1, IMG])), "non-empty"),
        (dict(num_image_tiles=[1, 1]), "2 num_image_tiles for 1"),
        (dict(num_image_tiles=[0]), "at least one tile"),
        (dict(media_token_counts=[2, 2]), "2 media_token_counts for 1"),
        (dict(media_token_counts=[0]), "at least one slot"),
        (dict(image_embeddings=torch.zeros(3, 2), img_seq_len=None), "cannot tell"),
        (
            dict(image_embeddings=torch.zeros(3, 1, 2), img_seq_len=2),
            "3 image embedding rows for 2",
        ),
        (dict(image_embeddings=torch.zeros(2, 1, 3)), "hidden size 3"),
        (dict(image_embeddings=torch.zeros(2, 1, 1, 2), img_seq_len=2), "num_slots, hidden"),
        (dict(image_embeddings=torch.zeros(2, 1, 2, dtype=torch.float64)), "float64"),
        (dict(language_embeddings=torch.zeros(1, 2, 2)), "language_embeddings"),
        (dict(loss_mask=None), "labels and loss_mask"),
        (dict(labels=torch.zeros(1, 2, dtype=torch.long)), "labels and loss_mask"),
        (dict(position_ids=torch.zeros(1, 2, dtype=torch.long)), "position_ids shape"),
    ],
)
def test_preprocess_rejects(change, message):
    kwargs = dict(
        image_embeddings=torch.zeros(2, 1, 2),
        language_embeddings=torch.zeros(1, 3, 2),
        input_ids=torch.tensor([[1, IMG, 2]]),
        loss_mask=torch.ones(1, 3),
        labels=torch.tensor([[5, 2, 3]]),
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        llava.preprocess_data(**kwargs)


# ------------------------------------------------------------------------------------------
# placeholder expansion: random batches
# ------------------------------------------------------------------------------------------


@st.composite
def llava_batches(draw):
    """Rows of text ids and image placeholders (right-padded with text), tiles per image,
    tokens per tile, and a seed for the tensors built from them."""
    rows = draw(
        st.lists(
            st.lists(
                st.one_of(st.integers(0, 60), st.just(IMG)), min_size=1, max_size=7
            ),
            min_size=1,
            max_size=3,
        )
    )
    text_len = max(len(row) for row in rows)
    rows = [row + [0] * (text_len - len(row)) for row in rows]
    num_images = sum(token == IMG for row in rows for token in row)
    tiles = draw(st.lists(st.integers(1, 3), min_size=num_images, max_size=num_images))
    return SimpleNamespace(
        rows=rows,
        tiles=tiles,
        img_seq_len=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def batch_tensors(case, hidden=3):
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.tensor(case.rows)
    labels = torch.randint(0, 60, ids.shape, generator=g)
    labels[torch.rand(ids.shape, generator=g) < 0.2] = IGNORE
    return SimpleNamespace(
        ids=ids,
        labels=labels,
        loss_mask=(torch.rand(ids.shape, generator=g) < 0.8).float(),
        text=torch.randn(*ids.shape, hidden, generator=g),
        # text-only batches carry an empty [0, 0, h] tensor, as LLaVAModel.forward passes it
        image=torch.randn(
            case.img_seq_len if case.tiles else 0, sum(case.tiles), hidden, generator=g
        ),
        # int32 like LLaVAModel.forward builds it; mcore's index_put rejects int64 here
        tiles=torch.tensor(case.tiles, dtype=torch.int32),
    )


def _tiles_per_row(case):
    """Each row with the tile counts of its images."""
    tiles = iter(case.tiles)
    return [(row, [next(tiles) for token in row if token == IMG]) for row in case.rows]


def reference_expansion(rows, slots_per_image, labels, loss_mask):
    """Upstream's rules (Megatron-LM ``llava_model.py``) spelled out token by token, with Python lists."""
    slots = iter(slots_per_image)
    expanded = []
    for b, row in enumerate(rows):
        ids, targets, mask, image_of_slot = [], [], [], []
        image_index = sum(token == IMG for earlier in rows[:b] for token in earlier)
        for t, token in enumerate(row):
            before_image = t + 1 < len(row) and row[t + 1] == IMG
            target = IGNORE if before_image else int(labels[b][t])
            if token == IMG:
                n = next(slots)
                ids += [IMG] * n
                targets += [IGNORE] * (n - 1) + [target]
                mask += [0.0] * n
                image_of_slot += [(image_index, k) for k in range(n)]
                image_index += 1
            else:
                ids.append(token)
                targets.append(target)
                mask.append(0.0 if before_image else float(loss_mask[b][t]))
                image_of_slot.append(None)
        expanded.append(
            SimpleNamespace(ids=ids, labels=targets, mask=mask, image_of_slot=image_of_slot)
        )
    return expanded


def mcore_preprocess(mcore_llava, t, img_seq_len, max_len=10_000, pipeline_parallel=False):
    """The installed LLaVAModel._preprocess_data, called on a stand-in for the model."""
    model = SimpleNamespace(
        add_decoder=True,
        pre_process=True,
        post_process=True,
        img_seq_len=img_seq_len,
        _language_is_pipeline_parallel=pipeline_parallel,
        _language_max_sequence_length=max_len,
        context_parallel_lm=1,
    )
    return mcore_llava.LLaVAModel._preprocess_data(
        model, t.image, t.text, t.ids, t.loss_mask, t.labels, False, None, IMG, t.tiles
    )


@fast
@given(case=llava_batches(), truncate=st.integers(0, 2), pad_to_max=st.booleans())
def test_preprocess_matches_installed_mcore(mcore_llava, case, truncate, pad_to_max):
    t = batch_tensors(case)
    longest = max(
        len(row) + sum((n * case.img_seq_len - 1) for n in tiles)
        for row, tiles in _tiles_per_row(case)
    )
    # 0: no limit; 1: a limit that cuts; 2: a limit above the longest row (padding matters)
    max_len = {0: 10_000, 1: max(1, longest - 2), 2: longest + 3}[truncate]
    e, lab, mask = mcore_preprocess(mcore_llava, t, case.img_seq_len, max_len, pad_to_max)
    ours = llava.preprocess_data(
        t.image, t.text, t.ids, t.loss_mask, t.labels, IMG, t.tiles,
        language_max_sequence_length=max_len, pad_to_language_max_sequence_length=pad_to_max,
    )
    assert torch.equal(ours.embeddings, e)
    assert torch.equal(ours.labels, lab)
    assert torch.equal(ours.loss_mask, mask)


@fast
@given(case=llava_batches())
def test_explicit_counts_match_installed_mcore_with_one_token_tiles(mcore_llava, case):
    # mcore 0.16.1 has no per-placeholder counts, but img_seq_len=1 with num_image_tiles = counts
    # expands each placeholder to exactly its count.
    t = batch_tensors(case)
    counts = t.tiles * case.img_seq_len
    hidden = t.text.shape[-1]
    g = torch.Generator().manual_seed(case.seed)
    slots = torch.randn(int(counts.sum()), hidden, generator=g)
    ours = llava.preprocess_data(
        slots, t.text, t.ids, t.loss_mask, t.labels, media_token_counts=counts
    )
    t.image = slots.unsqueeze(0) if len(counts) else torch.zeros(0, 0, hidden)
    t.tiles = counts
    e, lab, mask = mcore_preprocess(mcore_llava, t, 1)
    assert torch.equal(ours.embeddings, e)
    assert torch.equal(ours.labels, lab)
    assert torch.equal(ours.loss_mask, mask)


@fast
@given(case=llava_batches())
def test_preprocess_properties(case):
    t = batch_tensors(case)
    L = case.img_seq_len
    out = llava.preprocess_data(
        t.image, t.text, t.ids, t.loss_mask, t.labels, IMG, t.tiles, sequence_first=False
    )
    reference = reference_expansion(
        case.rows, (n * L for n in case.tiles), t.labels.tolist(), t.loss_mask.tolist()
    )
    hidden = t.text.shape[-1]
    tile_major = t.image.permute(1, 0, 2).reshape(-1, hidden)
    slots_of_image = torch.split(tile_major, [n * L for n in case.tiles])
    for b, ((row, images), expected) in enumerate(zip(_tiles_per_row(case), reference)):
        length = sum(n * L for n in images) - len(images) + len(row)
        assert len(expected.ids) == length
        assert out.input_ids[b, :length].tolist() == expected.ids
        assert out.labels[b, :length].tolist() == expected.labels
        assert out.loss_mask[b, :length].tolist() == expected.mask
        assert (out.labels[b, length:] == IGNORE).all() and (out.loss_mask[b, length:] == 0).all()
        # text keeps its order and its embeddings
        text_slots = [p for p, owner in enumerate(expected.image_of_slot) if owner is None]
        text_tokens = [t_ for t_, token in enumerate(row) if token != IMG]
        assert torch.equal(out.embeddings[b, text_slots], t.text[b, text_tokens])
        # every image slot holds its image's embeddings, tile by tile
        for p, owner in enumerate(expected.image_of_slot):
            if owner is not None:
                image_index, k = owner
                assert torch.equal(out.embeddings[b, p], slots_of_image[image_index][k])


def hf_processor_expand(row, slots):
    """What an HF processor emits: each image token repeated once per embedding."""
    ids = []
    for token in row:
        ids += [IMG] * next(slots) if token == IMG else [token]
    return ids


@fast
@given(case=llava_batches(), seed=st.integers(0, 2**31 - 1))
def test_labels_follow_hf_shift_convention(case, seed):
    """mcore_label[p] = HF_label[p+1]; mcore masks what HF trains only on last image slots."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    L = case.img_seq_len
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(case.rows)
    trained = torch.rand(ids.shape, generator=g) < 0.7  # e.g. answer tokens vs prompt tokens
    # mcore's pre-shifted data: the target at t is the next token, trained if that token is
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), 1)], dim=1)
    no_next_token = torch.zeros(ids.shape[0], 1, dtype=torch.bool)
    loss_mask = torch.cat([trained[:, 1:], no_next_token], dim=1).float()
    labels[labels == IMG] = IGNORE
    out = llava.preprocess_data(
        None, None, ids, loss_mask, labels, IMG, case.tiles, img_seq_len=L, pre_process=False
    )
    vocab = 61
    for b, (row, images) in enumerate(_tiles_per_row(case)):
        slots = [n * L for n in images]
        hf_ids = torch.tensor(hf_processor_expand(row, iter(slots)))
        n = len(hf_ids)
        # HF labels: the token itself where trained, -100 on image tokens and untrained text
        slot_trained = torch.tensor(_slot_trained(row, trained[b].tolist(), iter(slots)))
        hf_labels = torch.where(slot_trained, hf_ids, IGNORE)
        mcore_target = torch.where(out.loss_mask[b, :n] > 0, out.labels[b, :n], IGNORE)
        hf_target = torch.cat([hf_labels[1:], torch.tensor([IGNORE])])
        last_image_slot = (hf_ids == IMG) & torch.cat([hf_ids[1:] != IMG, torch.tensor([False])])
        differs = mcore_target != hf_target
        assert torch.equal(differs, last_image_slot & (hf_target != IGNORE))
        # ...although the masked last image slot still carries the next text token as its label
        next_token = torch.cat([hf_ids[1:], torch.tensor([IGNORE])])
        assert torch.equal(out.labels[b, :n][last_image_slot], next_token[last_image_slot])

        # The same statement through transformers' own causal-LM loss: identical once HF stops
        # training the token right after each image.
        logits = torch.randn(1, n, vocab, generator=g)
        hf_labels_no_post_image = hf_labels.clone()
        hf_labels_no_post_image[1:][last_image_slot[:-1]] = IGNORE
        hf_loss = ForCausalLMLoss(
            logits, hf_labels_no_post_image[None], vocab, num_items_in_batch=1
        )
        per_token = torch.nn.functional.cross_entropy(
            logits[0], out.labels[b, :n].clamp(min=0), reduction="none"
        )
        mcore_loss = (per_token * out.loss_mask[b, :n]).sum()
        torch.testing.assert_close(hf_loss, mcore_loss)


def _slot_trained(row, trained, slots):
    flags = []
    for t, token in enumerate(row):
        flags += [False] * next(slots) if token == IMG else [trained[t]]
    return flags


# ------------------------------------------------------------------------------------------
# tile tags
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tag_len", [5, 6])
def test_tile_tagging_matches_installed_mcore(mcore_llava, tag_len):
    g = torch.Generator().manual_seed(tag_len)
    embedding = torch.nn.Embedding(50, 4)
    tags = torch.randint(0, 50, (7, tag_len), generator=g).tolist()  # 6 tiles + thumbnail
    image = torch.randn(3, 4, 4, generator=g)  # [L, tiles, h]
    model = SimpleNamespace(
        _tile_tags=tags,
        # mcore's embedding is sequence first: [tag_len, tiles, h]
        language_model=SimpleNamespace(
            embedding=lambda input_ids, position_ids: embedding(input_ids).transpose(0, 1)
        ),
    )
    tiles = torch.tensor([4])
    expected = mcore_llava.LLaVAModel._apply_tile_tagging(model, image, tiles)
    got = llava.apply_tile_tagging(image, tiles, tags, embedding)
    assert got.shape == (tag_len + 3, 4, 4)
    assert torch.equal(got, expected)
    # the last tile carries the thumbnail tag, the others tile_1..tile_3
    assert torch.equal(got[:tag_len, 3], embedding(torch.tensor(tags[-1])))
    assert torch.equal(got[:tag_len, 0], embedding(torch.tensor(tags[0])))


def test_tile_tagging_several_images_tags_each_image_separately():
    embedding = torch.nn.Embedding(20, 2)
    tags = [[i] * 5 for i in range(1, 5)]  # tile_1..tile_3, thumbnail = [4]*5
    image = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(5))
    got = llava.apply_tile_tagging(image, [3, 1], tags, embedding)
    first = llava.apply_tile_tagging(image[:, :3], [3], tags, embedding)
    second = llava.apply_tile_tagging(image[:, 3:], [1], tags, embedding)
    assert torch.equal(got, torch.cat([first, second], dim=1))
    assert torch.equal(second[:5, 0], embedding(torch.tensor([4] * 5)))


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(2, 3, 2), [2]), "sum to 2 but there are 3"),
        ((torch.zeros(3, 2), [3]), "img_seq_len, num_tiles, hidden"),
        ((torch.zeros(2, 5, 2), [5]), "5 tiles"),
        ((torch.zeros(2, 1, 2), [0, 1]), "0 tiles"),
    ],
)
def test_tile_tagging_rejects(args, message):
    tags = [[1] * 5, [2] * 5, [3] * 5]
    with pytest.raises(ValueError, match=message):
        llava.apply_tile_tagging(*args, tags, torch.nn.Embedding(10, 2))


def test_tile_tagging_rejects_bad_tags_and_embeddings():
    image = torch.zeros(2, 1, 2)
    with pytest.raises(ValueError, match="equal length"):
        llava.apply_tile_tagging(image, [1], [[1] * 5, [2] * 6], torch.nn.Embedding(10, 2))
    with pytest.raises(ValueError, match="equal length"):
        llava.apply_tile_tagging(image, [1], [], torch.nn.Embedding(10, 2))
    with pytest.raises(ValueError, match="embed_tokens returned"):
        llava.apply_tile_tagging(image, [1], [[1] * 5], torch.nn.Embedding(10, 3))


@pytest.mark.parametrize(
    "prompt_format, max_num_tiles, expected",
    [
        ("llama3p1", 6, 5),
        ("chatml", 6, 5),
        ("qwen2p0", 6, 5),
        ("qwen2p5", 6, 5),
        ("qwen2p5", 12, 6),
        ("chatml", 12, 5),
        ("nemotron5", 12, 6),
        ("nemotron5-hybrid", 6, 6),
    ],
)
def test_tile_tag_token_counts_match_installed_mcore(prompt_format, max_num_tiles, expected):
    from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings

    def per_tile(tags):  # siglip, 28x28 pixels, patch 14: 4 patches per tile
        return get_num_image_embeddings(
            28, 28, 14, "siglip", False, 0, False, tags, max_num_tiles, prompt_format
        )

    assert llava.tile_tag_token_count(prompt_format, max_num_tiles) == expected
    assert per_tile(True) - per_tile(False) == expected


def test_tile_tag_token_count_rejects():
    with pytest.raises(ValueError, match="unknown prompt format"):
        llava.tile_tag_token_count("mistral")
    with pytest.raises(ValueError, match="100"):
        llava.tile_tag_token_count("chatml", 101)


def test_tile_tag_token_ids_tokenizes_and_checks_lengths():
    def fake_tokenize(text):  # BOS then one id per character, padded to a fixed length
        ids = [0] + [ord(c) for c in text]
        return (ids + [1] * 30)[:6]

    tags = llava.tile_tag_token_ids(fake_tokenize, "chatml", 2, skip_leading=1)
    assert tags == [list(map(ord, "<tile")), list(map(ord, "<tile")), list(map(ord, "<tile"))]
    assert llava.tile_tag_texts(2) == ["<tile_1>", "<tile_2>", "<tile_global_thumbnail>"]
    with pytest.raises(ValueError, match="must be 6 tokens each"):
        llava.tile_tag_token_ids(fake_tokenize, "nemotron5", 2, skip_leading=1)
    with pytest.raises(ValueError, match="max_num_tiles must be positive"):
        llava.tile_tag_texts(0)


# ------------------------------------------------------------------------------------------
# packed-sample loss weights
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "boundaries, labels, expected",
    [
        (
            [0, 2, 6, 8],
            [1, IGNORE, 2, 3, 4, 5, IGNORE, 6],
            [0.25, 0, 0.125, 0.125, 0.125, 0.125, 0, 0.25],
        ),
        ([0, 2, 4], [IGNORE, IGNORE, 1, 2], [0, 0, 0.5, 0.5]),
        ([0, 2, 9], [1, IGNORE, 2], [0.5, 0, 0.5]),
        ([0, 0, 2, 3], [1, 2, IGNORE], [0.5, 0.5, 0]),
    ],
)
def test_loss_weights_pinned(boundaries, labels, expected):
    weights = llava.precalculate_loss_weights(torch.tensor(boundaries), torch.tensor(labels))
    torch.testing.assert_close(weights, torch.tensor(expected))
    packed_row = llava.precalculate_loss_weights(boundaries, torch.tensor([labels]))
    torch.testing.assert_close(packed_row, torch.tensor([expected]))


@fast
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_loss_weights_properties(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    boundaries = [0] + torch.tensor(lengths).cumsum(0).tolist()
    labels = torch.randint(0, 9, (boundaries[-1],), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = IGNORE
    if not (labels != IGNORE).any():
        with pytest.raises(ValueError, match="every label"):
            llava.precalculate_loss_weights(boundaries, labels)
        return
    weights = llava.precalculate_loss_weights(boundaries, labels)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    assert (weights[labels == IGNORE] == 0).all()
    per_sample_valid = [
        int((labels[a:b] != IGNORE).sum()) for a, b in zip(boundaries[:-1], boundaries[1:])
    ]
    norm = sum(math.sqrt(n) for n in per_sample_valid)
    for (a, b), n in zip(zip(boundaries[:-1], boundaries[1:]), per_sample_valid):
        if n == 0:
            continue
        segment = weights[a:b][labels[a:b] != IGNORE]
        torch.testing.assert_close(segment, torch.full((n,), 1 / (math.sqrt(n) * norm)))


@pytest.mark.parametrize(
    "boundaries, labels, message",
    [
        ([0, 3], [IGNORE] * 3, "every label"),
        ([0, 2], [1, 2, 3], r"positions \[2\] lie outside"),
        ([1, 3], [1, 2, 3], r"positions \[0\] lie outside"),
        ([0], [1], "at least two"),
        ([0, 3, 2], [1, 2, 3], "non-decreasing"),
        ([-1, 3], [1, 2, 3], "non-negative"),
        ([0, 2], [[1, 2], [3, 4]], "one packed row"),
    ],
)
def test_loss_weights_reject(boundaries, labels, message):
    with pytest.raises(ValueError, match=message):
        llava.precalculate_loss_weights(boundaries, torch.tensor(labels))


# ------------------------------------------------------------------------------------------
# temporal token counts
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, frames, kwargs, expected",
    [
        ([[4, 4], [4, 4], [4, 8]], [2, 1], dict(), [8, 8]),
        ([[4, 4]] * 4, [4], dict(temporal_patch_dim=2), [8]),
        ([[4, 4]] * 2, [2], dict(spatial_merge=2), [2]),
        ([[4, 4]] * 3, [3], dict(temporal_patch_dim=2), [8]),  # ceil(3 / 2) tubelets
        ([[4, 4]] * 4, 2, dict(), [8, 8]),
        ([[4, 4], [4, 8]], None, dict(), [4, 8]),
    ],
)
def test_temporal_token_counts_pinned(sizes, frames, kwargs, expected):
    tubelets, per_item = llava.temporal_tubelet_token_counts(sizes, frames, 2, **kwargs)
    assert llava.group_temporal_token_counts_tensor(tubelets, per_item).tolist() == expected


@fast
@given(
    per_item=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouping_sums_consecutive_tubelets(per_item, seed):
    counts = torch.randint(1, 50, (sum(per_item),), generator=torch.Generator().manual_seed(seed))
    grouped = llava.group_temporal_token_counts_tensor(counts, per_item)
    expected = [int(chunk.sum()) for chunk in torch.split(counts, per_item)]
    assert grouped.tolist() == expected and grouped.dtype == counts.dtype


def test_align_counts_to_compact_and_expanded_placeholders():
    tubelets, per_item = torch.tensor([4, 4, 8]), [2, 1]
    compact = torch.tensor([[1, IMG, 2, IMG]])
    expanded = torch.tensor([[1, IMG, IMG, 2, IMG]])
    align = llava.align_temporal_token_counts_to_placeholders
    assert align(tubelets, per_item, compact, IMG).tolist() == [8, 8]
    assert align(tubelets, per_item, expanded, IMG).tolist() == [4, 4, 8]
    with pytest.raises(ValueError, match="1 placeholders match neither"):
        align(tubelets, per_item, torch.tensor([[IMG]]), IMG)


@pytest.mark.parametrize(
    "sizes, frames, kwargs, message",
    [
        (None, [2], dict(), "need imgs_sizes"),
        ([[4, 4]] * 2, [2, 0], dict(), "positive"),
        ([[4, 4]] * 2, [-2], dict(), "positive"),
        ([[4, 4]] * 2, 0, dict(), "positive"),
        ([[4, 4]] * 3, [2, 2], dict(), "sum to 4 but there are 3"),
        ([[4, 4]] * 3, 2, dict(), "do not split"),
        ([[4, 4], [4, 8]], [2], dict(temporal_patch_dim=2), "different patch grids"),
        ([[6, 4]], [1], dict(spatial_merge=2), "not divisible by the merge size"),
        ([[4, 4]], [1], dict(temporal_patch_dim=0), "positive"),
    ],
)
def test_temporal_token_counts_reject(sizes, frames, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llava.temporal_tubelet_token_counts(sizes, frames, 2, **kwargs)


@pytest.mark.parametrize(
    "per_item, message",
    [([2, 0], "positive"), ([2, 2], "sum to 4 but there are 3")],
)
def test_grouping_rejects(per_item, message):
    with pytest.raises(ValueError, match=message):
        llava.group_temporal_token_counts_tensor(torch.tensor([1, 2, 3]), per_item)
