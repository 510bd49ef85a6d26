"""Multi-turn chat: the conversation session (append-only KV, delta prefill, /regen, context
overflow) in `session`, its KV mirror in `kv`, session files in `store`, and the REPL in `repl`."""
