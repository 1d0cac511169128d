"""Vision-language packs: sequences with images of different sizes (and one without) packed
together score exactly as each alone, and the loss and gradients do not depend on the
micro-batch split or the number of ranks (tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL, whose
deepstack features ride with the pack's placeholders)."""

from __future__ import annotations

import pytest
import torch

from packrl.models.attention import packed_forward, use_packed_attention
from packrl.models.vision import sequence_positions
from packrl.seqlen.packing import pack_sequences
from tests.builders import RTOL, pass_config
from tests.conftest import minibatch_grads, score_of
from tests.vlm import FAMILIES, IMAGE_SIZES, tiny_processor, tiny_vlm, vlm_tokenizer, vlm_train_batch

WHOLE, SPLITS = 4096, (120, 200)


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return vlm_tokenizer()


@pytest.fixture(scope="module")
def batches(tok):
    """Each family's `vlm_train_batch` (float64), through its own processor."""
    return {family: vlm_train_batch(tiny_processor(tok, family=family), torch.float64) for family in FAMILIES}


@pytest.fixture(scope="module")
def batch64(batches):
    return batches["qwen2_vl"]


def _model(family, tok, dtype=torch.float32):
    model = tiny_vlm(family, tokenizer=tok, dtype=dtype)
    use_packed_attention(model)
    return model


def patch_budgets(rollout) -> tuple[int, int]:
    """Vision-patch budgets (`train.max_vision_patches_per_microbatch`) that split ``rollout``
    where the token budget alone does not: its largest prompt's patches, and those plus the
    smallest image prompt's (216 and 248 for Qwen2-VL's `vlm_train_batch`: 32, 36, 0, 216)."""
    patches = sorted({n for n in rollout.grouped_loads()[0]["vision_patches"] if n})
    return patches[-1], patches[-1] + patches[0]


def _cfg(budget: int, attention: str = "varlen", logprob_budget: int | None = None, patches: int | None = None):
    from dataclasses import replace

    cfg = pass_config(batch_size=4, n=2, max_prompt_tokens=256, max_response_tokens=16, update_tokens=budget,
                      logprob_tokens=logprob_budget or budget, attention=attention, kl_coef=0.1, entropy_coeff=0.01)
    return replace(cfg, train=replace(cfg.train, max_vision_patches_per_microbatch=patches))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["varlen", "block_mask", "position_ids"])
def test_packed_images_score_as_each_alone(family, attention, tok, batches):
    model = _model(family, tok)
    batch64 = batches[family]
    rollout = batch64.rollout
    packed, _ = score_of(model, rollout, _cfg(WHOLE, attention))
    longest = max(rollout.sequence_lengths())
    alone, _ = score_of(model, rollout, _cfg(longest, attention))  # one sequence per micro-batch
    for i, (a, b) in enumerate(zip(packed, alone)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"sequence {i} ({family}, {attention})")


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_hidden_states_equal_the_models_own_forward(family, tok, batches):
    """The pack against transformers' own forward of each sequence (its M-RoPE and image merge)."""
    model = _model(family, tok)
    batch64 = batches[family]
    rollout = batch64.rollout
    seqs = [torch.tensor(rollout.prompt_ids_of(i) + rollout.responses[i].response_ids) for i in range(len(rollout))]
    images = [rollout.extra_inputs_of(i) for i in range(len(rollout))]
    packed = packed_forward(model, pack_sequences(seqs, extra_inputs=images))
    own = []
    for ids, x in zip(seqs, images):
        extra = {} if x is None else dict(pixel_values=x.pixel_values, image_grid_thw=x.image_grid_thw,
                                          mm_token_type_ids=(ids == model.config.image_token_id).int()[None])
        own.append(model.model(input_ids=ids[None], use_cache=False, **extra).last_hidden_state[0])
    torch.testing.assert_close(packed, torch.cat(own), rtol=0, atol=1e-5)
    assert len(set(map(len, IMAGE_SIZES))) > 1  # images of different counts and sizes in one pack


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_grads_do_not_depend_on_micro_batches_or_ranks(family, tok, batches):
    batch64 = batches[family]

    def run(cfg, num_ranks):
        model = _model(family, tok, torch.float64)
        loss = minibatch_grads(model, batch64, cfg, num_ranks=num_ranks)
        grads = [(n.startswith("model.visual."), p.grad.reshape(-1)) for n, p in model.named_parameters() if p.grad is not None]
        return loss, [torch.cat([g for tower, g in grads if tower == part]) for part in (False, True)]

    loss_ref, grad_ref = run(_cfg(WHOLE), 1)
    assert all(g.abs().max() > 0 for g in grad_ref)  # the language model's and the vision tower's
    # transformers' Qwen2.5-VL and Qwen3-VL vision rotary embedding casts q and k to float32 even in a float64
    # model, so the tower's gradients round at float32 where a shared image's feature gradients
    # are summed (one encoding per pack) or not (encoded again in another micro-batch)
    tower_rtol = RTOL if family == "qwen2_vl" else 1e-4
    splits = [_cfg(budget) for budget in SPLITS] + [_cfg(WHOLE, patches=p) for p in patch_budgets(batch64.rollout)]
    for cfg in splits:
        for num_ranks in (1, 2):
            loss, grads = run(cfg, num_ranks)
            what = f"{family}: budget {cfg.train.max_tokens_per_microbatch}, patches {cfg.train.max_vision_patches_per_microbatch}"
            assert loss == pytest.approx(loss_ref, rel=RTOL), (what, num_ranks)
            torch.testing.assert_close(grads[0], grad_ref[0], rtol=RTOL, atol=1e-12, msg=f"{what}, {num_ranks} rank(s)")
            torch.testing.assert_close(grads[1], grad_ref[1], rtol=tower_rtol, atol=1e-12, msg=f"{what}, {num_ranks} rank(s), tower")


def test_the_splits_really_differ(batch64):
    from dataclasses import replace

    from packrl.config.plan import BatchPlan

    rollout = batch64.rollout
    plans = []
    budgets = patch_budgets(rollout)
    assert budgets == (216, 248)
    for cfg in [_cfg(WHOLE), *(_cfg(b) for b in SPLITS), *(_cfg(WHOLE, patches=p) for p in budgets)]:
        planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=False), num_ranks=1, num_epochs=1)
        plan = planner.update(rollout.sequence_lengths(), [len(r.response_ids) for r in rollout.responses],
                              [rollout.prompt_ids_of(i) for i in range(len(rollout))], groups=[i // 2 for i in range(len(rollout))],
                              caps=planner.grouped_caps(*rollout.grouped_loads()))
        plans.append({mb for mb in plan.minibatches[0].microbatches(0) if mb})
    token_plans = {frozenset(p) for p in plans[: 1 + len(SPLITS)]}
    assert len(plans[0]) == 1 and len(token_plans) == 1 + len(SPLITS), plans
    assert all(len(p) > 1 for p in plans[1 + len(SPLITS):]), plans  # the patch budget alone splits the batch
    patches = rollout.grouped_loads()[0]["vision_patches"]
    for p, plan in zip(budgets, plans[-len(budgets):]):  # each micro-batch: its distinct images' patches
        assert all(sum({i // 2: patches[i] for i in mb}.values()) <= p for mb in plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_group_in_one_pack_encodes_its_images_once(family, tok, batches):
    """A prompt's responses share its `ImageInputs`: the tower runs over each distinct image once,
    and the pack scores as with a copy of the images per sequence."""
    from packrl.models.image_inputs import ImageInputs

    model = _model(family, tok)
    batch64 = batches[family]
    rollout = batch64.rollout
    seqs = [torch.tensor(rollout.prompt_ids_of(i) + rollout.responses[i].response_ids) for i in range(len(rollout))]
    shared = [rollout.extra_inputs_of(i) for i in range(len(rollout))]
    copies = [None if x is None else ImageInputs(x.pixel_values.clone(), x.image_grid_thw.clone(), x.merge_size) for x in shared]
    encoded = []
    hook = model.model.visual.register_forward_hook(lambda _m, args, _out: encoded.append(int(args[0].shape[0])))
    try:
        pack = pack_sequences(seqs, extra_inputs=shared).to("cpu")
        once = packed_forward(model, pack)
        per_sequence = packed_forward(model, pack_sequences(seqs, extra_inputs=copies))
    finally:
        hook.remove()
    distinct = sum(x.num_patches for x in rollout.prompts.extra_inputs or () if x is not None)
    assert pack.grouped_loads() == {"vision_patches": distinct}
    assert encoded == [distinct, 2 * distinct]  # shared: each image once; copies: once per sequence
    torch.testing.assert_close(once, per_sequence, rtol=0, atol=1e-6)


def test_image_positions_are_m_rope_not_a_count(tok, batch64):
    """The control: an image sequence's vision rows are not 0..L-1, so a pack that forgot them would differ."""
    model = _model("qwen2_vl", tok)
    rollout = batch64.rollout
    ids = torch.tensor(rollout.prompt_ids_of(0) + rollout.responses[0].response_ids)
    positions = sequence_positions(model, ids, rollout.extra_inputs_of(0))
    assert positions.shape == (3, len(ids)) and not torch.equal(positions[1], torch.arange(len(ids)))
    assert int(positions.max()) < len(ids) - 1  # an image's tokens share positions: the text after it starts lower


def test_a_pack_whose_placeholders_do_not_match_its_images_is_refused(tok, batch64):
    model = _model("qwen2_vl", tok)
    rollout = batch64.rollout
    ids = torch.tensor(rollout.prompt_ids_of(0) + rollout.responses[0].response_ids)
    cut = ids[ids != model.config.image_token_id][:10].tolist() + ids.tolist()[-5:]  # the placeholders cut out
    with pytest.raises(ValueError, match="image placeholder tokens but the images give"):
        packed_forward(model, pack_sequences([cut], extra_inputs=[rollout.extra_inputs_of(0)]))
