"""Tests written to kill surviving mutants of the lossless core (benchmarks/mutation_test.sh)."""
