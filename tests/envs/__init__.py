"""Tests of rollstream.shared.envs: text parsing, the games, the registry and rendering."""
