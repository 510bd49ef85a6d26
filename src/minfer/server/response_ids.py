"""Response ids that carry their conversation's chain (the Responses API's, Ray's routing key).

Every response id is `resp_` + its chain (16 hex digits) + 24 random hex digits. A response
that continues a stored one (`previous_response_id`) keeps that one's chain; one that starts a
conversation gets the chain Ray's front names in `CHAIN_HEADER` (which routed the request by it:
ray.affinity), or a new one. So the front sends every turn of a conversation to the replica
whose store keeps it.
"""

from __future__ import annotations

import re
import secrets

CHAIN_HEADER = "x-minfer-response-chain"  # the chain a new response's id starts with
_CHAIN = re.compile(r"[0-9a-f]{16}")
_RESPONSE_ID = re.compile(r"resp_([0-9a-f]{16})[0-9a-f]+")


def chain_of(response_id: str) -> str | None:
    """The chain a response id carries (None: not an id this server wrote)."""
    m = _RESPONSE_ID.fullmatch(response_id)
    return m.group(1) if m else None


def new_chain() -> str:
    return secrets.token_hex(8)


def response_id(chain: str | None) -> str:
    """A new response id on `chain` (a valid one; else a new chain)."""
    if chain is None or not _CHAIN.fullmatch(chain):
        chain = new_chain()
    return f"resp_{chain}{secrets.token_hex(12)}"
