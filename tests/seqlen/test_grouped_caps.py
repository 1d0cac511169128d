"""A second modality's budget in the planner: grouped caps are a list, so a cap that is not the
vision-encoder patches (here a synthetic audio encoder's frames, keyed by prompt) is one more
entry, planned by every fit alongside the token budget and the image cap, from the loads a
prompt's extra inputs report (`packrl.types.ExtraInputs`) through to the packs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packrl.seqlen.balance import balance_ranks
from packrl.seqlen.microbatch import CapLimit, GroupedCap, plan_microbatches
from packrl.seqlen.packing import pack_sequences
from packrl.seqlen.update_plan import PassPlanner, PromptSharing, plan_ranks, plan_update
from packrl.types import ExtraInputs, PromptBatch, Response, RolloutBatch

AUDIO = CapLimit("audio_frames", 0, "test.max_audio_frames_per_microbatch", unit="audio-encoder frames", fix="shorten the clips")
PATCHES = CapLimit("vision_patches", 0, "train.max_vision_patches_per_microbatch", unit="vision-encoder patches")


@dataclass(frozen=True)
class AudioFrames:
    """A test modality's extra inputs: one prompt's audio clips as encoder frames (a plugin's
    `ExtraInputs`; nothing of packrl knows this class)."""

    frames: int
    tokens_per_frame: float = 0.5

    @property
    def num_tokens(self) -> int:
        return int(self.frames * self.tokens_per_frame)

    def grouped_loads(self) -> dict[str, int]:
        return {"audio_frames": self.frames}

    def to(self, device: torch.device | str) -> AudioFrames:
        return self

    @classmethod
    def batch_metrics(cls, inputs: Sequence[ExtraInputs | None], prompt_lengths: Sequence[int]) -> dict[str, float]:
        frames = [x.frames if isinstance(x, AudioFrames) else 0 for x in inputs]
        return {"prompt_length/audio_frames/mean": sum(frames) / max(1, len(frames))}


def _load(mb: Sequence[int], cap: GroupedCap) -> int:
    """Independent count of a micro-batch's load: each key's once."""
    return sum(dict((cap.keys[i], cap.loads[i]) for i in mb).values())


@st.composite
def two_cap_batches(draw, max_n: int = 32):
    """Sequences in groups of 1-4, each group's prompt with patches and frames (either may be 0)."""
    n = draw(st.integers(1, max_n))
    cap = draw(st.integers(64, 2048))
    lengths = draw(st.lists(st.integers(1, cap), min_size=n, max_size=n))
    group = draw(st.integers(1, 4))
    keys = tuple(i // group for i in range(n))
    caps = []
    for limit in (PATCHES, AUDIO):
        most = draw(st.integers(1, 400))
        per_prompt = draw(st.lists(st.one_of(st.just(0), st.integers(1, most)), min_size=n, max_size=n))
        caps.append(CapLimit(limit.name, most, limit.budget_key, limit.unit).over([per_prompt[k] for k in keys], keys))
    return lengths, cap, caps


@settings(max_examples=200, deadline=None)
@given(two_cap_batches(), st.booleans(), st.integers(1, 3))
def test_every_fit_respects_every_cap(batch, balance, num_ranks):
    lengths, cap, caps = batch
    for plan in [plan_microbatches(lengths, cap, balance=balance, caps=caps)] + (
            list(balance_ranks(lengths, num_ranks, cap, caps=caps).ranks) if len(lengths) >= num_ranks else []):
        assert all(t <= cap for t in plan.num_tokens())
        for grouped in caps:
            assert all(_load(mb, grouped) <= grouped.limit.cap for mb in plan.microbatches), grouped.limit.name
    single = plan_microbatches(lengths, cap, balance=balance, caps=caps)
    assert sorted(single.order) == list(range(len(lengths)))
    assert single.num_microbatches >= max(-(-_load(range(len(lengths)), c) // c.limit.cap) for c in caps)


@settings(max_examples=150, deadline=None)
@given(two_cap_batches(), st.integers(1, 2))
def test_shared_prompts_units_respect_every_cap(batch, num_ranks):
    """With shared prompts the planner plans groups as units (the prompt once); each micro-batch
    still stays within every grouped cap, a group cut into two units counting its load once."""
    lengths, cap, caps = batch
    if len(lengths) < num_ranks:
        return
    prompt_tokens = [max(1, n // 3) for n in lengths]
    keys = caps[0].keys
    sharing = PromptSharing(tuple(prompt_tokens[k] for k in keys), keys)
    plan = plan_ranks(lengths, num_ranks, cap, balance=True, budget_key="train.max_tokens_per_microbatch", sharing=sharing, caps=caps)
    assert sorted(i for r in plan.ranks for i in r.order) == list(range(len(lengths)))
    for rank in plan.ranks:
        for mb in rank.microbatches:
            for grouped in caps:
                assert _load(mb, grouped) <= grouped.limit.cap


def test_a_second_modality_is_one_more_cap_from_extra_inputs_to_the_plan():
    """Audio prompts report frames (`ExtraInputs.grouped_loads`); a planner with an audio cap beside
    the image one budgets them from the rollout alone, counts a group's clip once per micro-batch
    and leaves out the image cap, which no prompt reports; the packs say what they encode."""
    prompts = PromptBatch(((1, 2, 3),) * 3, ("0",) * 3, ("t",) * 3, (0, 1, 2), (False,) * 3,
                          extra_inputs=(AudioFrames(300), None, AudioFrames(250)))
    rollout = RolloutBatch(prompts, 2, tuple(Response((7,) * 5, "eos") for _ in range(6)))
    planner = PassPlanner(num_ranks=1, sequence_parallel_size=1, logprob_tokens=4096, update_tokens=4096, critic_tokens=4096,
                          balance=True, packed=True, share_prompts=False, mini_batch_prompts=3, num_epochs=1, loss_scale_factor=16,
                          caps=(CapLimit("vision_patches", 100, PATCHES.budget_key, PATCHES.unit),
                                CapLimit("audio_frames", 400, AUDIO.budget_key, AUDIO.unit)))
    loads, keys = rollout.grouped_loads()
    assert loads == {"audio_frames": [300, 300, 0, 0, 250, 250]} and keys == [0, 0, 1, 1, 2, 2]
    caps = planner.grouped_caps(loads, keys)
    assert [c.limit.name for c in caps] == ["audio_frames"]
    plan = planner.scoring(rollout.sequence_lengths(), [rollout.prompt_ids_of(i) for i in range(len(rollout))], caps)
    microbatches = [mb for mb in plan.ranks[0].microbatches if mb]
    assert len(microbatches) == 2  # 8 tokens each fit one micro-batch; 300 + 250 frames do not
    assert all(_load(mb, caps[0]) <= 400 for mb in microbatches)
    assert planner.scoring(rollout.sequence_lengths(), [rollout.prompt_ids_of(i) for i in range(6)]).num_microbatches == 1
    update = plan_update(rollout.sequence_lengths(), [5] * 6, groups=[0, 0, 1, 1, 2, 2], mini_batch_prompts=3, num_epochs=1,
                         num_ranks=1, max_tokens=4096, balance=True, loss_scale_factor=16, caps=caps)
    assert all(_load(mb, caps[0]) <= 400 for mb in update.minibatches[0].microbatches(0))
    pack = pack_sequences([[1, 2, 3, 7, 7]] * 4, extra_inputs=[rollout.extra_inputs_of(i) for i in (0, 1, 2, 3)])
    assert pack.grouped_loads() == {"audio_frames": 300}  # a group's clip once, the text prompt none
    from packrl.diagnostics.metrics import extra_input_metrics

    assert extra_input_metrics(rollout) == {"prompt_length/audio_frames/mean": pytest.approx(550 / 3)}


def test_a_sequence_over_the_audio_cap_is_named_with_the_caps_key_and_fix():
    audio = CapLimit("audio_frames", 400, AUDIO.budget_key, AUDIO.unit, AUDIO.fix).over([100, 500, 500], [0, 1, 1])
    with pytest.raises(ValueError, match=r"sequence 2 has 500 audio-encoder frames > test.max_audio_frames_per_microbatch=400; "
                                         r"raise test.max_audio_frames_per_microbatch to >= 500 or shorten the clips"):
        plan_microbatches([5, 5, 5], 100, caps=[audio])
