"""Correctness checks, benchmarks, reports and the results ledger (no DSL import here)."""
