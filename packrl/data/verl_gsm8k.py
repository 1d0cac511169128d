"""GSM8K jsonl -> verl's RL parquet (``packrl data gsm8k``), row for row as verl's
``examples/data_preprocess/gsm8k.py`` writes it, from local files (no hub, no ``datasets``).

Each usable row becomes::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + VERL_GSM8K_INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": first `#### (-?[0-9.,]+)` match, commas removed}
    extra_info    {"split": "train" | "test", "index": the row's position in its file (0-based),
                   "answer": the raw solution, "question": the raw question}

The arrow schema is verl's (``datasets`` infers it from the same dicts): strings, an ``int64``
index, structs with the fields in the order above, ``prompt`` a list of ``{role, content}``.
verl's script asserts on a row without a ``#### <number>`` answer and stops; here such a row (and
a line that is not a JSON object with string ``question`` and ``answer``) is left out, counted
and named in `SplitAccounting`, and the other rows keep their file positions as ``index``.
Converting the 8,792 rows of GSM8K takes about 0.5 s (2-core CPU, under load).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrl.config.schema import DataConfig
from packrl.data.loaders import BadRow, load_rows

VERL_GSM8K_SOURCE = "openai/gsm8k"
VERL_GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
"""verl's ``instruction_following`` string, appended to each question after one space."""
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's extract_solution
SPLITS: tuple[str, ...] = ("train", "test")


def verl_schema() -> Any:
    """The pyarrow schema of verl's GSM8K parquet files."""
    import pyarrow as pa

    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                                  ("question", pa.string())])),
    ])


def extract_answer(solution: str) -> str | None:
    """verl's ``extract_solution``: the first ``#### <number>`` of ``solution``, commas removed;
    None where verl's script would fail its assert.

    ==========================  ==========
    solution                    result
    ==========================  ==========
    ``"... #### 72"``           ``"72"``
    ``"... #### 1,234"``        ``"1234"``
    ``"... #### -3.5"``         ``"-3.5"``
    ``"... #### ten"``          ``None``
    ==========================  ==========
    """
    match = _ANSWER.search(solution)
    return match.group(1).replace(",", "") if match else None


def verl_row(raw: Any, *, split: str, index: int) -> dict[str, Any] | str:
    """One GSM8K row as verl writes it, or the reason it cannot be converted."""
    if isinstance(raw, BadRow):
        return raw.reason
    if not isinstance(raw, dict):
        return f"row is of type {type(raw).__name__}, not an object"
    question, answer = raw.get("question"), raw.get("answer")
    for name, value in (("question", question), ("answer", answer)):
        if not isinstance(value, str):
            return f"missing field {name!r}" if value is None else f"field {name!r} is of type {type(value).__name__}, expected a string"
    assert isinstance(question, str) and isinstance(answer, str)  # the loop returned otherwise
    if not question.strip():
        return "blank question"
    truth = extract_answer(answer)
    if truth is None:
        tail = answer.strip().splitlines()[-1][:60] if answer.strip() else ""
        return f"no '#### <number>' answer (last line: {tail!r})"
    return {
        "data_source": VERL_GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {VERL_GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


@dataclass(frozen=True)
class SplitAccounting:
    """Where the rows of one split went.

    Attributes:
        split: ``train`` or ``test``.
        source: the jsonl file read.
        output: the parquet file written.
        num_rows: rows read (non-blank lines).
        num_written: rows written.
        skipped: ``(index, reason)`` of every row left out; ``num_rows = num_written + len(skipped)``.
    """

    split: str
    source: Path
    output: Path
    num_rows: int
    num_written: int
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        line = f"{self.split}: {self.num_rows:,} rows read from {self.source}, {self.num_written:,} written to {self.output}"
        if not self.skipped:
            return line
        shown = "; ".join(f"row {i}: {reason}" for i, reason in self.skipped[:5])
        more = f"; and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
        return f"{line}, {len(self.skipped):,} left out ({shown}{more})"

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "source": str(self.source), "output": str(self.output), "num_rows": self.num_rows,
                "num_written": self.num_written, "skipped": [{"index": i, "reason": r} for i, r in self.skipped]}


def write_verl_gsm8k(source: Path, split: str, output: Path) -> SplitAccounting:
    """Convert one GSM8K jsonl file into verl's parquet at ``output`` (parent folders made).

    Args:
        source: a GSM8K ``.jsonl`` (or ``.json``/``.parquet``) file with ``question``/``answer`` rows.
        split: ``train`` or ``test``, written to ``extra_info.split``.
        output: the parquet file to write (replaced if it exists).

    Returns:
        `SplitAccounting`: rows read, written and left out with the reasons.

    Raises:
        ValueError: ``split`` is unknown, ``source`` cannot be read or has no rows, or no row
            converts (nothing would be written).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {', '.join(SPLITS)}")
    if not Path(source).is_file():
        raise ValueError(f"--{split}: {str(source)!r} is not a file; "
                         f"give the GSM8K {split} .jsonl file (or --input-dir holding {split}.jsonl)")
    rows = load_rows(str(source), data=DataConfig(), seed=0, split="train", key=f"--{split}")
    written, skipped = [], []
    for index, raw in enumerate(rows):
        row = verl_row(raw, split=split, index=index)
        if isinstance(row, str):
            skipped.append((index, row))
        else:
            written.append(row)
    if not written:
        first = skipped[0][1] if skipped else "no rows"
        raise ValueError(f"--{split}: none of the {len(rows):,} rows of {str(source)!r} converts (row 0: {first}); "
                         "give a GSM8K jsonl file with 'question' and 'answer' fields ending in '#### <number>'")
    output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(written, schema=verl_schema()), output)
    return SplitAccounting(split, source, output, len(rows), len(written), skipped)
