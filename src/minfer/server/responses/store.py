"""The Responses API's stored responses: the last `KEPT` of this process, by id.

A stored response keeps the object it was answered with and its conversation: the input items
(those of the responses before it first) and its output items, which a later request's
`previous_response_id` puts before its own input. Thread-safe; the server state holds one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from minfer.server.errors import APIError
from minfer.server.responses.schemas import Item

KEPT = 256  # stored responses kept, the least recently used dropped first
ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[Item])


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[Item]  # its input items (those of the responses before it first), output


class ResponseStore:
    """The last `KEPT` stored responses, by id."""

    def __init__(self, capacity: int = KEPT) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[Item]) -> None:
        with self._lock:
            self._kept[response["id"]] = Stored(response, conversation)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        """The stored response, or OpenAI's 404."""
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           code="not_found")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._kept.pop(response_id, None)
