"""A tiny random-model training run (SmolLM2's tokenizer, 2-layer Llama) for the diagnostics tests.

Run as a script (``python -m tests.diagnostics.tiny_run OUT_DIR STEPS``) it trains until killed
or done, for the kill -9 test.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoTokenizer, LlamaForCausalLM

from packrl.config import load_config
from packrl.distributed.group import WorkerGroup
from packrl.distributed.local import local_group
from packrl.reward import REWARDS, register_reward
from packrl.testing import tiny_llama
from packrl.trainer.loop import train
from tests.conftest import SMOLLM_DIR

if "test_letter_e" not in REWARDS:

    @register_reward("test_letter_e", scores_truncated=True)  # a length reward: it reads no answer
    def _letter_e(response_text: str, ground_truth: str, *, data_source: str, cfg) -> float:
        """A dense reward a random model can move: the share of 'e' among the response's characters."""
        return response_text.count("e") / max(1, len(response_text))


BASE = [
    "data.batch_size=2", "rollout.n=3", "rollout.max_response_tokens=12", "model.dtype=fp32", "train.lr=1e-3",
    "train.max_tokens_per_microbatch=150", "data.val_files=[]", "train.loggers=[]",
]


def tiny_policy(tokenizer) -> LlamaForCausalLM:
    return tiny_llama(tokenizer=tokenizer)


def tiny_run(out_dir: Path, tokenizer, overrides: list[str]) -> tuple[Path, WorkerGroup]:
    """Train the tiny policy with the demo preset, `BASE` and ``overrides``; return RUN_DIR and the workers."""
    cfg = load_config("demo", [f"train.out_dir={out_dir}", *BASE, *overrides])
    workers = local_group(cfg, tiny_policy(tokenizer), tokenizer)
    return train(cfg, workers), workers


if __name__ == "__main__":
    tok = AutoTokenizer.from_pretrained(SMOLLM_DIR)
    tok.padding_side = "left"
    tiny_run(Path(sys.argv[1]), tok, [f"train.total_steps={sys.argv[2]}", *sys.argv[3:]])
