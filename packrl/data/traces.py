"""Chat traces for supervised fine-tuning (`packrl sft`): rows of ``messages`` turned into the
sequences the RL update trains, token for token as a multi-turn rollout would have built them.

Shapes: ``N`` traces · ``P_i`` prompt tokens · ``R_i`` tokens after the prompt of trace i.

A trace is a list of ``{"role", "content"}`` messages: the system and user messages of the
request, then the assistant's turns with tool messages between them, ending with an assistant
turn::

    [{"role": "system", ...}, {"role": "user", "content": "What is 123 * 45?"},
     {"role": "assistant", "content": '<tool_call>{"name": "calculator", ...}</tool_call>'},
     {"role": "tool", "content": "5535"},
     {"role": "assistant", "content": "123 * 45 = 5535\\n#### 5535"}]

The prompt is rendered as RL renders its prompts (`packrl.seqlen.prompt_policy.apply_prompt_policy`:
chat template with the run's tool schemas, generation prompt); after it, each assistant turn is
its content's tokens and the template's turn-closing token (True in the loss mask: the policy's
tokens), and each run of tool messages is what a multi-turn rollout appends
(`packrl.chat.render.ToolRenderer`, which the rollout renders with too: tool messages and the next
assistant header; False in the loss mask). So the trained sequences are the ones the policy would
write in RL, scored in the same contexts.

Every row ends in the accounting: kept, filtered (prompt over ``sft.max_prompt_tokens`` or the
rest over ``sft.max_response_tokens``, `TraceOptions`: a trace is never cut) or rejected with the
reason. The traces are `packrl.data.sampler.SampledData`: the epoch sampler draws them and a
resume on other traces is refused by their fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from packrl.chat.render import ToolRenderer
from packrl.config.schema import DataConfig
from packrl.config.sft import SftConfig
from packrl.config.tasks import TASK_PREFIX
from packrl.data.loaders import BadRow, load_rows
from packrl.data.prompts import RowSource, accounting_dict
from packrl.data.task_sources import read_task
from packrl.seqlen.prompt_policy import PromptAccounting, RowOutcome, apply_prompt_policy
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch

SFT_SOURCE = "packrl/sft"
_PROMPT_ROLES = ("system", "user")
_AFTER_PROMPT = ("assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class TraceOptions:
    """How trace rows become training sequences (`packrl.trainer.sft.trace_options` builds them
    from the config).

    Attributes:
        max_prompt_tokens: a trace's prompt budget in tokens (``sft.max_prompt_tokens``).
        max_response_tokens: the budget of what follows the prompt, in tokens (``sft.max_response_tokens``).
        tool_role: the role tool messages take (``rollout.multi_turn.tool_role``).
        chat_template_kwargs: passed to every ``apply_chat_template`` call (the run's tool schemas,
            `packrl.chat.tool_schemas.template_kwargs`), so a trace renders as RL renders.
    """

    max_prompt_tokens: int
    max_response_tokens: int
    tool_role: str = "tool"
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Traces:
    """Traces ready to train, in row order, and the accounting of every input row.

    Attributes:
        prompt_ids: ``N`` x ``[P_i]`` canonical prompt ids (as RL's prompts).
        response_ids: ``N`` x ``[R_i]`` ids after the prompt.
        response_masks: ``N`` x ``[R_i]``, True = an assistant token (in the loss).
        rows: each trace's row number in its data.
        accounting: every input row: kept, filtered or rejected with the reason.
        origins: where each input row came from (one per accounted row; empty when not known).
    """

    prompt_ids: tuple[tuple[int, ...], ...]
    response_ids: tuple[tuple[int, ...], ...]
    response_masks: tuple[tuple[bool, ...], ...]
    rows: tuple[int, ...]
    accounting: PromptAccounting
    origins: tuple[RowSource, ...] = ()

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def key(self) -> str:
        """The config key the traces come from (named in the sampler's errors)."""
        return "sft.train_files"

    def fingerprint(self) -> str:
        """sha256 (hex, 16 characters) of every trace's ids and loss mask, in order: what a resumed
        run must find again for its saved data position to mean the same traces."""
        digest = hashlib.sha256()
        for trace in zip(self.prompt_ids, self.response_ids, self.response_masks):
            digest.update(repr(trace).encode())
        return digest.hexdigest()[:16]

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(m) for m in self.response_masks)

    def accounting_dict(self) -> dict[str, Any]:
        """`PromptAccounting.to_dict` with, per row, ``source`` and ``source_row`` (the file or task and
        the row's 0-based index inside it; None when not known): `packrl.data.prompts.accounting_dict`,
        the one RL's prompts use."""
        return accounting_dict(self.accounting, self.origins)

    def train_batch(self, indices: Sequence[int]) -> TrainBatch:
        """The traces at ``indices`` as the update's batch: each its own group of one, advantages 0
        (`sft` loss reads none), the assistant tokens as the loss mask, no old or reference log-probs."""
        prompts = PromptBatch(prompt_ids=tuple(self.prompt_ids[i] for i in indices), ground_truths=("",) * len(indices),
                              data_sources=(SFT_SOURCE,) * len(indices), rows=tuple(self.rows[i] for i in indices),
                              prompt_truncated=(False,) * len(indices))
        responses = tuple(Response(self.response_ids[i], "stop", response_mask=self.response_masks[i]) for i in indices)
        rollout = RolloutBatch(prompts=prompts, group_size=1, responses=responses)
        zeros = torch.zeros(len(indices))
        scored = ScoredBatch(rollout=rollout, scores=zeros, rewards=zeros)
        masks = tuple(r.generated_mask() for r in responses)
        return TrainBatch(scored=scored, advantages=tuple(torch.zeros(len(m)) for m in masks), loss_masks=masks,
                          old_logprobs=None, ref_logprobs=None)


def load_traces(sft: SftConfig, data: DataConfig, tokenizer: Any, options: TraceOptions, *, seed: int) -> Traces:
    """Every row of ``sft.train_files``, rendered under ``options`` and accounted (module docstring).
    A ``task:`` source is made by a registered task that makes traces
    (`packrl.data.task_sources.read_task`: the built-in ``task:tool_traces`` and
    ``task:char_count_traces`` read ``data``, ``sft`` and ``seed``, ``train.seed``).

    Raises:
        ValueError: no ``sft.train_files``, a source that cannot be read (`load_rows`) or names no
            registered task that makes traces (`read_task`), or no trace left to train (names the reasons).
    """
    if not sft.train_files:
        raise ValueError("sft.train_files is empty; give chat traces (jsonl rows with 'messages') or task:tool_traces, "
                         "e.g. sft.train_files=[task:tool_traces]")
    rows: list[Any] = []
    origins: list[RowSource] = []
    for source in sft.train_files:
        if source.startswith(TASK_PREFIX):
            loaded = read_task(source, data, seed=seed, split="train", key="sft.train_files", makes="traces", sft=sft)
        else:
            loaded = load_rows(source, data=data, seed=seed, split="train", key="sft.train_files")
        rows += loaded
        origins += [RowSource(source, k) for k in range(len(loaded))]
    traces = replace(render_traces(rows, tokenizer, options), origins=tuple(origins))
    if not len(traces):
        accounting = traces.accounting
        fixes = (["fix the rejected rows (reasons above, rows in data_accounting.json)"] if accounting.num_rejected else []) + (
            ["raise sft.max_prompt_tokens / sft.max_response_tokens for the filtered ones (their sum at most the "
             "model context)"] if accounting.num_filtered else [])
        raise ValueError(f"sft.train_files: no trace can be trained: {accounting.summary()}; {' or '.join(fixes) or 'add traces'}")
    return traces


def render_traces(rows: Sequence[Any], tokenizer: Any, options: TraceOptions) -> Traces:
    """Split each row into its prompt and the rest, render both (module docstring) and account for it."""
    outcomes: dict[int, RowOutcome] = {}
    parts: dict[int, tuple[list[dict], list[dict]]] = {}
    for i, row in enumerate(rows):
        split = _split(row)
        if isinstance(split, str):
            outcomes[i] = RowOutcome(i, "rejected", split)
        else:
            parts[i] = split
    order = sorted(parts)
    kwargs, prompt_budget, budget = dict(options.chat_template_kwargs), options.max_prompt_tokens, options.max_response_tokens
    policy = apply_prompt_policy([parts[i][0] for i in order], tokenizer, prompt_budget, "filter", row_numbers=order,
                                 chat_template_kwargs=kwargs)
    renderer = ToolRenderer(tokenizer, options.tool_role, kwargs)
    prompts = {order[p.row]: p.prompt_ids for p in policy.prompts}
    for o in policy.accounting.outcomes:
        reason = f"{o.num_tokens} prompt tokens > sft.max_prompt_tokens={prompt_budget}" if o.status == "filtered" else o.reason
        if o.status != "kept":
            outcomes[order[o.row]] = RowOutcome(order[o.row], o.status, reason, o.num_tokens)
    kept: list[tuple[int, tuple[int, ...], list[int], list[bool]]] = []
    for i in sorted(prompts):
        ids, mask = _continuation(parts[i][1], tokenizer, renderer)
        if len(ids) > budget:
            outcomes[i] = RowOutcome(i, "filtered", f"{len(ids)} tokens after the prompt > sft.max_response_tokens={budget}",
                                     len(prompts[i]) + len(ids))
            continue
        outcomes[i] = RowOutcome(i, "kept", "", len(prompts[i]) + len(ids))
        kept.append((i, prompts[i], ids, mask))
    return Traces(prompt_ids=tuple(p for _, p, _, _ in kept), response_ids=tuple(tuple(ids) for _, _, ids, _ in kept),
                  response_masks=tuple(tuple(m) for _, _, _, m in kept), rows=tuple(i for i, _, _, _ in kept),
                  accounting=PromptAccounting(tuple(outcomes[i] for i in range(len(rows)))))


def _split(row: Any) -> tuple[list[dict], list[dict]] | str:
    """``(prompt messages, the messages after them)`` of one row, or why the row is bad."""
    if isinstance(row, BadRow):  # a line the loader could not read (invalid JSON or UTF-8)
        return row.reason
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        return "no 'messages' list" if not isinstance(row, dict) or "messages" not in row else "'messages' is not a non-empty list"
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {k} is not an object with string 'role' and 'content'"
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return "no assistant message"
    first = roles.index("assistant")
    head, tail = messages[:first], messages[first:]
    if not head or head[-1]["role"] != "user" or any(r not in _PROMPT_ROLES for r in roles[:first]):
        return "the messages before the first assistant turn must be system/user messages ending with a user message"
    if any(m["role"] not in _AFTER_PROMPT for m in tail):
        bad = next(m["role"] for m in tail if m["role"] not in _AFTER_PROMPT)
        return f"a {bad!r} message after the first assistant turn (only assistant turns and tool messages may follow it)"
    if tail[-1]["role"] != "assistant":
        return "the trace ends with a tool message, not an assistant turn"
    if any(a["role"] == b["role"] == "assistant" for a, b in zip(tail, tail[1:])):
        return "two assistant turns in a row (a tool message must come between them)"
    return head, tail


def _continuation(tail: list[dict], tokenizer: Any, renderer: ToolRenderer) -> tuple[list[int], list[bool]]:
    """The ids after the prompt and their loss mask: each assistant turn's content and closing
    token (True), each run of tool messages as a rollout appends it (False)."""
    ids: list[int] = []
    mask: list[bool] = []
    k = 0
    while k < len(tail):
        if tail[k]["role"] == "assistant":
            turn = tokenizer(tail[k]["content"], add_special_tokens=False)["input_ids"] + list(renderer.close)
            ids += turn
            mask += [True] * len(turn)
            k += 1
            continue
        end = k
        while end < len(tail) and tail[end]["role"] == "tool":
            end += 1
        answer = renderer.after_close([m["content"] for m in tail[k:end]])
        ids += answer
        mask += [False] * len(answer)
        k = end
    return ids, mask
