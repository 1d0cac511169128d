"""The built-in task `task:char_count` (registered in `packrl.registry.TASKS`): how many times a
letter occurs in a word spelt with dashes.

A row is a GSM8K-format dict ``{"question", "answer", "data_source", "reward_model"}``; the answer is
the concise worked answer, one line per letter with the running count, ending in ``#### <count>``::

    question                                      answer
    "How many r are in s-t-r-a-w-b-e-r-r-y?"      "s - no (0)\\nt - no (0)\\nr - yes (1)\\n ... y - no (3)\\n#### 3"

The dashes give each letter a token of its own (SmolLM2: ``s-t-r`` is ``s``, ``-``, ``t``, ``-``,
``r``), as verl-recipe's ``char_count`` task does; the reasoning the task needs is then one line per
letter, so the shortest correct worked answer is known for every row (`shortest_correct_response`).

Words are pronounceable pseudo-words, not dictionary words: syllables of an onset (a consonant or
a cluster such as ``st``, ``ch``), a vowel (sometimes two) and sometimes a closing consonant, cut
to a length drawn uniformly from ``data.char_count.min_letters .. max_letters``. They need no
word list, give an unbounded space of distinct rows, and repeat letters (vowels above all) as
words do. The answer is drawn first, uniformly over ``0 .. data.char_count.max_count``; then words
are drawn until one holds a letter exactly that often (or, for 0, lacks one), and the letter is
drawn from those. So a constant guess of the count is right for about ``1 / (max_count + 1)`` of
the rows (`guess_floor` gives the exact share of a set of rows). High counts need long words, so
they come from the longer words of the range.

A row also states its reference worked answer as its ground truth (verl's
``reward_model.ground_truth``): the ``char_count`` reward (`packrl.reward.char_count`) checks a
response's worked lines against it, and the ``gsm8k`` reward reads its final ``#### N``.

Rows are drawn from ``random.Random(seed)``, distinct while the space allows; the validation
split uses ``seed + VAL_SEED_OFFSET`` and excludes every training question (`split_rows`).

Three worked-answer styles (`worked_answer`), the SFT traces of ``task:char_count_traces``
(``sft.trace_style``, `packrl.data.char_count_traces`):

- ``concise``: the answer of the row, one line per letter, then ``#### N``.
- ``verbose``: an opening line, each concise line followed by its restatement in words
  (``r is r; now 1.``), a filler line after every 4th letter (from a position and with texts the
  row draws from its own seed) and a closing line: correct throughout, 2.7 to 3.1 times the
  concise answer's tokens with SmolLM2's tokenizer (mean 2.85 over 2,000 rows of the defaults).
- ``thinking``: the concise lines inside ``<think>\\n ... \\n</think>``, then ``#### N``.
"""

from __future__ import annotations

import logging
import random
import re
import zlib
from collections import Counter
from collections.abc import Collection
from typing import Any, get_args

from packrl.config.sft import TraceStyle
from packrl.config.tasks import VAL_SEED_OFFSET, CharCountConfig
from packrl.data.task_sources import TaskRequest
from packrl.registry import TASKS

logger = logging.getLogger("packrl.data")

CHAR_COUNT_SOURCE = "packrl/char_count"
"""``data_source`` of `task:char_count` rows."""
STYLES: tuple[str, ...] = get_args(TraceStyle)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "qu", "sh", "sl", "st", "th", "tr", "wh", "x")
_VOWELS = "aeiou"
_CODAS = ("n", "r", "s", "t", "l", "m", "k", "ng", "ck", "x")
_FILLERS = ("Let me check the next letter carefully.", "I should not skip any letter.",
            "So far so good, on to the next letter.", "I will keep going one letter at a time.")
_FILLER_EVERY = 4  # a filler line follows every 4th letter (but the last) from a position the row draws
_DRAWS_PER_COUNT = 200  # words drawn for one count before the letter is placed by hand
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_DRAWS_PER_ROW = 20  # rejection-sampling cap: a space too small to fill the rows stops after this many draws per row
_QUESTION = re.compile(r"How many ([a-z]) are in ([a-z](?:-[a-z])*)\?")


def pseudo_word(rng: random.Random, num_letters: int) -> str:
    """A pronounceable pseudo-word of exactly ``num_letters`` lowercase letters (module docstring)."""
    word = ""
    while len(word) < num_letters:
        onset = rng.choice(_ONSETS) if rng.random() < 0.9 else ""
        vowel = rng.choice(_VOWELS) + (rng.choice(_VOWELS) if rng.random() < 0.15 else "")
        coda = rng.choice(_CODAS) if rng.random() < 0.3 else ""
        word += onset + vowel + coda
    return word[:num_letters]


