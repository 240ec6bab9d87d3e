"""Tests of the command line and bench (cli/, cli/bench/)."""
