"""Reliability tests (issue 8): hostile inputs through the real CLI, faults, signals, concurrency, fuzzing."""
