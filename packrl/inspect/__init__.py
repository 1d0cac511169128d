"""Tools that inspect data and configs before a run: `packrl audit` (prompt lengths of the data
as training would see them, rows with images through the configured model's processor),
`packrl preflight` (every problem of a run from its configs) and the memory estimate per device.
They read the data and model configs, never train; the trainer does not import them."""
