"""Tests of measuring and tuning (specexec/tuning/)."""
