"""PPO with a critic through the trainer: the critic trains alone during critic.warmup_steps, then
both do; its checkpoint resumes exactly; a checkpoint without a critic is refused by name."""

from __future__ import annotations

import pytest

from tests.builders import metric_lines
from tests.diagnostics.tiny_run import tiny_policy, tiny_run

COMMON = ["algorithm.adv_estimator=gae", "reward.name=test_letter_e", "critic.lr=1e-3", "critic.warmup_steps=1",
          "train.save_every=2", "train.mini_batch_size=1", "train.lr=1e-2"]


@pytest.fixture
def critic_dir(tmp_path, smollm_tokenizer):
    """The tiny policy saved as a model folder, the critic's backbone (critic.model.path)."""
    smollm_tokenizer.padding_side = "left"
    path = tmp_path / "critic_init"
    tiny_policy(smollm_tokenizer).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return path


def test_ppo_with_a_critic_warms_up_trains_and_resumes_exactly(tmp_path, smollm_tokenizer, critic_dir):
    tok = smollm_tokenizer
    args = [f"critic.model.path={critic_dir}", *COMMON]
    straight, _ = tiny_run(tmp_path / "a", tok, ["train.total_steps=3", *args])
    a = metric_lines(straight)
    assert a[0]["critic/warmup"] == 1.0 and "actor/pg_loss" not in a[0]  # step 1: only the critic trains
    assert all(line["critic/grad_norm"] > 0 for line in a) and a[1]["actor/grad_norm"] > 0
    assert (straight / "checkpoints" / "step_2" / "critic.pt").is_file()
    assert "critic                    yes" in (straight / "budgets.txt").read_text()
    tiny_run(tmp_path / "b", tok, ["train.total_steps=2", *args])
    resumed, _ = tiny_run(tmp_path / "b", tok, ["train.total_steps=3", "train.resume=auto", *args])
    b = metric_lines(resumed)
    assert [line["step"] for line in b] == [1, 2, 3]
    for key in ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "critic/grad_norm", "actor/pg_loss",
                "actor/grad_norm", "critic/advantages/max"):
        assert b[2][key] == pytest.approx(a[2][key], abs=1e-6), key


def test_a_checkpoint_without_a_critic_is_refused_by_name(tmp_path, smollm_tokenizer, critic_dir):
    tok = smollm_tokenizer
    tiny_run(tmp_path, tok, ["train.total_steps=2", "train.save_every=2", "reward.name=test_letter_e"])
    with pytest.raises(ValueError, match="holds no critic"):
        tiny_run(tmp_path, tok, ["train.total_steps=3", "train.resume=auto", f"critic.model.path={critic_dir}", *COMMON])
