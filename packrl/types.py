"""Typed batches that flow through a step: PromptBatch -> RolloutBatch -> ScoredBatch -> TrainBatch.

Shapes: ``B`` prompts · ``G`` responses per prompt (``rollout.n``) · ``N = B*G`` sequences ·
``P_b`` tokens of prompt b · ``R_i`` tokens of response i · ``T_i = P_b + R_i``.

Sequences keep their own lengths (no padding anywhere): per-sequence fields are tuples of
1-D tensors or of id tuples. Response i belongs to prompt ``i // G``; responses of one prompt
(a group) are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

import torch

FinishReason = Literal["eos", "stop", "length", "context", "abort"]
FINISH_REASONS: tuple[str, ...] = ("eos", "stop", "length", "context", "abort")
TRUNCATED_REASONS: frozenset[str] = frozenset({"length", "context"})


class ExtraInputs(Protocol):
    """A prompt's model inputs beyond its token ids: what a modality adds to a prompt, carried by
    `PromptBatch.extra_inputs` with its ids into the engine and the packs
    (`packrl.seqlen.packing.Pack.extra_inputs`). The batches, the planner and the packs read
    only what this protocol states; the modality's own module reads the rest (a
    vision-language prompt's images: `packrl.models.image_inputs.ImageInputs`). The prompt's ids
    hold ``num_tokens`` placeholder tokens for them, expanded, so every token budget counts them.
    """

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of the prompt's ids that stand for these inputs."""
        ...

    def grouped_loads(self) -> dict[str, int]:
        """Load name -> this prompt's load against the grouped cap of that name
        (`packrl.seqlen.microbatch.CapLimit.name`), counted once per micro-batch however many of
        the prompt's responses it holds; empty: none."""
        ...

    def to(self, device: torch.device | str) -> ExtraInputs:
        """The inputs on ``device``."""
        ...

    @classmethod
    def batch_metrics(cls, inputs: Sequence[ExtraInputs | None], prompt_lengths: Sequence[int]) -> dict[str, float]:
        """A rollout's metrics of these inputs (``prompt_length/*``): ``inputs`` per prompt (None
        for a prompt without), ``prompt_lengths`` its tokens."""
        ...


@dataclass(frozen=True)
class PromptBatch:
    """B prompts, as the prompt policy produced them.

    Attributes:
        prompt_ids: canonical prompt token ids, ``[B][P_b]``; the engine receives exactly these.
        ground_truths: reference answer of each prompt (a string, e.g. ``"72"``).
        data_sources: reward dispatch key of each prompt (e.g. ``"openai/gsm8k"``).
        rows: index of each prompt's row in its dataset.
        prompt_truncated: True where the prompt policy shortened the prompt.
        extra_inputs: each prompt's inputs beyond its ids (`ExtraInputs`, e.g. its images; None
            for a text prompt), whose placeholder tokens ``prompt_ids`` holds expanded; None = a
            text batch.
        response_budgets: the response budget each prompt's responses were sampled under, in
            tokens, where it differs from the step's: a partial-rollout group dispatched at an
            earlier step of a length curriculum keeps its dispatching step's
            (`packrl.trainer.stages.pool.RolloutGroup.dispatch_budget`); None = the step's budget.
        length_targets: the response length each prompt asks for, in tokens (``data.length_target``:
            written into the prompt, read by the ``target_length`` objective); None = no targets.
        length_modes: how each prompt asks for it, ``exact`` or ``max``
            (``data.length_target.mode_column``; the objective scores each by its own); None = as
            the objective's ``mode`` option says.
    """

    prompt_ids: tuple[tuple[int, ...], ...]
    ground_truths: tuple[str, ...]
    data_sources: tuple[str, ...]
    rows: tuple[int, ...]
    prompt_truncated: tuple[bool, ...]
    extra_inputs: tuple[ExtraInputs | None, ...] | None = None
    response_budgets: tuple[int, ...] | None = None
    length_targets: tuple[int, ...] | None = None
    length_modes: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, indices: Sequence[int]) -> PromptBatch:
        """The prompts at ``indices``, in that order (repeats allowed)."""
        values: dict[str, Any] = {f.name: None if getattr(self, f.name) is None else tuple(getattr(self, f.name)[i] for i in indices)
                                  for f in fields(PromptBatch)}
        return PromptBatch(**values)

    @staticmethod
    def concat(parts: Sequence[PromptBatch]) -> PromptBatch:
        """``parts`` one after the other; extra inputs are kept when any part has them.

        Raises:
            ValueError: some parts have response budgets (or length targets, or modes) and others do not.
        """
        optional = ("extra_inputs", "response_budgets", "length_targets", "length_modes")
        values: dict[str, Any] = {f.name: tuple(v for p in parts for v in getattr(p, f.name)) for f in fields(PromptBatch)
                                  if f.name not in optional}
        has_extra = any(p.extra_inputs is not None for p in parts)
        values["extra_inputs"] = tuple(x for p in parts for x in (p.extra_inputs or (None,) * len(p))) if has_extra else None
        for name in optional[1:]:
            given = [getattr(p, name) is not None for p in parts]
            if any(given) and not all(given):
                raise ValueError(f"PromptBatch.concat: some parts carry {name} and others do not; give every part its {name}")
            values[name] = tuple(v for p in parts for v in getattr(p, name)) if parts and all(given) else None
        return PromptBatch(**values)


