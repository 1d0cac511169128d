"""The policy-loss family against hand-computed values: GSPO's sequence ratio, rollout correction
(truncated token weights, geometric-mean rejection that does not depend on length), the entropy
filter's counts, Clip-Cov / KL-Cov token selection and losses, and the config refusals."""

from __future__ import annotations

import math

import pytest
import torch

from packrl.algos.cov_losses import SELECTED, clip_cov, kl_cov, pick_tokens, select_cov_tokens, token_covariance
from packrl.algos.entropy_filter import EntropyFilterOptions, apply_entropy_filter, entropy_keep
from packrl.algos.policy_losses import PolicyLossInputs, gspo, loss_options
from packrl.algos.rollout_correction import apply_rollout_correction, geometric_mean_ratio, rollout_is_weights, weighted_token_loss
from packrl.config import ConfigError, load_config
from packrl.config.algorithm_variants import RolloutCorrectionConfig
from packrl.config.critic import CriticConfig
from packrl.config.plan import BatchPlan
from packrl.config.schema import AlgorithmConfig, DataConfig, RolloutConfig, RunConfig, TrainConfig
from packrl.rollout.engine import SamplingParams
from packrl.seqlen.denominators import LossDenominators
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch

T = torch.tensor


def _inputs(logprobs, old, advantages, mask, seq, cfg: AlgorithmConfig, extras=None, options=None) -> PolicyLossInputs:
    mask = T(mask)
    den = LossDenominators.from_masks([mask], loss_scale_factor=8)
    return PolicyLossInputs(logprobs=logprobs, old_logprobs=T(old), advantages=T(advantages), loss_mask=mask,
                            sequence_ids=T(seq), denominators=den, cfg=cfg, extras=extras or {}, options=options)


# --- GSPO -------------------------------------------------------------------------------------

def test_gspo_uses_the_length_normalised_sequence_ratio():
    # sequence 0: three loss tokens, log-ratios 0.2, -0.1, 0 -> s0 = exp(0.1 / 3)
    # sequence 1: log-ratios 0.2 and (masked) 4.3 -> s1 = exp(0.2): the masked token is not in the mean
    logprobs = T([-1.0, -2.0, -0.5, -0.3, -0.7], requires_grad=True)
    inputs = _inputs(logprobs, [-1.2, -1.9, -0.5, -0.5, -5.0], [1.0, 1.0, 1.0, -2.0, -2.0],
                     [True, True, True, True, False], [0, 0, 0, 1, 1], AlgorithmConfig(clip_ratio_low=0.5, clip_ratio_high=0.5))
    out = gspo(inputs)
    s0, s1 = math.exp(0.1 / 3), math.exp(0.2)
    expected = T([-s0, -s0, -s0, 2 * s1, 2 * s1])
    torch.testing.assert_close(out.token_loss.detach(), expected)
    assert not out.clipped.any()
    out.token_loss.sum().backward()
    # d/d logp_t of s_i,t = sg(s_i) exp(logp_t - sg(logp_t)) is s_i: each token's gradient is -A_t s_i
    torch.testing.assert_close(logprobs.grad, T([-s0, -s0, -s0, 2 * s1, 2 * s1]))


def test_gspo_clips_the_sequence_ratio_at_the_papers_ranges():
    logprobs = T([-1.0, -2.0, -0.3], requires_grad=True)
    inputs = _inputs(logprobs, [-1.0 - 1e-3, -2.0 - 1e-3, -0.3], [1.0, 1.0, -1.0], [True, True, True], [0, 0, 1],
                     AlgorithmConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4))
    out = gspo(inputs)
    # s0 = exp(1e-3) > 1 + 4e-4 with A > 0: clipped at 1.0004 (no gradient); s1 = 1: not clipped
    torch.testing.assert_close(out.token_loss.detach(), T([-1.0004, -1.0004, 1.0]))
    assert out.clipped.tolist() == [True, True, False]
    out.token_loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 1.0])


# --- rollout correction -----------------------------------------------------------------------

def test_truncated_importance_weights():
    w = rollout_is_weights(T([-1.0, -2.0, -3.0]), T([-1.5, -1.9, -1.0]), threshold=1.5)
    torch.testing.assert_close(w, T([1.5, math.exp(-0.1), math.exp(-2.0)]))
    loss = T([2.0, 2.0, 2.0])
    torch.testing.assert_close(weighted_token_loss(loss, {"rollout_is_weights": w}), 2.0 * w)
    assert weighted_token_loss(loss, {}) is loss


