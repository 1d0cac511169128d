"""The epoch sampler every recipe draws with (`packrl.data.sampler.EpochSampler`): over any data
with a length, a key and a fingerprint; drop-last (RL's prompts) or epochs run together (SFT's
traces); resumable exactly; refused on other data. RL's `PromptSampler` is tested in
tests/data/test_dataset.py."""

from __future__ import annotations

import hashlib

import pytest

from packrl.data.sampler import EpochSampler


class Items:
    """A list with what the sampler needs: a key and a fingerprint."""

    key = "sft.train_files"

    def __init__(self, values):
        self.values = list(values)

    def __len__(self):
        return len(self.values)

    def fingerprint(self):
        return hashlib.sha256(repr(self.values).encode()).hexdigest()[:16]


def _draw(sampler, k):
    return [sampler.next_indices() for _ in range(k)]


def test_without_drop_last_every_item_comes_once_per_epoch_and_a_batch_may_span_epochs():
    sampler = EpochSampler(Items(range(6)), 4, shuffle=True, seed=0, drop_last=False)
    batches = _draw(sampler, 3)  # 12 positions: two whole epochs
    flat = [i for b in batches for i in b]
    assert sorted(flat[:6]) == sorted(flat[6:]) == list(range(6))
    assert flat[:6] != flat[6:]  # each epoch reshuffled
    assert sampler.epochs_drawn == 2.0 and (sampler.epoch, sampler.index) == (1, 6)
    big = EpochSampler(Items(range(3)), 7, shuffle=False, seed=0, drop_last=False)  # a batch over the data: several epochs
    assert big.next_indices() == [0, 1, 2, 0, 1, 2, 0] and big.epochs_drawn == pytest.approx(7 / 3)


def test_drop_last_skips_the_tail_of_each_epoch():
    sampler = EpochSampler(Items(range(5)), 2, shuffle=False, seed=0)
    assert _draw(sampler, 4) == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_the_order_is_the_seed_s_and_a_resumed_sampler_continues_exactly():
    for drop_last in (True, False):
        reference = EpochSampler(Items(range(7)), 3, shuffle=True, seed=5, drop_last=drop_last)
        assert _draw(reference, 4) == _draw(EpochSampler(Items(range(7)), 3, shuffle=True, seed=5, drop_last=drop_last), 4)
        state = reference.state_dict()
        resumed = EpochSampler(Items(range(7)), 3, shuffle=True, seed=99, drop_last=drop_last)
        resumed.load_state_dict(dict(state))
        assert _draw(resumed, 5) == _draw(reference, 5)
    assert _draw(EpochSampler(Items(range(7)), 3, shuffle=True, seed=1), 3) != _draw(EpochSampler(Items(range(7)), 3, shuffle=True,
                                                                                                  seed=2), 3)


def test_a_state_for_other_data_or_without_a_position_is_refused():
    state = EpochSampler(Items("abcdef"), 2, shuffle=True, seed=0, noun="traces").state_dict()
    edited = EpochSampler(Items("abcdeX"), 2, shuffle=True, seed=0, noun="traces")
    with pytest.raises(ValueError, match=r"the traces of sft.train_files differ from the checkpoint's \(6 traces either way"):
        edited.load_state_dict(state)
    shorter = EpochSampler(Items("abcde"), 2, shuffle=True, seed=0, noun="traces")
    with pytest.raises(ValueError, match="sampler state is for 6 traces but sft.train_files now gives 5"):
        shorter.load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint holds no data position for sft.train_files"):
        edited.load_state_dict({})  # what an SFT checkpoint saved before the sampler was shared holds
    with pytest.raises(ValueError, match="cannot draw batches of 2 from 0 traces"):
        EpochSampler(Items(""), 2, shuffle=True, seed=0, noun="traces")
