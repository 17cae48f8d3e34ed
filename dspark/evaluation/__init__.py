"""Evaluation: acceptance statistics and side-by-side drafter benchmarks."""
