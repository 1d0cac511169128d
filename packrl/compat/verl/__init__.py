"""verl compatibility: a verl launch script's overrides -> the packrl run they describe (`packrl verl`).

=================  ==================================================================
module             holds
=================  ==================================================================
``rules``          `KeyRule` (what packrl does with one verl key) and its three forms
``keys``           the key table: every verl key packrl knows (verl 0.9.1's config and the
                   older spellings) and the packrl keys it reaches, executable (``convert``)
                   or relational (``by``); verl's defaults
``convert``        the one-value conversions the executable rules apply
``nearest``        the known key nearest a misspelled one (shared sections and name parts,
                   then spelling), for the error's fix
``overrides``      Hydra override parsing; `Translation` and its parts
``context``        the state of one translation (`Context`)
``relational``     the conversions that need several verl keys at once
``translate``      `translate` (table, then relational, then the rest), `train_files_of`,
                   `sources_of`
=================  ==================================================================

See docs/verl.md.
"""

from packrl.compat.verl.overrides import Translation, parse_override
from packrl.compat.verl.translate import PRESET, sources_of, train_files_of, translate

__all__ = ["PRESET", "Translation", "parse_override", "sources_of", "train_files_of", "translate"]