@dataclass(frozen=True)
class Trajectory:
    """How a multi-turn response was built (`packrl.rollout.multi_turn`).

    Attributes:
        segments: ``(role, num_tokens)`` in order, covering the response: ``assistant`` (an
            assistant turn, the policy's tokens), ``tool`` (tool messages and the next assistant
            header, rendered by the chat template) or ``template`` (a turn-closing token the
            policy did not write).
        num_tool_calls: tool calls the policy wrote, malformed ones included.
        num_malformed_calls: calls that did not parse or named no allowed tool.
        num_tool_errors: well-formed calls whose tool reported an error.
        tool_answers: the content of each answer a tool gave without an error, in order, as the
            policy saw it (after ``rollout.multi_turn.max_tool_response_tokens`` cut it).
        ended_by: what ended it: ``answer`` (a turn without a tool call), ``max_turns``,
            ``turn_tokens``, ``response_tokens``, ``trajectory_tokens``, ``context`` or ``abort``.
        context_starts: per assistant turn, the response offset (tokens) where its context
            resumed after the prompt: the turn was generated from ``prompt + response[start:turn
            start]`` (``rollout.multi_turn.context_policy=rolling`` drops the oldest complete
            turns). Empty = every turn saw everything before it.
    """

    segments: tuple[tuple[str, int], ...]
    num_tool_calls: int = 0
    num_malformed_calls: int = 0
    num_tool_errors: int = 0
    ended_by: str = "answer"
    context_starts: tuple[int, ...] = ()
    tool_answers: tuple[str, ...] = ()

    @property
    def num_turns(self) -> int:
        """Assistant turns."""
        return sum(role == "assistant" for role, _ in self.segments)

    def tokens_of(self, role: str) -> int:
        """Tokens of the segments with ``role``."""
        return sum(n for r, n in self.segments if r == role)

    def turn_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` response offsets of each assistant turn, in order."""
        spans, start = [], 0
        for role, n in self.segments:
            if role == "assistant":
                spans.append((start, start + n))
            start += n
        return spans

    @property
    def num_dropped_turns(self) -> int:
        """Assistant turns (each with its tool answer) the rolling window dropped from the context
        of the last turn: they lie wholly before its context start."""
        if not self.context_starts:
            return 0
        last = self.context_starts[-1]
        return sum(end <= last for _, end in self.turn_spans())


@dataclass(frozen=True)
class Response:
    """One generated response.

    Attributes:
        response_ids: generated ids, ``[R_i]``; an EOS that ended the response is included.
        finish_reason: why it stopped, from the engine (never inferred from widths).
        rollout_logprobs: the engine's log-prob of each response token, ``[R_i]`` float32
            nats, or None when not requested.
        response_mask: True = a token the policy generated, ``[R_i]``; False marks tokens it did
            not write (a tool's answer inside a multi-turn trajectory), which never count in the
            loss. None = every token was generated (a single-turn response).
        trajectory: the turns of a multi-turn response (None for a single turn).
        token_versions: the policy version (training step) that sampled each token, ``[R_i]``
            int, for a response generated across steps (`packrl.trainer.stages.pool`); None = every
            token was sampled by the policy of the step that trains it.
        forced_span: ``(start, stop)`` token positions of the end-of-thinking text appended when
            the thinking budget ran out (`packrl.rollout.thinking`): in the response, not sampled by
            the policy (``response_mask`` False there); None = nothing forced.

    Raises:
        ValueError: ``rollout_logprobs``, ``response_mask`` or ``token_versions`` does not have
            one entry per token.
    """

    response_ids: tuple[int, ...]
    finish_reason: FinishReason
    rollout_logprobs: tuple[float, ...] | None = None
    response_mask: tuple[bool, ...] | None = None
    trajectory: Trajectory | None = None
    token_versions: tuple[int, ...] | None = None
    forced_span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("rollout_logprobs", "response_mask", "token_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_ids):
                raise ValueError(f"Response.{name} has {len(values)} entries for {len(self.response_ids)} response tokens; "
                                 "give one per token")
        if self.trajectory is not None and sum(n for _, n in self.trajectory.segments) != len(self.response_ids):
            raise ValueError(f"Response.trajectory's segments cover {sum(n for _, n in self.trajectory.segments)} tokens "
                             f"of a {len(self.response_ids)}-token response; they must cover it exactly")
        if self.trajectory is not None and self.trajectory.context_starts:
            starts, spans = self.trajectory.context_starts, self.trajectory.turn_spans()
            if len(starts) != len(spans) or any(not 0 <= c <= s for c, (s, _) in zip(starts, spans)) or list(starts) != sorted(starts):
                raise ValueError(f"Response.trajectory.context_starts={starts} do not fit its turns at {spans}: give one "
                                 "non-decreasing offset per assistant turn, at most the turn's start")
        if self.forced_span is not None:
            start, stop = self.forced_span
            mask = self.response_mask
            if not 0 <= start < stop <= len(self.response_ids) or mask is None or any(mask[start:stop]):
                raise ValueError(f"Response.forced_span={self.forced_span} must lie within the {len(self.response_ids)} tokens "
                                 "and be False in response_mask (forced tokens are not the policy's)")

    @property
    def truncated(self) -> bool:
        return self.finish_reason in TRUNCATED_REASONS

    def segments(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(role, ids)`` of each segment in order (`Trajectory.segments`); one ``assistant``
        segment, the whole response, for a single turn."""
        if self.trajectory is None:
            return [("assistant", self.response_ids)]
        out, start = [], 0
        for role, n in self.trajectory.segments:
            out.append((role, self.response_ids[start:start + n]))
            start += n
        return out

    def policy_segments(self) -> list[tuple[int, ...]]:
        """The ids of each stretch the policy wrote (its turns), in order; the whole response
        for a single turn."""
        return [ids for role, ids in self.segments() if role == "assistant"]

    def forced_tokens(self) -> int:
        """Tokens appended to the response without being sampled (`forced_span`), 0 when none."""
        return 0 if self.forced_span is None else self.forced_span[1] - self.forced_span[0]

    def generated_mask(self) -> torch.Tensor:
        """`response_mask` as a tensor (all True when it is None). Shape [R_i], bool."""
        if self.response_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.bool)
        return torch.tensor(self.response_mask, dtype=torch.bool)


@dataclass(frozen=True)
class RolloutBatch:
    """N = B*G responses; response i answers prompt ``i // group_size``.

    Attributes:
        policy_version: the step whose update trains this batch, when some responses carry
            tokens of earlier versions (`Response.token_versions`); None = all on-policy.
    """

    prompts: PromptBatch
    group_size: int
    responses: tuple[Response, ...]
    policy_version: int | None = None

    def __post_init__(self) -> None:
        assert len(self.responses) == len(self.prompts) * self.group_size, "responses must be B*G"

    def __len__(self) -> int:
        return len(self.responses)

    def prompt_ids_of(self, i: int) -> tuple[int, ...]:
        return self.prompts.prompt_ids[i // self.group_size]

    def extra_inputs_of(self, i: int) -> ExtraInputs | None:
        """The extra inputs of sequence i's prompt (None for text)."""
        return None if self.prompts.extra_inputs is None else self.prompts.extra_inputs[i // self.group_size]

    def response_budgets(self, step_budget: int) -> tuple[int, ...]:
        """The response budget of every response, in tokens: its prompt's
        (`PromptBatch.response_budgets`), else ``step_budget`` (the step's)."""
        budgets = self.prompts.response_budgets
        return tuple(step_budget if budgets is None else budgets[i // self.group_size] for i in range(len(self.responses)))

    def sequence_lengths(self) -> list[int]:
        """T_i = P_b + R_i of every sequence, in tokens."""
        return [len(self.prompt_ids_of(i)) + len(r.response_ids) for i, r in enumerate(self.responses)]

    def grouped_loads(self) -> tuple[dict[str, list[int]], list[int]]:
        """Per load name, every sequence's load (its prompt's `ExtraInputs.grouped_loads`, 0 where
        it reports none), and every sequence's sharing key (its prompt's index: a group shares
        its prompt's inputs): what `packrl.seqlen.update_plan.PassPlanner.grouped_caps` takes.
        No loads for a text batch."""
        per_prompt = [{} if x is None else x.grouped_loads() for x in self.prompts.extra_inputs or ()]
        names = sorted({name for loads in per_prompt for name in loads})
        loads = {name: [per_prompt[i // self.group_size].get(name, 0) for i in range(len(self.responses))] for name in names}
        return loads, [i // self.group_size for i in range(len(self.responses))]


@dataclass(frozen=True)
class ScoredBatch:
    """A rollout with its rewards.

    Attributes:
        scores: task score of each response (e.g. 1.0 correct). Shape [N], float32.
        rewards: score plus every reward-shaping part (``reward.shaping``). Shape [N], float32.
        parts: the shaping parts included in ``rewards`` by name, and their terms as
            ``<part>/<term>`` (`packrl.reward.shaping.shape_rewards`), each Shape [N], float32;
            reported as ``reward/<name>/mean`` metrics.
        correct: True where a response is correct: its score reaches the reward's correct score
            and no budget cut it (`packrl.reward.shaping.ShapingInputs.correct`). Shape [N], bool;
            None when the reward has no notion of correct.
    """

    rollout: RolloutBatch
    scores: torch.Tensor
    rewards: torch.Tensor
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    correct: torch.Tensor | None = None

    def indexed(self, rollout: RolloutBatch, index: torch.Tensor) -> ScoredBatch:
        """Scores, rewards, parts and correctness at ``index`` (Shape [M], int64: positions in this
        batch), for ``rollout``, whose M responses they now belong to."""
        return ScoredBatch(rollout, self.scores[index], self.rewards[index], {name: v[index] for name, v in self.parts.items()},
                           None if self.correct is None else self.correct[index])


@dataclass(frozen=True)
class ValueEstimates:
    """The critic's values of a rollout (PPO with a critic).

    Attributes:
        values: V of the state before each response token. ``N`` tensors of Shape [R_i], float32.
        bootstrap: V of the state after each response's last token. Shape [N], float32.
    """

    values: tuple[torch.Tensor, ...]
    bootstrap: torch.Tensor


@dataclass(frozen=True)
class TrainBatch:
    """Everything the update needs, per sequence.

    Attributes:
        scored: the scored rollout.
        advantages: per response token. ``N`` tensors of Shape [R_i], float32.
        loss_masks: True = the response token counts in the loss. ``N`` tensors of Shape [R_i], bool.
        old_logprobs: log pi_old of each response token. ``N`` tensors of Shape [R_i], float32,
            nats; None when the update is on-policy (one optimizer step per rollout), where
            pi_old is the policy being updated and its detached log-probs are used.
        ref_logprobs: log pi_ref of each response token, or None without a reference model.
        trajectory_loss_tokens: for step-wise samples (`packrl.seqlen.stepwise`), the loss tokens
            of the trajectory each sequence is a part of: the seq-mean loss modes divide a
            sequence's tokens by it, so a trajectory split into samples is still one sequence.
            None = every sequence is a whole response.
        values: the critic's value of the state before each response token at rollout time
            (PPO with a critic). ``N`` tensors of Shape [R_i], float32; None without a critic.
        returns: the critic's regression targets (GAE returns). ``N`` tensors of Shape [R_i],
            float32; None without a critic.
        extras: further per-token values the controller computed for the policy loss, name ->
            ``N`` tensors of Shape [R_i] (any dtype); the worker lays each over its packs into
            ``PolicyLossInputs.extras`` (`packrl.algos.policy_losses`). Built in:
            ``rollout_is_weights`` (float32, `packrl.algos.rollout_correction`) and
            ``cov_selected`` (bool, `packrl.algos.cov_losses`).
        filtered: per response, the name of the filter that took it out of the loss (its loss
            mask is all False; an advantage filter's also gets advantage 0), None where none did;
            None when no filter took any (`packrl.algos.filters`). Dumped, never dropped.
    """

    scored: ScoredBatch
    advantages: tuple[torch.Tensor, ...]
    loss_masks: tuple[torch.Tensor, ...]
    old_logprobs: tuple[torch.Tensor, ...] | None
    ref_logprobs: tuple[torch.Tensor, ...] | None
    trajectory_loss_tokens: tuple[int, ...] | None = None
    values: tuple[torch.Tensor, ...] | None = None
    returns: tuple[torch.Tensor, ...] | None = None
    extras: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    filtered: tuple[str | None, ...] | None = None

    @property
    def rollout(self) -> RolloutBatch:
        return self.scored.rollout
