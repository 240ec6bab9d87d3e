"""Tests of the memory planner: the ledger, sizes, run shape (specexec/planning/)."""
