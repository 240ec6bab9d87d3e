"""Tests of runtime assembly (specexec/runtime/)."""
