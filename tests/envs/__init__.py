"""Tests of producer.envs: text parsing, the games, the registry and rendering."""
