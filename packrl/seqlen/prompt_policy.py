"""Template-aware prompt budget: render every chat prompt, then keep, shorten, filter or reject it.

Truncation never cuts the chat template: the system message and the generation prompt
(assistant header) stay whole. The policy shortens the content of the last user message by
tokens (left drops its start, right its end, middle its centre), re-renders the whole chat and
repeats until the prompt fits `data.max_prompt_tokens` with as much content as possible.
Rendering is batched (jinja once per row, one batched fast-tokenizer call); only overlong rows
take the re-render loop, usually 1-3 renders each.

The ids returned are the canonical prompt ids: the rollout engine receives exactly these and
the trainer scores exactly these (length invariant 5). Every input row ends in the accounting
as kept, truncated, filtered or rejected (length invariant 6).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from packrl.seqlen.microbatch import as_count

Status = Literal["kept", "truncated", "filtered", "rejected"]
Policy = Literal["filter", "left", "right", "middle", "error"]
POLICIES: tuple[Policy, ...] = ("filter", "left", "right", "middle", "error")
_MAX_RENDERS = 12  # re-render attempts per overlong row; 1-3 are typical
_REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes half a character to


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt that survived the policy.

    Attributes:
        row: index of the row in the input sequence.
        prompt_ids: canonical prompt token ids, chat template and generation prompt included;
            ``len(prompt_ids) <= max_prompt_tokens``.
        num_tokens_removed: tokens the policy cut (0 unless truncated).
    """

    row: int
    prompt_ids: tuple[int, ...]
    num_tokens_removed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def truncated(self) -> bool:
        return self.num_tokens_removed > 0


@dataclass(frozen=True, slots=True)
class RowOutcome:
    """What the policy did with one input row and why. Token counts are None where unknown."""

    row: int
    status: Status
    reason: str = ""
    num_tokens: int | None = None
    num_tokens_removed: int = 0


