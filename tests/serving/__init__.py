"""Tests of the HTTP server (specexec/serving/)."""
