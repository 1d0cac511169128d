"""``RUN_DIR/rollouts/step_N.jsonl``: every response of step N, one JSON object per line.

Keys (in order): ``step``, ``index`` (position in the step's batch), ``prompt_index``,
``sample_index`` (within the group), ``row`` (dataset row), ``data_source``, ``prompt``,
``response`` (text), ``prompt_tokens``, ``response_tokens`` (ints), ``finish_reason``,
``truncated`` (finish reason ``length``/``context``), ``score``, ``reward`` (after shaping),
``advantage`` (mean over the response's loss tokens, 0.0 if none), ``ground_truth``,
``prompt_truncated`` (the prompt policy shortened it). A multi-turn response adds ``turns``: its
segments in order, each ``{"role", "text", "tokens", "in_loss"}`` (role ``assistant`` for the
policy's turns, the only ones in the loss, ``tool`` for tool messages, ``template`` for a closing
token the policy did not write), ``ended_by`` (`packrl.types.Trajectory.ended_by`) and
``dropped_turns`` (turns the rolling window dropped from the last turn's context).

Text is decoded with ``skip_special_tokens=False``: the prompt shows its chat-template markers
and a response its EOS, exactly the tokens trained on. Cost: one batched decode and one file
write per step (about 5 ms for 32 responses of 64 tokens with SmolLM2's tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from packrl.types import TrainBatch

ROLLOUTS_DIR = "rollouts"


def rollout_rows(step: int, batch: TrainBatch, tokenizer: Any) -> list[dict[str, Any]]:
    """The dump rows of one step, in batch order (``N`` rows)."""
    rollout, prompts = batch.rollout, batch.rollout.prompts
    group = rollout.group_size
    prompt_texts = tokenizer.batch_decode([list(p) for p in prompts.prompt_ids], skip_special_tokens=False)
    response_texts = tokenizer.batch_decode([list(r.response_ids) for r in rollout.responses], skip_special_tokens=False)
    rows = []
    for i, response in enumerate(rollout.responses):
        b = i // group
        mask, adv = batch.loss_masks[i], batch.advantages[i]
        rows.append({
            "step": step, "index": i, "prompt_index": b, "sample_index": i % group, "row": int(prompts.rows[b]),
            "data_source": str(prompts.data_sources[b]), "prompt": prompt_texts[b], "response": response_texts[i],
            "prompt_tokens": len(prompts.prompt_ids[b]), "response_tokens": len(response.response_ids),
            "finish_reason": response.finish_reason, "truncated": bool(response.truncated),
            "score": float(batch.scored.scores[i]), "reward": float(batch.scored.rewards[i]),
            "advantage": float(adv[mask].mean()) if bool(mask.any()) else 0.0,
            "ground_truth": str(prompts.ground_truths[b]), "prompt_truncated": bool(prompts.prompt_truncated[b]),
        } | _turns(response, tokenizer) | _versions(response) | _length_fields(batch, i, b, response, tokenizer))
    return rows


def _length_fields(batch: TrainBatch, i: int, b: int, response: Any, tokenizer: Any) -> dict[str, Any]:
    """Length control's fields, where they apply: ``filtered`` (the name of the filter that took it
    out of the loss, null where none did: `packrl.algos.filters`),
    ``length_target`` (the length its prompt asked for) and ``length_mode`` (how: ``exact`` or
    ``max``, with ``data.length_target.mode_column``), ``forced_tokens`` and ``forced`` (the
    end-of-thinking tokens appended when the thinking budget ran out, in the response but not sampled
    by the policy, and the response's text split around them: ``thinking``, ``forced``, ``answer``)."""
    out: dict[str, Any] = {}
    if batch.filtered is not None:
        out["filtered"] = batch.filtered[i]
    targets = batch.rollout.prompts.length_targets
    if targets is not None:
        out["length_target"] = int(targets[b])
    modes = batch.rollout.prompts.length_modes
    if modes is not None:
        out["length_mode"] = modes[b]
    forced = response.forced_tokens()
    if forced:
        start, stop = response.forced_span
        ids = list(response.response_ids)
        texts = tokenizer.batch_decode([ids[:start], ids[start:stop], ids[stop:]], skip_special_tokens=False)
        out["forced_tokens"] = forced
        out["forced"] = dict(zip(("thinking", "forced", "answer"), texts))
    return out


def _versions(response: Any) -> dict[str, Any]:
    """``versions``: the policy versions (steps) whose tokens a partial rollout holds, in order; nothing otherwise."""
    return {} if response.token_versions is None else {"versions": sorted(set(response.token_versions))}


def _turns(response: Any, tokenizer: Any) -> dict[str, Any]:
    """``turns`` and ``ended_by`` of a multi-turn response; nothing for a single turn."""
    if response.trajectory is None:
        return {}
    turns = [{"role": role, "text": tokenizer.decode(list(ids), skip_special_tokens=False), "tokens": len(ids),
              "in_loss": role == "assistant"} for role, ids in response.segments()]
    return {"turns": turns, "ended_by": response.trajectory.ended_by, "dropped_turns": response.trajectory.num_dropped_turns}


class RolloutDump(Protocol):
    def __call__(self, step: int, batch: TrainBatch) -> None: ...


def _skip(step: int, batch: TrainBatch) -> None:
    """The dump of ``train.dump_rollouts=false``."""


def build_rollout_dump(enabled: bool, run_dir: Path, tokenizer: Any) -> RolloutDump:
    """The step hook that writes ``run_dir/rollouts/step_N.jsonl`` (``train.dump_rollouts``), or
    one that does nothing."""
    if not enabled:
        return _skip
    folder = run_dir / ROLLOUTS_DIR
    folder.mkdir(parents=True, exist_ok=True)

    def dump(step: int, batch: TrainBatch) -> None:
        lines = "".join(json.dumps(row) + "\n" for row in rollout_rows(step, batch, tokenizer))
        (folder / f"step_{step}.jsonl").write_text(lines)

    return dump
