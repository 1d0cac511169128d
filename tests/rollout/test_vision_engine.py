"""The HF engine with images: it generates from exactly the prompt ids and images the trainer
scores (invariant 5 with images: the engine's log-probs equal the trainer's packed ones), never
samples a vision token, and a seeded call repeats."""

from __future__ import annotations

import pytest
import torch

from packrl.models.attention import use_packed_attention
from packrl.models.vision import vision_token_ids
from packrl.rollout.engine import SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.types import PromptBatch, RolloutBatch
from tests.builders import pass_config
from tests.conftest import score_of
from tests.vlm import FAMILIES, IMAGE_SIZES, tiny_processor, tiny_vlm, vlm_prompt, vlm_tokenizer


def _setup(family: str):
    tok = vlm_tokenizer()
    model = tiny_vlm(family, tokenizer=tok)
    use_packed_attention(model)
    prompts = [vlm_prompt(tiny_processor(tok, family=family), sizes, f"Count {k}", seed=k) for k, sizes in enumerate(IMAGE_SIZES)]
    batch = PromptBatch(tuple(p for p, _ in prompts), ("0",) * 4, ("t",) * 4, (0, 1, 2, 3), (False,) * 4,
                        extra_inputs=tuple(x for _, x in prompts))
    engine = HFEngine(model, tok, max_context_tokens=4096, max_num_seqs=16, shares_policy=True)
    return tok, model, batch, engine


@pytest.fixture(scope="module")
def setup(smollm_tokenizer):
    return _setup("qwen2_vl")


def _generate(engine, batch, **params):
    sampling = SamplingParams(n=2, max_response_tokens=12, temperature=1.0, return_logprobs=True, **params)
    groups = engine.generate(batch.prompt_ids, sampling, seeds=[11, 12, 13, 14], extra_inputs=batch.extra_inputs)
    return RolloutBatch(batch, 2, tuple(r for g in groups for r in g))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_the_trainers_packed_ones(family, smollm_tokenizer):
    _, model, batch, engine = _setup(family)
    rollout = _generate(engine, batch)
    assert sum(len(r.response_ids) for r in rollout.responses) > 8
    cfg = pass_config(batch_size=4, n=2, max_prompt_tokens=256, max_response_tokens=12, update_tokens=4096)
    trainer, _ = score_of(model, rollout, cfg)
    for i, (response, lp) in enumerate(zip(rollout.responses, trainer)):
        torch.testing.assert_close(torch.tensor(response.rollout_logprobs), lp, rtol=0, atol=2e-5, msg=f"response {i}")


def test_vision_tokens_are_never_sampled(setup):
    _, model, batch, engine = setup
    banned = set(vision_token_ids(model.config))
    head = model.get_output_embeddings()
    with torch.no_grad():  # make the banned tokens the likeliest by far: a sampler that allowed them would pick them
        saved = head.weight[sorted(banned)].clone()
        head.weight[sorted(banned)] = 50 * head.weight.abs().max()
        try:
            rollout = _generate(engine, batch)
        finally:
            head.weight[sorted(banned)] = saved
    assert all(not banned & set(r.response_ids) for r in rollout.responses)


def test_a_seeded_call_repeats(setup):
    _, _, batch, engine = setup
    first, again = _generate(engine, batch), _generate(engine, batch)
    assert [r.response_ids for r in first.responses] == [r.response_ids for r in again.responses]


def test_prompts_whose_placeholders_do_not_match_their_images_are_refused(setup):
    _, _, batch, engine = setup
    params = SamplingParams(n=1, max_response_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 holds 8 image placeholder tokens but its images give 0"):
        engine.generate(batch.prompt_ids[:1], params, seeds=[1])
    with pytest.raises(ValueError, match="prompt 1 holds .* image placeholder tokens but its images give 8"):
        engine.generate(batch.prompt_ids[:2], params, seeds=[1, 2], extra_inputs=[batch.extra_inputs[0], batch.extra_inputs[0]])
