"""The flat vector and its cut into server shards: pure functions, exact round trips."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.modes.ps.shards import assign, flatten, gradients, join, shard_bounds, split


@given(numel=st.integers(1, 10_000), shards=st.integers(1, 8))
def test_bounds_cover_the_vector_in_near_equal_contiguous_pieces(numel, shards):
    if numel < shards:
        with pytest.raises(ValueError):
            shard_bounds(numel, shards)
        return
    bounds = shard_bounds(numel, shards)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_parameters_round_trip_through_shards_unchanged(shards):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    tensors = [conv.weight, conv.bias, torch.randn(7, 5)]
    flat = flatten(tensors)
    pieces = split(flat, shard_bounds(flat.numel(), shards))
    assert len(pieces) == shards
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in pieces)  # own storage, not a view
    copies = [torch.zeros_like(t) for t in tensors]
    copies[0] = copies[0].to(memory_format=torch.channels_last)
    assign(copies, join(pieces))
    assert all(torch.equal(a, b) for a, b in zip(copies, tensors))
    assert copies[0].is_contiguous(memory_format=torch.channels_last)


def test_missing_gradient_counts_as_zero_and_sizes_must_match():
    a, b = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    (a.sum() * 2).backward()
    assert gradients([a, b]).tolist() == [2, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="4 elements"):
        assign([a.detach().clone(), b.detach().clone()], torch.zeros(4))
