"""Survival estimates for draft blocks: signals, survival maps, calibration fitting and metrics."""