def question_of(word: str, letter: str) -> str:
    """``"How many r are in s-t-r-a-w-b-e-r-r-y?"``."""
    return f"How many {letter} are in {'-'.join(word)}?"


def parse_question(text: str) -> tuple[str, str]:
    """``(word, letter)`` of the `task:char_count` question in ``text`` (a question, or a user
    message that holds one, instruction and all).

    Raises:
        ValueError: ``text`` holds no such question.
    """
    found = _QUESTION.search(text)
    if found is None:
        raise ValueError(f"no task:char_count question ('How many <letter> are in <l-e-t-t-e-r-s>?') in {text[:120]!r}")
    return found.group(2).replace("-", ""), found.group(1)


def worked_answer(word: str, letter: str, style: str = "concise", *, redundancy: float = 1.0,
                  draw: random.Random | None = None) -> str:
    """The worked answer to "how many ``letter`` in ``word``" in ``style`` (module docstring), ending
    in ``#### <count>``; every line of it is correct.

    ``redundancy`` < 1 (``verbose`` only): each redundant line (the opening, a restatement, a filler,
    the closing) is written with that chance, drawn per line from ``draw``; the worked lines and the
    final count always are, so the answer stays correct under the strict reading.

    Raises:
        ValueError: an unknown style (the choices are `STYLES`, ``sft.trace_style``).
    """
    if style not in STYLES:
        raise ValueError(f"sft.trace_style={style!r} is not one of {', '.join(STYLES)}; set sft.trace_style=concise")
    count, lines, verbose = 0, [], []
    rng = random.Random(zlib.crc32(f"{letter}:{word}".encode()))  # the row's own draw: the same text every time
    offset = rng.randrange(_FILLER_EVERY)
    for k, c in enumerate(word):
        hit = c == letter
        count += hit
        lines.append(f"{c} - {'yes' if hit else 'no'} ({count})")
        verbose += [lines[-1], f"{c} is {letter}; now {count}." if hit else f"{c} is not {letter}; still {count}."]
        if k % _FILLER_EVERY == offset and k + 1 < len(word):
            verbose.append(rng.choice(_FILLERS))
    final = f"#### {count}"
    if style == "concise":
        return "\n".join([*lines, final])
    if style == "thinking":
        return "\n".join([THINK_OPEN, *lines, THINK_CLOSE, final])
    opening = f"I will check each letter for {letter}."
    closing = f"So {letter} appears {'once' if count == 1 else f'{count} times'}." if count else f"So {letter} does not appear."
    assert redundancy >= 1 or draw is not None, "a redundancy below 1 draws each line from draw"
    worked = set(lines)
    kept = [line for line in [opening, *verbose, closing]
            if redundancy >= 1 or line in worked or (draw is not None and draw.random() < redundancy)]
    return "\n".join([*kept, final])


def shortest_correct_response(question: str, tokenizer: Any) -> tuple[str, int]:
    """The shortest correct response to a `task:char_count` question and its length in tokens.

    It is the concise worked answer (one line per letter, then ``#### N``): the least that shows
    the reasoning the task needs (the ``gsm8k`` reward alone would accept a bare ``#### N``). The
    length counts the answer's tokens under ``tokenizer`` (no special tokens added) plus one: the
    end-of-turn (EOS) token a finished response ends with, as packrl's engines keep it as the
    response's last token, so it compares with ``response_length/*`` of a rollout.

    Args:
        question: the question, or the user message holding it (`parse_question`).
        tokenizer: a Hugging Face tokenizer.

    Returns:
        ``(text, num_tokens)``.

    Raises:
        ValueError: ``question`` holds no `task:char_count` question.
    """
    text = worked_answer(*parse_question(question), "concise")
    return text, len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1


def _draw(rng: random.Random, cfg: CharCountConfig) -> dict[str, Any]:
    count = rng.randint(0, cfg.max_count)
    for _ in range(_DRAWS_PER_COUNT):
        word = pseudo_word(rng, rng.randint(max(cfg.min_letters, count), cfg.max_letters))
        letters = sorted({c for c in word if word.count(c) == count}) if count else sorted(set(_ALPHABET) - set(word))
        if letters:
            return row_of(word, rng.choice(letters))
    word, letter = pseudo_word(rng, cfg.max_letters), rng.choice(_ALPHABET)  # rare settings (e.g. 3 of 3 letters): place it
    spare = next(c for c in _ALPHABET if c != letter)
    chars = [spare if c == letter else c for c in word]
    for k in rng.sample(range(len(chars)), count):
        chars[k] = letter
    return row_of("".join(chars), letter)


