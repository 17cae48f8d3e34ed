"""Training drafters against a frozen target: data, anchored blocks, losses, trainer."""
