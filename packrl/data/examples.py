"""Normalise one raw row into an `Example` (a chat, a ground truth, a data source) or a reason.

Two schemas, detected per row:

    schema   detected by             chat                                     ground truth
    verl     a `prompt` field        `prompt` messages as given (+ system)    `reward_model.ground_truth`
    GSM8K    `question`/`answer`     [system], user: question + " " + instr.  text after the last `####`

GSM8K ground truths are cleaned (stripped; `,` and `$` removed) and must be numbers, as
`"72"`, `"-3"`, `"0.5"`, unless the row states its own as text in `reward_model.ground_truth` (as
`task:char_count` rows do: the reference worked answer, whose worked lines its reward checks; the
answer's final number must still be a number); verl ground truths are kept as text (MATH answers such as
`\\frac{1}{2}` are valid there). verl's preprocessing already wrote the instruction into the
prompt, so verl rows get no instruction appended; `data.system_prompt` is prepended to a verl
chat only when it has no system message of its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrl.data.images import ImageRef, image_ref
from packrl.data.loaders import BadRow

GSM8K_SOURCE = "openai/gsm8k"
ARITHMETIC_SOURCE = "packrl/arithmetic"
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


@dataclass(frozen=True, slots=True)
class Example:
    """One usable row before tokenization.

    Attributes:
        chat: the chat messages, each ``{"role": str, "content": str}`` (verl rows keep any
            other non-null keys of their messages).
        ground_truth: the reference answer as text, e.g. ``"72"``.
        data_source: reward dispatch key, e.g. ``"openai/gsm8k"``.
        row: global index of the row over all sources of the split.
        extra_info: verl's ``extra_info`` dict, kept as is (None for GSM8K rows).
        images: the row's images in order (`packrl.data.images.ImageRef`); each is an
            ``{"type": "image"}`` part of a message whose content is then a list of parts
            (``{"type": "text", "text": str}`` for the text around it). Empty for a text row.
        length_target: the response length the prompt asks for, in tokens (``data.length_target``,
            `packrl.data.length_targets`); None = none.
        length_mode: how it asks, ``exact`` or ``max`` (``data.length_target.mode_column``); None =
            as the ``target_length`` objective's ``mode`` says.
    """

    chat: list[dict[str, Any]]
    ground_truth: str
    data_source: str
    row: int
    extra_info: dict[str, Any] | None = field(default=None, compare=False)
    images: tuple[ImageRef, ...] = field(default=(), compare=False)
    length_target: int | None = field(default=None, compare=False)
    length_mode: str | None = field(default=None, compare=False)


def clean_number(text: str) -> str | None:
    """``text`` stripped, with ``,`` and ``$`` removed, or None when that is not a finite number.

    ==============  ==========
    text            result
    ==============  ==========
    ``" 1,234 "``   ``"1234"``
    ``"$-3.50"``    ``"-3.50"``
    ``"72 apples"`` ``None``
    ``"1e999"``     ``None`` (not finite)
    ==============  ==========
    """
    cleaned = text.strip().replace(",", "").replace("$", "").strip()
    return cleaned if _NUMBER.fullmatch(cleaned) and math.isfinite(float(cleaned)) else None


def to_example(
    raw: Any,
    *,
    row: int,
    instruction: str,
    system_prompt: str | None,
    data_source: str = GSM8K_SOURCE,
    base_dir: Path | None = None,
) -> Example | str:
    """Normalise one raw row.

    Args:
        raw: the row as loaded (a dict, a `BadRow`, or anything a file held).
        row: global row index, stored in the example.
        instruction: ``data.instruction``, appended after a space to GSM8K questions.
        system_prompt: ``data.system_prompt``, or None.
        data_source: the data source of GSM8K-style rows without their own string
            ``data_source`` field (``"packrl/arithmetic"`` for the built-in task).
        base_dir: the data file's folder: relative image paths are read from there.

    Returns:
        An `Example`, or the reason the row is bad (e.g. ``"non-numeric answer: 'ten'"``).
    """
    if isinstance(raw, BadRow):
        return raw.reason
    if not isinstance(raw, dict):
        return f"row is of type {type(raw).__name__}, not an object"
    if "prompt" in raw:
        return _verl_example(raw, row=row, system_prompt=system_prompt, base_dir=base_dir)
    if "question" in raw or "answer" in raw:
        return _gsm8k_example(raw, row=row, instruction=instruction, system_prompt=system_prompt, data_source=data_source)
    if "reward_model" in raw:
        return "missing field 'prompt' (verl schema)"
    fields = ", ".join(sorted(map(str, raw))[:8]) or "none"
    return f"neither GSM8K fields (question, answer) nor verl fields (prompt, reward_model); fields: {fields}"


def _system(system_prompt: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def _gsm8k_example(raw: dict, *, row: int, instruction: str, system_prompt: str | None, data_source: str) -> Example | str:
    question, answer = raw.get("question"), raw.get("answer")
    for name, value in (("question", question), ("answer", answer)):
        if value is None:
            return f"missing field {name!r}"
        if not isinstance(value, str):
            return f"field {name!r} is of type {type(value).__name__}, expected a string"
        if (broken := _invalid_unicode(value)) is not None:
            return f"field {name!r} {broken}"
    assert isinstance(question, str) and isinstance(answer, str)  # the loop returned otherwise
    if not question.strip():
        return "empty question"
    ground_truth = clean_number(answer.rsplit("####", 1)[-1])
    if ground_truth is None:
        return f"non-numeric answer: {_clip(answer.rsplit('####', 1)[-1].strip())!r}"
    if "reward_model" in raw:  # the row states its ground truth as text
        stated, problem = _stated_ground_truth(raw["reward_model"])
        if problem:
            return problem
        ground_truth = stated
    own_source = raw.get("data_source")
    content = f"{question} {instruction}" if instruction else question
    return Example(
        chat=_system(system_prompt) + [{"role": "user", "content": content}],
        ground_truth=ground_truth,
        data_source=own_source if isinstance(own_source, str) and own_source else data_source,
        row=row,
    )


def _stated_ground_truth(reward_model: Any) -> tuple[str, str]:
    """A GSM8K row's own ``reward_model.ground_truth`` (text, e.g. a reference worked answer that a
    reward reads beyond its final number) and ``""``, or ``("", reason)`` when it is malformed."""
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if not isinstance(truth, str) or not truth.strip():
        return "", "field 'reward_model.ground_truth' of a GSM8K row must be a non-empty string"
    if (broken := _invalid_unicode(truth)) is not None:
        return "", f"field 'reward_model.ground_truth' {broken}"
    return truth.strip(), ""


def _verl_example(raw: dict, *, row: int, system_prompt: str | None, base_dir: Path | None) -> Example | str:
    column = raw.get("images")
    parsed = _image_messages(raw["prompt"], column if column is not None else (() if "images" in raw else None), base_dir)
    if isinstance(parsed, str):
        return parsed
    chat, images = parsed
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict):
        if reward_model is None:
            return "missing field 'reward_model'"
        return f"field 'reward_model' is of type {type(reward_model).__name__}, expected an object"
    truth = reward_model.get("ground_truth")
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        kind = "missing" if truth is None else f"of type {type(truth).__name__}, expected a string or number"
        return f"field 'reward_model.ground_truth' is {kind}"
    if not str(truth).strip():
        return "empty field 'reward_model.ground_truth'"
    if isinstance(truth, float) and not math.isfinite(truth):
        return f"field 'reward_model.ground_truth' is {truth}, not a finite number"
    if isinstance(truth, str) and (broken := _invalid_unicode(truth)) is not None:
        return f"field 'reward_model.ground_truth' {broken}"
    source = raw.get("data_source")
    if not isinstance(source, str) or not source:
        return "missing field 'data_source'" if source is None else f"field 'data_source' is {source!r}, expected a non-empty string"
    extra = raw.get("extra_info")
    if system_prompt and not any(m["role"] == "system" for m in chat):
        chat = _system(system_prompt) + chat
    return Example(chat=chat, ground_truth=str(truth).strip(), data_source=source, row=row,
                   extra_info=extra if isinstance(extra, dict) else None, images=images)


IMAGE_MARKER = "<image>"
"""verl's image marker in a message's text: the row's ``images`` take the markers' places in order."""


def _image_messages(prompt: Any, images: Any, base_dir: Path | None) -> tuple[list[dict[str, Any]], tuple[ImageRef, ...]] | str:
    """verl's ``prompt`` with its images: ``<image>`` markers in string contents take the row's
    ``images`` column in order (verl's ``_build_messages``), and list contents' image parts
    (``{"type": "image", "image" | "path": ...}``) theirs. Returns the chat with image messages
    as lists of parts, and the image references; or the reason the row is bad."""
    prompt, images = as_list(prompt), as_list(images)
    has_parts = isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) and isinstance(m.get("content"), (list, tuple))
                                                             for m in prompt)
    if not images and not has_parts:
        plain = _messages(prompt)
        if isinstance(plain, str):
            return plain
        markers = sum(m["content"].count(IMAGE_MARKER) for m in plain)
        if images is not None and markers:  # the row has an images field, empty or null
            return f"{markers} {IMAGE_MARKER} marker(s) for 0 image(s) in field 'images'; give one image per marker"
        return plain, ()
    if images is not None and not isinstance(images, (list, tuple)):
        return f"field 'images' is of type {type(images).__name__}, expected a list"
    column = list(images or [])
    refs: list[Any] = []
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(prompt if isinstance(prompt, (list, tuple)) else []):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"prompt[{i}] is not a message with a string role"
        parts = _content_parts(i, message.get("content"), column, refs)
        if isinstance(parts, str):
            return parts
        chat.append({"role": message["role"], "content": parts})
    if not chat:
        return "field 'prompt' is not a non-empty list of chat messages"
    if None in refs or column:
        markers = sum(isinstance(m.get("content"), str) and m["content"].count(IMAGE_MARKER) for m in prompt)
        return f"{markers} {IMAGE_MARKER} marker(s) for {len(images or [])} image(s) in field 'images'; give one image per marker"
    resolved = [image_ref(r, base_dir) for r in refs]
    for k, ref in enumerate(resolved):
        if isinstance(ref, str):
            return f"image {k}: {ref}"
    return chat, tuple(r for r in resolved if isinstance(r, ImageRef))


def _content_parts(i: int, content: Any, column: list[Any], refs: list[Any]) -> list[dict[str, Any]] | str:
    """Message i's content as text and image parts, or the reason it is bad. Each image part
    appends its reference to ``refs``: a marker's is the next of the ``images`` ``column`` (None
    when the column ran out), a part's its own ``image`` or ``path``."""
    parts: list[dict[str, Any]] = []
    if isinstance(content, str):
        for k, piece in enumerate(content.split(IMAGE_MARKER)):
            if k:
                parts.append({"type": "image"})
                refs.append(column.pop(0) if column else None)
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if not isinstance(content, (list, tuple)):
        return f"prompt[{i}].content is {type(content).__name__}, expected a string or a list of parts"
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            return f"prompt[{i}].content[{k}] is {type(part).__name__}, expected a part {{type: text | image}}"
        kind = part.get("type")
        if kind == "image":
            ref = part.get("image") if part.get("image") is not None else part.get("path")
            if ref is None:
                return f"prompt[{i}].content[{k}] is an image part without 'image' or 'path' (keys: {', '.join(sorted(map(str, part)))})"
            parts.append({"type": "image"})
            refs.append(ref)
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            return f"prompt[{i}].content[{k}] has type {kind!r}; packrl reads text and image parts"
    return parts


def as_list(value: Any) -> Any:
    """A numpy array (pandas-read parquet) as a list; anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str)) else value


def _messages(prompt: Any) -> list[dict[str, Any]] | str:
    """verl's ``prompt`` as a list of message dicts, or the reason it is not one.

    Parquet gives a list of dicts (pyarrow) or a numpy array of dicts (pandas); struct columns
    fill keys a message lacks with None, and those keys are dropped.
    """
    prompt = as_list(prompt)  # numpy array of dicts
    if not isinstance(prompt, (list, tuple)):
        return f"field 'prompt' is of type {type(prompt).__name__}, expected a list of chat messages"
    if not prompt:
        return "field 'prompt' is an empty list"
    out = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"prompt[{i}] is of type {type(message).__name__}, expected a message object"
        for name in ("role", "content"):
            value = message.get(name)
            if not isinstance(value, str):
                kind = "missing" if value is None else type(value).__name__
                return f"prompt[{i}].{name} is {kind}, expected a string"
            if (broken := _invalid_unicode(value)) is not None:
                return f"prompt[{i}].{name} {broken}"
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _invalid_unicode(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate from a ``\\ud800`` JSON escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"is not valid Unicode (lone surrogate at character {err.start})"
    return None


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