def test_geometric_mean_ratio_by_hand():
    rho = geometric_mean_ratio(T([-1.0, -2.0, -3.0, -4.0]), T([-1.1, -2.0, -3.3, 0.0]), T([True, True, True, False]))
    assert rho == pytest.approx(math.exp((0.1 + 0.0 + 0.3) / 3))
    assert geometric_mean_ratio(T([-1.0]), T([-1.0]), T([False])) is None
    # each token's log-ratio is clamped to +-20 before the mean, as verl's seq_mean_k1: (20 + 0) / 2, not min(35/2, 20)
    assert geometric_mean_ratio(T([-1.0, -1.0]), T([-36.0, -1.0]), T([True, True])) == pytest.approx(math.exp(10.0))


def _responses(diffs_per_response: list[list[float]]) -> tuple[list[Response], list[torch.Tensor]]:
    """Responses whose engine log-prob is -1 - diff at each token and whose old log-prob is -1."""
    responses, old = [], []
    for diffs in diffs_per_response:
        responses.append(Response(tuple(range(len(diffs))), "eos", rollout_logprobs=tuple(-1.0 - d for d in diffs)))
        old.append(torch.full((len(diffs),), -1.0))
    return responses, old


def test_a_long_and_a_short_response_with_the_same_token_ratios_get_the_same_decision():
    short, long = [0.004, 0.006], [0.004, 0.006] * 200  # geometric mean exp(0.005) for both; the product differs by e^1.98
    responses, old = _responses([short, long])
    masks = [torch.ones(2, dtype=torch.bool), torch.ones(400, dtype=torch.bool)]
    for upper, kept in ((1.004, False), (1.006, True)):
        cfg = RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=upper)
        out, _, metrics = apply_rollout_correction(responses, old, masks, cfg)
        assert [bool(m.all()) for m in out] == [kept, kept], upper
        assert [bool(m.any()) for m in out] == [kept, kept]
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == (0.0 if kept else 1.0)


def test_rejection_removes_tokens_from_the_loss_and_counts_them():
    responses, old = _responses([[0.0, 0.0, 0.0], [0.5, 0.5], [-0.5, -0.5, -0.5, -0.5], [0.0]])
    masks = [T([True, True, False]), T([True, True]), T([True, True, True, True]), T([True])]
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="geometric", rollout_rs_threshold=1.1)
    out, extras, metrics = apply_rollout_correction(responses, old, masks, cfg)
    # rho = 1, e^0.5 (> 1.1: rejected), e^-0.5 (< 1/1.1: rejected), 1
    assert [m.tolist() for m in out] == [[True, True, False], [False, False], [False] * 4, [True]]
    assert metrics["seqlen/masked_tokens/rollout_rs"] == 6.0
    assert metrics["seqlen/masked_sequences/rollout_rs"] == 2.0
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.5
    weights = extras["rollout_is_weights"]
    torch.testing.assert_close(weights[1], T([1.5, 1.5]))  # exp(0.5) = 1.65 truncated at 1.5
    torch.testing.assert_close(weights[2], torch.full((4,), math.exp(-0.5)))
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0)  # over the kept loss tokens: all weight 1
    assert metrics["rollout_corr/rollout_rs_mean"] == pytest.approx((2 + math.exp(0.5) + math.exp(-0.5)) / 4)


def test_rollout_correction_is_a_no_op_when_off_and_needs_engine_logprobs():
    responses, old = _responses([[0.3, 0.3]])
    masks = [torch.ones(2, dtype=torch.bool)]
    assert apply_rollout_correction(responses, old, masks, RolloutCorrectionConfig()) == (tuple(masks), {}, {})
    bare = [Response((1, 2), "eos")]
    with pytest.raises(ValueError, match="engine's log-probs"):
        apply_rollout_correction(bare, old, masks, RolloutCorrectionConfig(rollout_is="token"))


# --- entropy filter ---------------------------------------------------------------------------

