"""Multi-turn text games for LLM agents: `base.TextEnv`, the games, and `registry.make_env` for config tags."""
