"""How a chat template renders tool messages after an assistant turn, token for token: what a
multi-turn rollout appends after a call (`packrl.rollout.multi_turn`) and what an SFT trace holds
between its assistant turns (`packrl.data.traces`), so the two agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_PROBE_USER, _PROBE_ASSISTANT = "packrl probe question", "packrl probe answer"
_SLOT, _SLOT_PATTERN = "PACKRLTOOLANSWER{}END", r"PACKRLTOOLANSWER(\d+)END"


class ToolRenderer:
    """Token ids the chat template puts around tool messages, rendered without re-tokenising the
    trajectory: ``close`` (what ends an assistant turn, e.g. ``<|im_end|>``) and, per tool step,
    the ids from after that close to the next assistant header (the tool messages and the
    generation prompt).

    Args:
        tokenizer: the policy's tokenizer, with a chat template.
        role: the role tool messages take (``rollout.multi_turn.tool_role``).
        chat_template_kwargs: passed to ``apply_chat_template`` (the tool schemas, `packrl.chat.tool_schemas.template_kwargs`).

    Raises:
        ValueError: the template does not render a conversation that ends in tool messages as
            an extension of the same conversation before them (the rendering would not be token-exact).
    """

    def __init__(self, tokenizer: Any, role: str, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.role, self.kwargs = tokenizer, role, dict(chat_template_kwargs or {})
        base = self._text([{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}], False)
        end = base.rfind(_PROBE_ASSISTANT)
        if end < 0:
            raise ValueError("the chat template drops the assistant's message; it cannot render multi-turn trajectories "
                             "(rollout.multi_turn.tools needs a chat model's template)")
        self._base = base
        after = base[end + len(_PROBE_ASSISTANT):]
        after_ids = tokenizer(after, add_special_tokens=False)["input_ids"]
        special = set(getattr(tokenizer, "all_special_ids", []))
        closing = [i for i, t in enumerate(after_ids) if t in special]
        if not closing:
            raise ValueError("the chat template ends an assistant turn with no special token, so a turn cannot be closed "
                             "token-exactly; rollout.multi_turn.tools needs a chat model's template")
        self.close: tuple[int, ...] = tuple(after_ids[: closing[0] + 1])
        self._close_text = tokenizer.decode(list(self.close), skip_special_tokens=False)
        probe = tokenizer.decode(self.after_close(["packrl probe tool answer"]), skip_special_tokens=False)
        if "packrl probe tool answer" not in probe:  # checked now, not mid-run
            raise ValueError(f"the chat template drops {role!r} messages; "
                             "set rollout.multi_turn.tool_role to a role it renders (e.g. user)")

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs)

    def after_close(self, contents: Sequence[str]) -> list[int]:
        """Ids of the tool messages ``contents`` and the next assistant header, as the template
        renders them after an assistant turn's closing ids. The template's own text is tokenised
        with its special tokens; each content is tokenised as plain text (``split_special_tokens``),
        so a tool answer that contains ``<|im_end|>`` cannot forge the conversation's structure."""
        messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        slots = [_SLOT.format(i) for i in range(len(contents))]
        full = self._text(messages + [{"role": self.role, "content": slot} for slot in slots], True)
        prefix = self._base[: self._base.rfind(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT)] + self._close_text
        if not full.startswith(prefix) or any(full.count(slot) != 1 for slot in slots):
            raise ValueError(f"the chat template does not render {self.role!r} messages after an assistant turn as an "
                             "extension of the conversation; set rollout.multi_turn.tool_role to a role it accepts (e.g. user)")
        ids: list[int] = []
        for k, piece in enumerate(re.split(_SLOT_PATTERN, full[len(prefix):])):
            if k % 2:  # a slot: the content it stands for, as plain text
                ids += self.tokenizer(contents[int(piece)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            elif piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids
