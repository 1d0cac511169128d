"""End to end with a tiny random Qwen2-VL saved with its processor: `packrl train vision_demo`
through the CLI, images in every prompt, the engine's log-probs equal to the trainer's (they score
the same prompt ids and images), the vision tower frozen, an over-budget row resized."""

from __future__ import annotations

import json

import pytest
import torch

from packrl.cli.main import main
from tests.vlm import save_tiny_vlm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def vlm25_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm25") / "tiny-qwen2.5-vl", family="qwen2_5_vl")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_demo_trains_two_steps(tmp_path, vlm_dir, vlm25_dir, family):
    vlm_dir = {"qwen2_vl": vlm_dir, "qwen2_5_vl": vlm25_dir}.get(family) or save_tiny_vlm(tmp_path / "tiny-qwen3-vl", family=family)
    run = tmp_path / "run"
    code = main(["train", "vision_demo", f"model.path={vlm_dir}", "train.total_steps=2", f"train.out_dir={run}",
                 "model.dtype=fp32", "rollout.return_logprobs=true", "data.shapes.num_rows=16", "train.save_every=2",
                 "algorithm.entropy_coeff=0.01", "train.lr=1e-3"])  # random rewards are all 0: the entropy term moves the weights
    assert code == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        # a 112 x 112 image: (112 / 28)^2 tokens; Qwen3-VL resizes it to 128 x 128: (128 / 32)^2
        assert line["prompt_length/vision_tokens/mean"] == 16
        assert line["prompt_length/text_tokens/mean"] + 16 == line["prompt_length/mean"]
        assert line["prompt_length/num_images/mean"] == 1
        assert line["training/rollout_probs_diff_max"] < 1e-4  # the engine and the trainer saw the same prompts and images
    from safetensors.torch import load_file

    before, after = load_file(vlm_dir / "model.safetensors"), load_file(next(run.glob("checkpoints/step_2")) / "model.safetensors")
    visual = [k for k in after if ".visual." in f".{k}"]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)  # model.freeze_vision_tower
    assert any(not torch.equal(before[k], after[k]) for k in after if k not in visual)


def test_a_prompt_over_budget_is_resized_and_counted(tmp_path, vlm_dir):
    run = tmp_path / "run"
    code = main(["train", "vision_demo", f"model.path={vlm_dir}", "train.total_steps=1", f"train.out_dir={run}",
                 "data.shapes.image_size=448", "data.max_image_tokens=null", "data.max_prompt_tokens=60",
                 "data.overlong_prompt=middle", "data.shapes.num_rows=8", "data.batch_size=2", "rollout.n=2"])
    assert code == 0
    accounting = json.loads((run / "data_accounting.json").read_text())["train"]
    assert accounting["totals"]["num_truncated"] == 8
    assert all("images resized" in row["reason"] for row in accounting["rows"])
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert line["prompt_length/max"] <= 60 and line["prompt_length/vision_tokens/mean"] < 64  # 64: the processor's own cap


def test_preflight_reports_image_tokens_and_what_cannot_run(vlm_dir):
    from packrl.inspect.preflight import preflight

    report = preflight("vision_demo", [f"model.path={vlm_dir}"])
    assert report.ok
    (note,) = [n for n in report.notes if n.startswith("vision-language model")]
    assert "224x224 -> 196x196: 51 tokens, 196 encoder patches, 141 of data.max_prompt_tokens=192 left for text" in note
    refused = preflight("vision_demo", [f"model.path={vlm_dir}", "rollout.engine=vllm", "algorithm.adv_estimator=gae"])
    by_key = {p.key: p for p in refused.problems}
    assert "does not generate from images" in by_key["rollout.engine"].message and by_key["rollout.engine"].fix == "set rollout.engine=hf"
    assert "needs a critic, which does not read images" in by_key["algorithm.adv_estimator"].message
    tight = preflight("vision_demo", [f"model.path={vlm_dir}", "data.max_prompt_tokens=8"])
    assert any(p.key == "data.max_prompt_tokens" and "no room for text beside the chat template" in p.message for p in tight.problems)
    lora = preflight("vision_demo", [f"model.path={vlm_dir}", "model.lora.rank=8", "model.freeze_vision_tower=false"])
    assert any(p.key == "model.freeze_vision_tower" and "has no effect with model.lora.rank > 0" in p.message for p in lora.problems)