def test_entropy_keep_docstring_table():
    cfg = EntropyFilterOptions(quantile=0.5)
    assert entropy_keep([0.1, 0.9, 0.5, 0.7], [True, True, True, False], cfg) == [False, True, True, True]
    assert entropy_keep([0.1, 0.9, 0.5, 0.7], [True] * 4, EntropyFilterOptions(threshold=0.5)) == [False, True, True, True]
    assert entropy_keep([0.5, 0.5, 0.5], [True] * 3, EntropyFilterOptions(quantile=0.34)) == [True, True, False]  # ties: earlier first


def test_entropy_filter_counts_and_masks():
    entropy = [T([0.1, 0.1, 9.0]), T([2.0, 2.0]), T([1.0, 1.0, 1.0]), T([5.0])]
    policy = [T([True, True, False]), T([True, True]), T([True, True, True]), T([True])]  # response 0's 9.0 is a tool token
    masks = [T([True, True, False]), T([True, False]), T([True, True, True]), T([False])]  # response 3 already has none
    out, metrics = apply_entropy_filter(entropy, policy, masks, EntropyFilterOptions(threshold=1.5))
    assert [m.tolist() for m in out] == [[False, False, False], [True, False], [False, False, False], [False]]
    assert metrics["seqlen/masked_tokens/entropy"] == 5.0
    assert metrics["seqlen/masked_sequences/entropy"] == 2.0
    assert metrics["entropy_filter/mean_entropy"] == pytest.approx((0.1 + 2.0 + 1.0) / 3)
    out, metrics = apply_entropy_filter(entropy, policy, masks, EntropyFilterOptions(quantile=0.5))  # ceil(0.5 x 3) = 2 kept
    assert [bool(m.any()) for m in out] == [False, True, True, False]
    assert metrics["seqlen/masked_sequences/entropy"] == 1.0
    with pytest.raises(ValueError, match="entropy"):
        apply_entropy_filter(None, policy, masks, EntropyFilterOptions(threshold=1.0))


# --- Clip-Cov / KL-Cov ------------------------------------------------------------------------

def _cov_batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lens = [5, 3, 7, 4]
    prompts = PromptBatch(((1, 2), (3,)), ("0", "0"), ("t", "t"), (0, 1), (False, False))
    rollout = RolloutBatch(prompts, 2, tuple(Response(tuple(range(n)), "eos") for n in lens))
    rewards = torch.zeros(4)
    masks = tuple(torch.rand(n, generator=g) > 0.2 for n in lens)
    return TrainBatch(ScoredBatch(rollout, rewards, rewards), tuple(torch.randn(n, generator=g) for n in lens), masks,
                      tuple(-1.0 + torch.randn(n, generator=g) for n in lens), None)


def _reference_cov(batch: TrainBatch, indices) -> tuple[list[tuple[int, int]], list[float]]:
    """(sequence, position) of every loss token of the mini-batch and its covariance, by hand."""
    where = [(i, t) for i in indices for t in range(len(batch.loss_masks[i])) if batch.loss_masks[i][t]]
    a = [float(batch.advantages[i][t]) for i, t in where]
    lp = [float(batch.old_logprobs[i][t]) for i, t in where]
    ma, ml = sum(a) / len(a), sum(lp) / len(lp)
    return where, [(x - ma) * (y - ml) for x, y in zip(a, lp)]


def test_kl_cov_selects_the_top_covariance_tokens_of_each_mini_batch():
    batch = _cov_batch()
    cfg = AlgorithmConfig(policy_loss="kl_cov", policy_loss_args={"kl_cov_ratio": 0.25})
    out, metrics = select_cov_tokens(batch, [(0, 1), (2, 3)], cfg, seed=0)
    for indices in ((0, 1), (2, 3)):
        where, cov = _reference_cov(batch, indices)
        k = max(1, int(len(cov) * 0.25))
        top = sorted(range(len(cov)), key=lambda j: -cov[j])[:k]
        expected = {where[j] for j in top}
        got = {(i, t) for i in indices for t in range(len(out.extras[SELECTED][i])) if out.extras[SELECTED][i][t]}
        assert got == expected
    total = sum(int(m.sum()) for m in batch.loss_masks)
    assert metrics["actor/cov_selected_fraction"] == pytest.approx(sum(int(s.sum()) for s in out.extras[SELECTED]) / total)


