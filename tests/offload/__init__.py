"""Tests of weight offloading (offload/)."""
