"""The known verl key nearest to a misspelled one, ranked by meaning before spelling.

Tuning guides print verl's token-budget and batch keys in many spellings
(``ppo_max_tokens_len_per_gpu``, ``max_token_len``, ``ppo_micro_bsz_per_gpu``). Edit distance alone
answers some of them with an unrelated key: ``actor_rollout_ref.actor.max_token_len`` is closest in
spelling to ``actor_rollout_ref.actor.pad_to_length``, a padding switch. `nearest` ranks the known
keys by

1. what they share with the given key, one point each: its sections (``actor_rollout_ref``,
   ``actor``, ...) that the candidate's path holds, less each section the candidate adds below the
   last of those (``rollout.multi_turn.*`` for a ``rollout.*`` key), plus its name parts (``max``,
   ``token``, ``len``, ``micro``, ``batch``, ...) that the candidate's last segment holds;
2. then the fewest name parts the candidate adds;
3. then the edit similarity of the two last segments (difflib's ratio);
4. then the order of the table (the actor's key before the critic's of the same name).

Name parts are the ``_``-separated words with spelling variants folded (a plural ``s``,
``length``/``lenght`` = ``len``, ``resp`` = ``response``, ``bsz``/``batchsize`` = ``batch size``),
one typo allowed in a word of four letters or more. The key above scores 5 against
``actor_rollout_ref.actor.ppo_max_token_len_per_gpu`` (two sections; ``max``, ``token``, ``len``) and
3 against ``pad_to_length``. A known key that shares no name part is a candidate only when its
last segment is within difflib's 0.6 of the given one; with no candidate there is no hint (None).

Pure functions over strings, on the error path only: ranking the ~480 known keys and families takes tens of
milliseconds.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence

__all__ = ["name_parts", "nearest"]

_VARIANTS: dict[str, tuple[str, ...]] = {
    "length": ("len",), "lenght": ("len",), "resp": ("response",), "bsz": ("batch", "size"), "batchsize": ("batch", "size"),
    "microbatch": ("micro", "batch"), "minibatch": ("mini", "batch"),
}
"""Folded words -> the part(s) they stand for, after a plural ``s`` is dropped."""
_LEAF_CUTOFF = 0.6
"""The edit similarity of two last segments at which a key sharing no name part is still a hint."""


@functools.lru_cache(maxsize=4096)
def name_parts(segment: str) -> tuple[str, ...]:
    """The name parts of one key segment, spelling variants folded.

    ==================================  ==========================================
    segment                             parts
    ==================================  ==========================================
    ``ppo_max_token_len_per_gpu``       ppo, max, token, len, per, gpu
    ``ppo_max_tokens_length_per_gpu``   ppo, max, token, len, per, gpu
    ``ppo_micro_bsz_per_gpus``          ppo, micro, batch, size, per, gpu
    ==================================  ==========================================
    """
    parts: list[str] = []
    for word in segment.lower().replace("-", "_").split("_"):
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        if word:
            parts += _VARIANTS.get(word, (word,))
    return tuple(parts)


@functools.lru_cache(maxsize=65536)
def _alike(a: str, b: str) -> bool:
    """Whether two parts are the same word: equal, or, in words of 4+ letters, one typo apart (a
    letter added, dropped or changed, or two neighbours swapped: ``promt``, ``shuffel``)."""
    if a == b:
        return True
    if min(len(a), len(b)) < 4 or abs(len(a) - len(b)) > 1:
        return False
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if len(a) != len(b):
        longer, shorter = (a, b) if len(a) > len(b) else (b, a)
        return longer[i + 1:] == shorter[i:]
    swapped = a[i:i + 2] == b[i:i + 2][::-1] and a[i + 2:] == b[i + 2:]
    return a[i + 1:] == b[i + 1:] or swapped


def _shared(mine: Sequence[str], theirs: Sequence[str]) -> int:
    """How many distinct words of ``mine`` match a word of ``theirs``."""
    return sum(any(_alike(word, other) for other in theirs) for word in dict.fromkeys(mine))


def _spelling(leaf: str, their_leaf: str) -> float:
    """difflib's ratio of two last segments."""
    return difflib.SequenceMatcher(None, leaf, their_leaf).ratio()


def _meaning(sections: Sequence[str], parts: Sequence[str], name: str) -> tuple[int, int]:
    """``(shared, -added)`` of known ``name`` for a key of ``sections`` and leaf ``parts``.

    shared: the key's sections that ``name``'s path holds, less the sections ``name`` adds below
    the last of them (a sub-tree the key did not name: ``rollout.multi_turn`` for a ``rollout``
    key), plus the key's name parts that ``name``'s last segment holds. added: the parts of
    ``name``'s last segment that the key does not hold.
    """
    *their_sections, their_leaf = name.split(".")
    their_parts = name_parts(their_leaf)
    held = [i for i, section in enumerate(their_sections) if any(_alike(section, mine) for mine in sections)]
    deeper = len(their_sections) - held[-1] - 1 if held else 0
    added = len(set(their_parts)) - _shared(their_parts, parts)
    return len(held) - deeper + _shared(parts, their_parts), -added


def nearest(key: str, names: Sequence[str]) -> str | None:
    """The name in ``names`` nearest to dotted ``key``: the most sections and name parts shared,
    then the fewest words added (`_meaning`), then the closest spelling of the last segments,
    then the first in ``names``. A name that shares no name part with ``key`` is a candidate only
    when its last segment is within 0.6 of ``key``'s; None when there is no candidate."""
    *sections, leaf = key.split(".")
    parts = name_parts(leaf)
    candidates: list[tuple[tuple[int, int], int, str]] = []
    for index, name in enumerate(names):
        their_leaf = name.rsplit(".", 1)[-1]
        if _shared(parts, name_parts(their_leaf)) == 0:
            matcher = difflib.SequenceMatcher(None, leaf, their_leaf)  # the cheap bounds first, as difflib.get_close_matches
            if any(bound() < _LEAF_CUTOFF for bound in (matcher.real_quick_ratio, matcher.quick_ratio, matcher.ratio)):
                continue
        candidates.append((_meaning(sections, parts, name), index, name))
    if not candidates:
        return None
    top = max(meaning for meaning, _, _ in candidates)
    ties = [(_spelling(leaf, name.rsplit(".", 1)[-1]), -index, name) for meaning, index, name in candidates if meaning == top]
    return max(ties)[2]
