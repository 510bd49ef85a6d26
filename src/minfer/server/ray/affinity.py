"""Session keys for routing a conversation to the replica whose prompt cache holds it (pure).

With several engine replicas, a conversation's next turn is cheap only on the replica that
served the last one (its prompt cache holds the shared prefix). The key names the conversation:

- the request's `user` field, when it has one (the OpenAI field for an end user's id);
- a chat: a hash of the messages up to and including the first user message (the system
  prompt and opening question), which every later turn of the same chat repeats unchanged;
- a completion: a hash of the prompt's first PREFIX_CHARS characters;
- a Responses request: its chain, which every response id carries after `resp_` (16 hex
  digits): the `previous_response_id`'s, so a stored response is continued on the replica that
  keeps it. A request that starts a chain has none; the front names one
  (`response_ids.new_chain`), routes by it and passes it in the `CHAIN_HEADER` header, and the
  replica starts its ids with it (minfer.server.response_ids).

Anything else (GET routes, bodies that are not JSON objects) has no key and goes to any replica.
The router (router.py) ranks replicas by rendezvous hashing of the key, so a key keeps its
replica while the replica set is unchanged and only the keys of a lost replica move.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from minfer.server.response_ids import chain_of

PREFIX_CHARS = 1024
CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
COMPLETION_PATHS = frozenset({"/v1/completions", "/completions", "/completion"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})


def _digest(value: Any) -> str:
    raw = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


def chat_prefix(messages: list[Any]) -> list[Any]:
    """The messages up to and including the first user message (all of them if none is)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return messages[: i + 1]
    return messages


def session_key(path: str, body: bytes) -> str | None:
    """The affinity key of a request to path with body, or None (route anywhere)."""
    if path not in CHAT_PATHS and path not in COMPLETION_PATHS and path not in RESPONSES_PATHS:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if path in RESPONSES_PATHS:
        previous = data.get("previous_response_id")
        chain = chain_of(previous) if isinstance(previous, str) else None
        return None if chain is None else "chain:" + chain
    user = data.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    if path in CHAT_PATHS:
        messages = data.get("messages")
        return "chat:" + _digest(chat_prefix(messages)) if isinstance(messages, list) else None
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return "prompt:" + _digest(prompt[:PREFIX_CHARS])
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        return "prompt:" + _digest(first[:PREFIX_CHARS] if isinstance(first, str)
                                   else prompt[:256])
    return None


def rendezvous_score(key: str, replica: str) -> int:
    """Highest-random-weight score of replica for key: rank replicas by it, best first."""
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rank(key: str, replicas: list[str]) -> list[str]:
    """replicas in the order key prefers them."""
    return sorted(replicas, key=lambda r: rendezvous_score(key, r), reverse=True)
