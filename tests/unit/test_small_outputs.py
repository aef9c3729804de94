"""Small outputs carved from one allocation: shapes, dtypes, alignment, no overlap (torch on the CPU
stands in for a CUDA device: the views are the same)."""

from __future__ import annotations

import numpy as np
import pytest

from deepep_cupy.frameworks import BF16, BOOL, F32, I32, I64, SmallOutputs, TorchFrame, contiguous_strides

torch = pytest.importorskip("torch")


def _cpu_frame():
    return TorchFrame(0, device="cpu")


@pytest.mark.parametrize("shape", [(144, 256, 64), (128, 7168), (5,), (), (2, 0, 3), (0,)])
def test_outputs_are_contiguous_tensors_of_their_shape(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()
    frame = _cpu_frame()
    for _ in range(2):  # the second call takes the strides from the frame's cache
        t = frame.empty(shape, BF16)
        assert tuple(t.shape) == shape and t.dtype == torch.bfloat16 and t.is_contiguous()


def test_the_stride_cache_stays_bounded():
    """Received-row counts change per call: shapes past the cache's bound still get contiguous outputs."""
    from deepep_cupy.frameworks import frames

    frame = _cpu_frame()
    for rows in range(frames._MAX_CACHED_SHAPES + 20):
        t = frame.empty((rows, 3), BF16)
        assert tuple(t.shape) == (rows, 3) and t.is_contiguous()
    assert len(frame._strides) == frames._MAX_CACHED_SHAPES


@pytest.mark.parametrize("e_local,slab,ranks,scales", [(144, 256, 2, 56), (1, 1, 1, 1), (3, 17, 5, 4)])
def test_parts_are_separate_aligned_and_typed(e_local, slab, ranks, scales):
    specs = [((e_local,), I32), ((e_local, slab), I32), ((e_local, ranks), I64), ((e_local, scales, slab), F32)]
    layout = SmallOutputs(specs)
    frame = _cpu_frame()
    words = frame.empty_words(layout)
    parts = [frame.part(words, layout, i) for i in range(len(specs))]
    want_dtypes = [torch.int32, torch.int32, torch.int64, torch.float32]
    spans = []
    for t, (shape, _), dtype in zip(parts, specs, want_dtypes, strict=True):
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0 and t.data_ptr() == words.data_ptr() + layout.byte_offsets[len(spans)]
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    # Writing each part through its own view leaves the others intact.
    for i, t in enumerate(parts):
        t.fill_(i + 1)
    for i, t in enumerate(parts):
        assert np.all(t.numpy() == i + 1)


def test_only_four_and_eight_byte_parts():
    with pytest.raises(ValueError, match="int32, float32, int64 or bool"):
        SmallOutputs([((4,), np.dtype(np.uint8))])


def test_a_swapped_part_is_its_stored_part_transposed():
    """Scales come back column-major: the view of the stored ``[E, S, N]`` part with its last two
    dimensions swapped, over the same memory."""
    layout = SmallOutputs([((3,), I32), ((2, 4, 5), F32, True), ((2, 5), I64)])
    frame = _cpu_frame()
    words = frame.empty_words(layout)
    count, scales, ranges = (frame.part(words, layout, i) for i in range(3))
    assert tuple(scales.shape) == (2, 5, 4) and scales.stride() == (20, 1, 5)
    assert scales.transpose(1, 2).is_contiguous() and scales.dtype == torch.float32
    assert layout.parts[1][0] == (2, 4, 5) and layout.parts[1][2] == (20, 5, 1)
    scales.transpose(1, 2).copy_(torch.arange(40, dtype=torch.float32).view(2, 4, 5))
    assert scales[1, 3, 2].item() == 20 + 2 * 5 + 3
    assert layout.bases == [I32, F32, I64] and ranges.dtype == torch.int64 and count.dtype == torch.int32


@pytest.mark.parametrize("tokens,ranks,experts", [(0, 2, 16), (1, 1, 1), (4096, 8, 256), (37, 3, 24)])
def test_bool_parts_sit_on_their_own_bytes(tokens, ranks, experts):
    """The layout's outputs in one allocation: two int32 counts and a bool matrix, each aligned, each
    writable without touching the others."""
    layout = SmallOutputs([((ranks,), I32), ((experts,), I32), ((tokens, ranks), BOOL)])
    frame = _cpu_frame()
    words = frame.empty_words(layout)
    per_rank, per_expert, in_rank = (frame.part(words, layout, i) for i in range(3))
    assert in_rank.dtype == torch.bool and tuple(in_rank.shape) == (tokens, ranks) and in_rank.is_contiguous()
    for t, off in zip((per_rank, per_expert, in_rank), layout.byte_offsets, strict=True):
        assert off % 64 == 0 and (t.numel() == 0 or t.data_ptr() == words.data_ptr() + off)
    assert words.numel() * 4 >= layout.byte_offsets[2] + tokens * ranks
    per_rank.fill_(-7)
    per_expert.fill_(11)
    in_rank.fill_(True)
    assert bool(torch.all(per_rank == -7)) and bool(torch.all(per_expert == 11)) and bool(torch.all(in_rank))
