"""The trainer's micro-batch iterator: with data parallelism the ranks read disjoint shares of each
global batch, every sample once, and a resumed iterator continues where the uninterrupted one is."""

from __future__ import annotations

import itertools

import pytest
import torch

from primus_fp8_plugin.training.data import batches


class Indexed:
    """A stand-in dataset whose sample i holds i in every field."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: torch.tensor([i]) for k in ("tokens", "labels", "loss_mask", "position_ids")}


def read(it, count):
    return [int(b["tokens"][j, 0]) for b in itertools.islice(it, count) for j in range(b["tokens"].shape[0])]


@pytest.mark.parametrize("dp, mbs, n_micro", [(2, 4, 1), (2, 2, 3), (4, 1, 2), (1, 3, 2)])
def test_data_parallel_ranks_read_each_global_batch_once(dp, mbs, n_micro):
    gbs, steps = dp * mbs * n_micro, 5
    share = mbs * n_micro
    seen = []
    for step in range(steps):
        per_rank = []
        for rank in range(dp):
            it = batches(Indexed(10_000), mbs, rank * share, per_step=share, stride=gbs)
            per_rank.append(read(it, n_micro * (step + 1))[-share:])  # this rank's share at this step
        assert sorted(itertools.chain(*per_rank)) == list(range(step * gbs, (step + 1) * gbs))
        seen += itertools.chain(*per_rank)
    assert len(set(seen)) == steps * gbs


def test_a_resumed_iterator_continues_the_uninterrupted_one():
    dp, mbs, n_micro, gbs = 2, 2, 2, 8
    for rank in range(dp):
        full = read(batches(Indexed(1000), mbs, rank * 4, per_step=4, stride=gbs), 6 * n_micro)
        consumed = 3 * gbs  # resumed after 3 steps
        rest = read(batches(Indexed(1000), mbs, consumed + rank * 4, per_step=4, stride=gbs), 3 * n_micro)
        assert full[3 * 4 :] == rest


def test_default_is_contiguous_and_bad_shares_are_refused():
    assert read(batches(Indexed(7), 3, 2), 3) == [2, 3, 4, 5, 6, 0, 1, 2, 3]  # wraps around the dataset
    with pytest.raises(ValueError, match="per_step=3 must be a multiple of micro_batch_size=2"):
        next(batches(Indexed(7), 2, 0, per_step=3, stride=4))
