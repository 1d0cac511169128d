"""Model-side pieces: attention backends for packs, packed log-probs (loading arrives with training)."""
