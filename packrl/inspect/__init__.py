"""Tools that inspect data and configs before a run: `packrl audit` (prompt lengths of the data
as training would see them), `packrl preflight` (every problem of a run from its configs), the
memory estimate per device, and image-token counting for multimodal rows. They read the data
and model configs, never train; the trainer does not import them."""
