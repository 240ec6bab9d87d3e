"""Tests of checkpoints: loading, the Hub, the catalogue (specexec/checkpoints/)."""