def test_clip_cov_draws_among_the_candidates_reproducibly():
    batch = _cov_batch(1)
    cfg = AlgorithmConfig(policy_loss="clip_cov", policy_loss_args=dict(clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=0.5))
    first, metrics = select_cov_tokens(batch, [(0, 1, 2, 3)], cfg, seed=7)
    again, _ = select_cov_tokens(batch, [(0, 1, 2, 3)], cfg, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first.extras[SELECTED], again.extras[SELECTED]))
    where, cov = _reference_cov(batch, (0, 1, 2, 3))
    candidates = {where[j] for j, c in enumerate(cov) if -0.5 < c < 0.5}
    got = {(i, t) for i in range(4) for t in range(len(first.extras[SELECTED][i])) if first.extras[SELECTED][i][t]}
    assert got <= candidates and len(got) == min(len(candidates), max(1, int(len(cov) * 0.2)))
    assert metrics["actor/cov_candidate_fraction"] == pytest.approx(len(candidates) / len(cov))
    cov_t = token_covariance(T([1.0, 2.0, 3.0]), T([0.0, 0.0, 3.0]))
    torch.testing.assert_close(cov_t, T([1.0, 0.0, 2.0], dtype=torch.float64))  # means 2 and 1
    assert pick_tokens(torch.zeros(0, dtype=torch.float64), loss_options(cfg), torch.Generator()).numel() == 0


def test_cov_losses_match_the_formulas():
    logprobs = T([-1.0, -2.0, -0.5, -0.3], requires_grad=True)
    old, adv = [-1.1, -1.5, -0.5, -0.3], [1.0, -1.0, 2.0, 0.5]
    chosen = T([True, False, True, False])
    cfg = AlgorithmConfig(policy_loss="kl_cov", policy_loss_args={"ppo_kl_coef": 0.5})
    out = kl_cov(_inputs(logprobs, old, adv, [True] * 4, [0, 0, 1, 1], cfg, {SELECTED: chosen}, loss_options(cfg)))
    ratio = [math.exp(a - b) for a, b in zip([-1.0, -2.0, -0.5, -0.3], old)]
    expected = [-a * r for a, r in zip(adv, ratio)]
    expected[0] += 0.5 * 0.1  # |logp - old| at the selected tokens
    torch.testing.assert_close(out.token_loss.detach(), T(expected))
    assert out.clipped is None
    cfg = AlgorithmConfig(policy_loss="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.2)
    out = clip_cov(_inputs(logprobs, old, adv, [True] * 4, [0, 0, 1, 1], cfg, {SELECTED: chosen}))
    # token 1: r = e^-0.5 = 0.61 < 0.8 with A < 0: PPO-clipped; tokens 0 and 2 selected: zero loss
    torch.testing.assert_close(out.token_loss.detach(), T([0.0, 0.8, 0.0, -0.5]))
    assert out.clipped.tolist() == [True, True, True, False]
    out.token_loss.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5])
    with pytest.raises(ValueError, match="token selection"):
        clip_cov(_inputs(logprobs, old, adv, [True] * 4, [0, 0, 1, 1], cfg))


# --- config -----------------------------------------------------------------------------------

def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("demo", list(overrides))
    return str(err.value)