def test_a_vision_run_resumes_and_its_checkpoint_loads_as_a_model(tmp_path, vlm_dir):
    run = tmp_path / "run"
    common = ["train", "vision_demo", f"model.path={vlm_dir}", f"train.out_dir={run}", "model.dtype=fp32", "data.shapes.num_rows=16",
              "train.save_every=1", "algorithm.entropy_coeff=0.01", "train.lr=1e-3"]
    assert main([*common, "train.total_steps=1"]) == 0
    assert main([*common, "train.total_steps=2", "train.resume=auto"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    step = run / "checkpoints" / "step_2"
    assert (step / "processor_config.json").is_file()
    again = tmp_path / "from_checkpoint"
    assert main(["train", "vision_demo", f"model.path={step}", f"train.out_dir={again}", "train.total_steps=1",
                 "data.shapes.num_rows=8"]) == 0


def test_lora_with_an_unfrozen_tower_is_refused_at_set_up(tmp_path, vlm_dir):
    from packrl.config import ConfigError, load_config
    from packrl.trainer.loop import train

    cfg = load_config("vision_demo", [f"model.path={vlm_dir}", f"train.out_dir={tmp_path / 'run'}", "model.dtype=fp32",
                                      "data.shapes.num_rows=8", "model.lora.rank=4", "model.freeze_vision_tower=false"])
    with pytest.raises(ConfigError, match=r"model.freeze_vision_tower=False: has no effect with model.lora.rank > 0.*fix: set "
                                          r"model.freeze_vision_tower=true"):
        train(cfg)


def test_the_vision_patch_budget_plans_the_micro_batches(tmp_path, vlm_dir):
    """train.max_vision_patches_per_microbatch: a 112 x 112 image is 16 tokens = 64 patches, so a
    64-patch budget holds one prompt's image per micro-batch (its 4 responses share one encoding),
    where the token budget alone packs the whole step into one; images too big for it are resized."""
    runs = {}
    for cap in ("null", "64"):
        run = tmp_path / f"run_{cap}"
        assert main(["train", "vision_demo", f"model.path={vlm_dir}", "train.total_steps=1", f"train.out_dir={run}",
                     "data.shapes.num_rows=8", f"train.max_vision_patches_per_microbatch={cap}"]) == 0
        runs[cap] = run, json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    (_, free), (capped_run, capped) = runs["null"], runs["64"]
    assert free["seqlen/num_microbatches"] == 1 and free["seqlen/microbatch_vision_patches_max"] == 4 * 64
    assert capped["seqlen/num_microbatches"] == 4 and capped["seqlen/microbatch_vision_patches_max"] == 64
    budgets = (capped_run / "budgets.txt").read_text()
    assert "<= 64 per micro-batch per rank" in budgets and "vision (data.train_files): prompt tokens per prompt" in budgets
    small = tmp_path / "small"
    assert main(["train", "vision_demo", f"model.path={vlm_dir}", "train.total_steps=1", f"train.out_dir={small}",
                 "data.shapes.num_rows=8", "data.shapes.image_size=224", "train.max_vision_patches_per_microbatch=64"]) == 0
    line = json.loads((small / "metrics.jsonl").read_text().splitlines()[0])
    assert line["prompt_length/vision_patches/mean"] <= 64 and line["seqlen/microbatch_vision_patches_max"] <= 64


def test_preflight_sizes_images_under_the_patch_budget(vlm_dir):
    from packrl.inspect.preflight import preflight

    report = preflight("vision_demo", [f"model.path={vlm_dir}", "train.max_vision_patches_per_microbatch=100"])
    (note,) = [n for n in report.notes if n.startswith("vision-language model")]
    assert "224x224 -> 140x140: 27 tokens, 100 encoder patches" in note  # 25 placeholders x 4 patches
    refused = preflight("vision_demo", [f"model.path={vlm_dir}", "train.max_vision_patches_per_microbatch=8"])
    assert any(p.key == "train.max_vision_patches_per_microbatch" for p in refused.problems)
