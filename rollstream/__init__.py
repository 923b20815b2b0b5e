"""rollstream: asynchronous agentic RL on Redis Streams.

The import namespace of the whole product. Its layers, top to bottom (an import only ever runs downwards):

- `rollstream.cli`, `rollstream.launch`, `rollstream.deploy`, `rollstream.tiny_model`: entry points and build
  tools, the only modules that see both sides;
- `rollstream.producer` (env-workers) and `rollstream.consumer` (the trainer), which never import each other;
- `rollstream.shared`: what both sides use (config, keys, codec, ledger, envs, weights I/O); it imports neither side.

`producer/`, `consumer/` and `shared/` sit at the top of the repository and are reached through this package.
"""