def test_refusals_name_the_key_the_value_and_the_fix():
    text = _problems("algorithm.policy_loss=gspo", "trainer.num_workers=2", "trainer.sequence_parallel_size=2")
    assert "algorithm.policy_loss='gspo'" in text and "trainer.sequence_parallel_size=1" in text
    text = _problems("algorithm.policy_loss=gspo", "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.context_policy=rolling")
    assert "context_policy=end" in text
    assert ("algorithm.policy_loss_args.kl_cov_ratio=0.001: unknown key: algorithm.policy_loss=ppo_clip does not read it, kl_cov does; "
            "fix: set algorithm.policy_loss=kl_cov") in _problems("algorithm.policy_loss_args.kl_cov_ratio=0.001")
    assert "algorithm.policy_loss_args={'kl_cov_ratio': 0.001}: has no effect" in _problems("algorithm.policy_loss=gspo",
                                                                                           "algorithm.policy_loss_args.kl_cov_ratio=0.001")
    text = _problems("algorithm.policy_loss=kl_cov", "algorithm.policy_loss_args.clip_cov_ub=7")
    assert ("algorithm.policy_loss_args.clip_cov_ub=7: unknown key: algorithm.policy_loss=kl_cov does not read it, clip_cov does; "
            "fix: set algorithm.policy_loss=clip_cov, or remove algorithm.policy_loss_args.clip_cov_ub") in text
    text = _problems("algorithm.policy_loss=kl_cov", "algorithm.policy_loss_args.clip_cov_ubb=7")
    assert "algorithm.policy_loss_args.clip_cov_ubb=7: unknown key; fix: valid keys here: kl_cov_ratio, ppo_kl_coef" in text
    assert "must be in (0, 1]" in _problems("algorithm.policy_loss=kl_cov", "algorithm.policy_loss_args.kl_cov_ratio=0")
    assert "< algorithm.policy_loss_args.clip_cov_ub" in _problems("algorithm.policy_loss=clip_cov",
                                                                   "algorithm.policy_loss_args.clip_cov_lb=6")
    assert "must be a number" in _problems("algorithm.policy_loss=clip_cov", "algorithm.policy_loss_args.clip_cov_lb=abc")
    assert "did you mean algorithm.policy_loss_args.clip_cov_ub? (an option of algorithm.policy_loss=clip_cov)" in _problems(
        "algorithm.clip_cov_ub=7")
    assert "rollout_rs_threshold=1.001" in _problems("algorithm.rollout_correction.rollout_rs=geometric")
    assert "must be a finite number > 1" in _problems("algorithm.rollout_correction.rollout_is=token",
                                                      "algorithm.rollout_correction.rollout_is_threshold=0.9")
    assert "has no effect" in _problems("algorithm.rollout_correction.rollout_rs_threshold=1.01")
    assert "has no effect" in _problems("algorithm.rollout_correction.rollout_is_threshold=3")
    assert "must be in (0, 1)" in _problems("algorithm.rollout_correction.rollout_rs=geometric",
                                            "algorithm.rollout_correction.rollout_rs_threshold=1.01",
                                            "algorithm.rollout_correction.rollout_rs_threshold_lower=1.5")
    assert "sets both of threshold and quantile" in _problems("algorithm.filters.entropy.threshold=0.5",
                                                              "algorithm.filters.entropy.quantile=0.5")
    assert "sets neither of threshold and quantile" in _problems("algorithm.filters.entropy={}")
    assert "must be in (0, 1]" in _problems("algorithm.filters.entropy.quantile=0")
    assert "nats >= 0" in _problems("algorithm.filters.entropy.threshold=-1")


@pytest.mark.parametrize("algorithm", [
    dict(policy_loss="kl_cov"), dict(policy_loss="clip_cov"), dict(filters={"entropy": {"quantile": 0.5}}),
    dict(rollout_correction=RolloutCorrectionConfig(rollout_is="token")),
    dict(rollout_correction=RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.001)),
])
def test_features_that_read_the_old_pass_turn_it_on(algorithm):
    plan = BatchPlan.from_config(RunConfig(algorithm=AlgorithmConfig(**algorithm)))
    assert plan.needs_old_logprobs
    reason = {"rollout_correction": "rollout_correction", "filters": "algorithm.filters.entropy reads their entropy",
              "policy_loss": f"algorithm.policy_loss={algorithm.get('policy_loss')} reads them"}[next(iter(algorithm))]
    assert f"yes ({plan.old_logprobs_reason})" in plan.summary() and reason in plan.old_logprobs_reason
    on = "rollout_correction" in algorithm
    assert plan.return_logprobs == on
    cfg = RolloutConfig()  # the features are the algorithm's; the rollout section is the default one
    assert SamplingParams.from_config(cfg, return_logprobs=plan.return_logprobs).return_logprobs == on
    assert not SamplingParams.from_config(cfg, validation=True, return_logprobs=True).return_logprobs


def test_defaults_keep_the_on_policy_shortcut():
    plan = BatchPlan.from_config(RunConfig(algorithm=AlgorithmConfig(policy_loss="gspo")))
    assert not plan.needs_old_logprobs and not plan.return_logprobs and plan.old_logprobs_reason == ""


def test_the_batch_plan_names_what_makes_the_update_off_policy():
    plan = BatchPlan.from_config(RunConfig(data=DataConfig(batch_size=8), train=TrainConfig(ppo_epochs=2, mini_batch_size=4)))
    assert plan.old_logprobs_reason == "train.ppo_epochs=2; train.mini_batch_size=4 < data.batch_size=8"
    critic = BatchPlan.from_config(RunConfig(critic=CriticConfig(enable=True))).summary()
    assert "yes (a value model; advantages: algorithm.adv_estimator=grpo)" in critic
