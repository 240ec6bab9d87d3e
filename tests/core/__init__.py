"""Tests of the decoding core (specexec/)."""