@dataclass(frozen=True, slots=True)
class PromptAccounting:
    """Where every input row went. ``num_kept + num_truncated + num_filtered + num_rejected == num_rows``."""

    outcomes: tuple[RowOutcome, ...] = field(default_factory=tuple)

    def _count(self, status: Status) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    @property
    def num_rows(self) -> int:
        return len(self.outcomes)

    @property
    def num_kept(self) -> int:
        return self._count("kept")

    @property
    def num_truncated(self) -> int:
        return self._count("truncated")

    @property
    def num_filtered(self) -> int:
        return self._count("filtered")

    @property
    def num_rejected(self) -> int:
        return self._count("rejected")

    @property
    def num_tokens_removed(self) -> int:
        return sum(o.num_tokens_removed for o in self.outcomes)

    def metrics(self) -> dict[str, int]:
        """``prompt/kept|truncated|filtered|rejected`` row counts and ``prompt/tokens_removed``."""
        return {
            "prompt/kept": self.num_kept,
            "prompt/truncated": self.num_truncated,
            "prompt/filtered": self.num_filtered,
            "prompt/rejected": self.num_rejected,
            "prompt/tokens_removed": self.num_tokens_removed,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``totals`` (``num_rows``, ``num_kept``, ``num_truncated``, ``num_filtered``,
        ``num_rejected``, ``num_tokens_removed``; the four statuses sum to ``num_rows``) and
        ``rows``: one ``{row, status, reason, num_tokens, num_tokens_removed}`` per input row."""
        totals = {"num_rows": self.num_rows, "num_kept": self.num_kept, "num_truncated": self.num_truncated,
                  "num_filtered": self.num_filtered, "num_rejected": self.num_rejected, "num_tokens_removed": self.num_tokens_removed}
        rows = [{"row": o.row, "status": o.status, "reason": o.reason, "num_tokens": o.num_tokens,
                 "num_tokens_removed": o.num_tokens_removed} for o in self.outcomes]
        return {"totals": totals, "rows": rows}

    def summary(self) -> str:
        reasons = Counter(o.reason for o in self.outcomes if o.status == "rejected")
        text = (
            f"{self.num_rows:,} rows: {self.num_kept:,} kept, {self.num_truncated:,} truncated "
            f"({self.num_tokens_removed:,} tokens removed), {self.num_filtered:,} filtered, {self.num_rejected:,} rejected"
        )
        if reasons:
            more = f"; and {len(reasons) - 5} more reason(s)" if len(reasons) > 5 else ""
            text += " (" + "; ".join(f"{n} {r}" for r, n in reasons.most_common(5)) + more + ")"
        return text


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """Prompts in input-row order (filtered and rejected rows left out) and the accounting of all rows."""

    prompts: tuple[Prompt, ...]
    accounting: PromptAccounting


def _check_messages(messages: Any) -> str:
    """The reason a row cannot be rendered, or '' when it is a usable chat."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return "prompt is not a non-empty list of chat messages"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "a message is not a dict with a string 'role'"
        if not isinstance(m.get("content"), str):
            return f"a {m.get('role')} message has non-text content"
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        return "no user message"
    if not users[-1]["content"].strip():
        return "empty prompt (the last user message is blank)"
    return ""


class _Renderer:
    """Chat template + tokenizer, consistent with ``apply_chat_template(tokenize=True)``."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template, so prompts cannot be rendered; "
                "use an instruct/chat model's tokenizer or give the tokenizer a chat_template"
            )
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})

    def texts(self, chats: Sequence[Sequence[dict]]) -> list[str]:
        return [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False, **self.kwargs)
            for c in chats
        ]

    def ids(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def render(self, chat: Sequence[dict]) -> list[int]:
        return self.ids(self.texts([chat]))[0]


def cut_text(ids: list[int], keep: int, side: str, decode) -> str:
    """Decode the ``keep`` tokens ``side`` truncation leaves. A cut inside a multi-byte
    character decodes to U+FFFD at the cut edge; those replacement characters are dropped, so
    the prompt never gains text the row did not have."""

    def text(part: list[int]) -> str:
        return decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    if keep >= len(ids):
        return text(ids)
    if side == "left":  # drop the start, keep the end
        return text(ids[len(ids) - keep :] if keep else []).lstrip(_REPLACEMENT)
    if side == "right":  # keep the start
        return text(ids[:keep]).rstrip(_REPLACEMENT)
    head, tail = keep // 2, keep - keep // 2
    return text(ids[:head]).rstrip(_REPLACEMENT) + (text(ids[len(ids) - tail :]).lstrip(_REPLACEMENT) if tail else "")


def _with_content(messages: Sequence[dict], index: int, content: str) -> list[dict]:
    out = [dict(m) for m in messages]
    out[index]["content"] = content
    return out


def _truncate(renderer: _Renderer, messages: Sequence[dict], budget: int, side: str) -> list[int] | str:
    """Prompt ids of ``messages`` shortened to fit ``budget``, or the reason it cannot fit."""
    target = max(i for i, m in enumerate(messages) if m["role"] == "user")
    overhead = len(renderer.render(_with_content(messages, target, "")))
    if overhead > budget:
        return f"template and other messages alone take {overhead} tokens"
    content_ids = renderer.ids([messages[target]["content"]])[0]
    decode = renderer.tokenizer.decode

    def attempt(keep: int) -> list[int]:
        text = cut_text(content_ids, keep, side, decode)
        return renderer.render(_with_content(messages, target, text))

    keep = min(budget - overhead, len(content_ids))
    best: list[int] | None = None
    for _ in range(_MAX_RENDERS):
        if keep < 1:
            break
        ids = attempt(keep)
        if len(ids) <= budget:
            best = ids
            if len(ids) == budget or keep >= len(content_ids):
                break
            keep += 1  # token boundaries may merge when re-encoded: try to use the room left
        elif best is not None:
            break
        else:
            keep -= max(1, len(ids) - budget)
    if best is None:
        return f"no room for any content after the template ({overhead} of {budget} tokens)"
    return best


def apply_prompt_policy(
    chats: Sequence[Any],
    tokenizer: Any,
    max_prompt_tokens: int,
    policy: Policy,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    row_numbers: Sequence[int] | None = None,
) -> PolicyResult:
    """Render, tokenize and fit every chat prompt to the prompt budget.

    Args:
        chats: one chat per row, each a list of ``{"role": str, "content": str}`` messages.
            Rows that are not such a chat, or whose last user message is blank, are rejected.
        tokenizer: a HF tokenizer with a chat template (fast tokenizers are batched).
        max_prompt_tokens: the budget in tokens (``data.max_prompt_tokens``), including the
            template and the generation prompt.
        policy: ``data.overlong_prompt``; see `packrl.config.DataConfig.overlong_prompt`.
        chat_template_kwargs: extra arguments to ``apply_chat_template`` (e.g. ``enable_thinking``).
        row_numbers: the row number of each chat in its data, used to name rows in errors
            (default: the chat's index).

    Returns:
        `PolicyResult` with the surviving prompts in row order and the accounting of every row.

    Raises:
        ValueError: ``max_prompt_tokens`` < 1, an unknown policy, a tokenizer without chat
            template, or, under ``error``, any overlong row (all such rows are named).
    """
    if as_count(max_prompt_tokens, "data.max_prompt_tokens") < 1:
        raise ValueError(f"data.max_prompt_tokens={max_prompt_tokens!r} must be a positive integer number of tokens")
    max_prompt_tokens = as_count(max_prompt_tokens, "data.max_prompt_tokens")
    if isinstance(chats, (str, bytes)) or not isinstance(chats, Sequence):
        raise ValueError(f"chats must be a list of chats (one per row), got {type(chats).__name__}")
    if "add_generation_prompt" in (chat_template_kwargs or {}) or "tokenize" in (chat_template_kwargs or {}):
        raise ValueError("chat_template_kwargs may not set add_generation_prompt or tokenize: "
                         "prompts always end with the generation prompt")
    if policy not in POLICIES:
        raise ValueError(f"data.overlong_prompt={policy!r} is not one of {', '.join(POLICIES)}")
    renderer = _Renderer(tokenizer, chat_template_kwargs)
    reasons = [_check_messages(c) for c in chats]
    good = [i for i, r in enumerate(reasons) if not r]
    outcomes: dict[int, RowOutcome] = {i: RowOutcome(i, "rejected", r) for i, r in enumerate(reasons) if r}
    texts = []
    for i in list(good):
        try:
            texts.append(renderer.texts([chats[i]])[0])
        except Exception as err:  # a template may raise on roles it does not support
            outcomes[i] = RowOutcome(i, "rejected", f"chat template failed: {type(err).__name__}: {err}")
            good.remove(i)
    all_ids = dict(zip(good, renderer.ids(texts)))
    overlong = [i for i in good if len(all_ids[i]) > max_prompt_tokens]
    if policy == "error" and overlong:
        _raise_overlong(overlong, all_ids, max_prompt_tokens, row_numbers)
    prompts: dict[int, Prompt] = {}
    for i in good:
        ids, n = all_ids[i], len(all_ids[i])
        if n <= max_prompt_tokens:
            prompts[i] = Prompt(i, tuple(ids))
            outcomes[i] = RowOutcome(i, "kept", "", n)
        elif policy == "filter":
            outcomes[i] = RowOutcome(i, "filtered", f"{n} tokens > data.max_prompt_tokens={max_prompt_tokens}", n)
        else:
            cut = _truncate(renderer, chats[i], max_prompt_tokens, policy)
            if isinstance(cut, str):
                outcomes[i] = RowOutcome(i, "rejected", f"cannot truncate to {max_prompt_tokens} tokens: {cut}", n)
                continue
            prompts[i] = Prompt(i, tuple(cut), n - len(cut))
            outcomes[i] = RowOutcome(i, "truncated", f"{n} -> {len(cut)} tokens ({policy})", n, n - len(cut))
    accounting = PromptAccounting(tuple(outcomes[i] for i in range(len(chats))))
    return PolicyResult(tuple(prompts[i] for i in sorted(prompts)), accounting)


def _raise_overlong(rows: list[int], ids: dict[int, list[int]], budget: int, row_numbers: Sequence[int] | None) -> None:
    shown = ", ".join(f"row {i if row_numbers is None else row_numbers[i]} ({len(ids[i])} tokens)" for i in rows[:20])
    more = f" and {len(rows) - 20} more" if len(rows) > 20 else ""
    longest = max(len(ids[i]) for i in rows)
    raise ValueError(
        f"{len(rows)} prompt(s) exceed data.max_prompt_tokens={budget}: {shown}{more}. "
        f"Set data.overlong_prompt to filter, left, right or middle, or raise data.max_prompt_tokens to >= {longest}"
    )
