"""The epoch sampler of every recipe: batches of positions over any indexable data (RL's prompts,
`packrl.data.dataset.PromptDataset`; SFT's traces, `packrl.data.traces.Traces`), reshuffled every
epoch and resumable exactly, with a fingerprint of the data so a resume on other data is refused.

Epoch ``e`` visits the items in the order of ``random.Random(f"packrl-sampler:{seed}:{e}")`` (a
string seed hashes with SHA-512, so seeds 0 and 1 do not share shifted orders and the order does
not depend on PYTHONHASHSEED); without shuffle, in data order. The position ``(epoch, index)``
is the sampler's whole state: ``state_dict`` saves it with the seed, the item count and the data's
fingerprint, and a checkpoint holds it (`packrl.trainer.resume`).
"""

from __future__ import annotations

import logging
import random
from typing import Any, Protocol

logger = logging.getLogger("packrl.data")


class SampledData(Protocol):
    """What the sampler needs of its data: a length, a fingerprint of the items in order, and the
    config key they come from (named in errors)."""

    @property
    def key(self) -> str:
        """The config key of the data, e.g. ``data.train_files`` or ``sft.train_files``."""
        ...

    def __len__(self) -> int: ...

    def fingerprint(self) -> str:
        """A digest of every item in order: what a resumed run must find again."""
        ...


class EpochSampler:
    """Positions of ``batch_size`` items of ``data``, epoch after epoch.

    Args:
        data: the items (`SampledData`).
        batch_size: items per batch.
        shuffle: a new seeded order every epoch (else data order).
        seed: the order's seed (``train.seed``).
        drop_last: when fewer than ``batch_size`` items remain in an epoch they are skipped and the
            next epoch starts (a drop-last loader: a batch never holds one item twice, and a
            reshuffle drops different items each epoch). False: a batch takes the epoch's rest and
            continues in the next epoch's order, so every item is drawn once per epoch and a batch
            may span epochs (or several, when ``batch_size`` exceeds the data).
        noun: what an item is called in messages (``prompts``, ``traces``).

    Raises:
        ValueError: ``batch_size`` < 1, or no item at all.
    """

    def __init__(self, data: SampledData, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True, noun: str = "items"):
        if batch_size < 1 or not len(data):
            raise ValueError(f"{data.key}: cannot draw batches of {batch_size} from {len(data)} {noun}")
        self.data, self.batch_size, self.shuffle, self.seed = data, batch_size, shuffle, seed
        self.drop_last, self.noun = drop_last, noun
        self.epoch, self.index = 0, 0
        self._order: list[int] | None = None
        self._data_fingerprint: str | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.data)))
            if self.shuffle:
                random.Random(f"packrl-sampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order = order
        return self._order

    def _next_epoch(self) -> None:
        self.epoch, self.index, self._order = self.epoch + 1, 0, None

    def next_indices(self) -> list[int]:
        """The positions (0 .. len - 1) of the next batch (see ``drop_last``)."""
        if self.drop_last:
            if len(self.data) - self.index < self.batch_size:
                self._next_epoch()
            out = self._epoch_order()[self.index : self.index + self.batch_size]
            self.index += self.batch_size
            return out
        out = []
        while len(out) < self.batch_size:
            if self.index == len(self.data):
                self._next_epoch()
            take = self._epoch_order()[self.index : self.index + self.batch_size - len(out)]
            out += take
            self.index += len(take)
        return out

    @property
    def epochs_drawn(self) -> float:
        """Items drawn so far over the items there are (``sft/epoch``)."""
        return self.epoch + self.index / len(self.data)

    def fingerprint(self) -> str:
        """The data's fingerprint, computed once."""
        if self._data_fingerprint is None:
            self._data_fingerprint = self.data.fingerprint()
        return self._data_fingerprint

    def state_dict(self) -> dict[str, Any]:
        """``{epoch, index, seed, num_prompts, fingerprint}``: enough to continue exactly where this
        sampler is, and to tell whether the data is still the same (``num_prompts`` counts the
        items, whatever they are: the name RL checkpoints have always used)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_prompts": len(self.data),
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`); the saved seed wins so the order is the saved run's.

        Raises:
            ValueError: the state holds no position (a checkpoint written before its recipe saved
                one), its item count or its fingerprint differs from this data's (the data changed:
                the saved position would point at other items).
        """
        if "epoch" not in state or "index" not in state:
            raise ValueError(f"the checkpoint holds no data position for {self.data.key} (it was written before the run saved "
                             "one), so the run cannot continue on the same items; start a new run (a new train.out_dir)")
        num = state.get("num_prompts", len(self.data))
        if num != len(self.data):
            raise ValueError(f"sampler state is for {num} {self.noun} but {self.data.key} now gives {len(self.data)}; "
                             f"resume with the same {self.data.key} and the settings that shape its {self.noun}, or start a new run")
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint():
            raise ValueError(
                f"the {self.noun} of {self.data.key} differ from the checkpoint's ({len(self.data)} {self.noun} either way, "
                f"fingerprint {self.fingerprint()} != {saved}): the saved data position would point at other {self.noun}; "
                f"resume with the same {self.data.key} and the settings that shape its {self.noun}, or start a new run "
                "(a new train.out_dir)")
        if state["seed"] != self.seed:
            logger.warning("resuming the sampler with its saved seed %d, not train.seed=%d", state["seed"], self.seed)
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        self._order = None