def row_of(word: str, letter: str) -> dict[str, Any]:
    """The `task:char_count` row asking how many ``letter`` are in ``word``: GSM8K fields (the
    question, the concise worked answer) and the answer again as ``reward_model.ground_truth``."""
    answer = worked_answer(word, letter)
    return {"question": question_of(word, letter), "answer": answer, "data_source": CHAR_COUNT_SOURCE,
            "reward_model": {"ground_truth": answer}}


def guess_floor(rows: Collection[dict[str, Any]]) -> float:
    """The accuracy of the best constant guess of the count over ``rows`` (the share of the most
    common count): what a policy scores on the final ``#### N`` alone without reading the word.
    0.0 for no rows."""
    counts = Counter(int(r["answer"].rsplit("####", 1)[-1]) for r in rows)
    return max(counts.values()) / len(rows) if rows else 0.0


def _check(cfg: CharCountConfig) -> None:
    problems = cfg.problems("data.char_count")
    if problems:
        p = problems[0]
        raise ValueError(f"{p.key}={p.value!r} {p.message}; {p.fix}")


def char_count_rows(num_rows: int, cfg: CharCountConfig, seed: int, *, exclude: Collection[str] = ()) -> list[dict[str, Any]]:
    """Generate ``num_rows`` `task:char_count` rows (module docstring) from ``random.Random(seed)``.

    Args:
        num_rows: rows to return.
        cfg: ``data.char_count`` (word lengths, ``max_count``; its ``num_rows`` is not read here).
        seed: seeds the draw; the same arguments always give the same rows.
        exclude: questions not to generate while other questions remain (the validation split
            passes the training questions).

    Returns:
        ``num_rows`` dicts ``{"question", "answer", "data_source", "reward_model"}`` (`row_of`), distinct while the space of
        questions allows (a smaller space repeats rows, logged).

    Raises:
        ValueError: a non-positive ``num_rows``, a ``cfg`` that fails its checks, or no question
            drawn outside ``exclude``.
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(f"num_rows={num_rows!r} must be a positive integer; set data.char_count.num_rows=1 or more")
    _check(cfg)
    rng = random.Random(seed)
    excluded = set(exclude)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(_DRAWS_PER_ROW * num_rows + 1000):
        if len(rows) == num_rows:
            break
        row = _draw(rng, cfg)
        if row["question"] not in seen and row["question"] not in excluded:
            seen.add(row["question"])
            rows.append(row)
    if not rows:
        raise ValueError(f"task:char_count drew no question outside the {len(excluded)} excluded (the training split's) for "
                         f"words of {cfg.min_letters}-{cfg.max_letters} letters: the validation rows would be training rows; "
                         "raise data.char_count.max_letters or lower data.char_count.num_rows")
    if len(rows) < num_rows:
        logger.warning("task:char_count has only %d distinct questions left for these settings; %d rows repeat (raise "
                       "data.char_count.max_letters for more)", len(rows), num_rows - len(rows))
        rows += [dict(rng.choice(rows)) for _ in range(num_rows - len(rows))]
    floor = guess_floor(rows)
    if floor > 1 / (cfg.max_count + 1) + 0.1:
        logger.warning("task:char_count: a constant guess of the count is right for %.0f%% of these rows (uniform counts would "
                       "give %.0f%%): too few distinct words hold each count; raise data.char_count.max_letters",
                       100 * floor, 100 / (cfg.max_count + 1))
    return rows


def split_rows(cfg: CharCountConfig, seed: int, split: str) -> list[dict[str, Any]]:
    """The ``data.char_count.num_rows`` rows of ``split``: ``train`` from ``seed``; ``val`` from
    ``seed + VAL_SEED_OFFSET`` without any training question, each question once."""
    if split == "train":
        return char_count_rows(cfg.num_rows, cfg, seed)
    train = [r["question"] for r in char_count_rows(cfg.num_rows, cfg, seed)]
    rows = char_count_rows(cfg.num_rows, cfg, seed + VAL_SEED_OFFSET, exclude=train)
    return list({r["question"]: r for r in rows}.values())  # a repeated validation row adds cost, not information


@TASKS.register("char_count")
def char_count_task(request: TaskRequest) -> list[dict[str, Any]]:
    """``task:char_count``: `split_rows` of ``data.char_count`` (``request.options``) for the request's split and seed."""
    return split_rows(request.options, request.seed, request.split)
