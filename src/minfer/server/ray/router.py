"""The Ray Serve request router in front of the engine replicas: session affinity, then load.

Every call to the engine deployment passes its routing key as the first argument:

- a session key (affinity.py): replicas are offered in rendezvous-hash order, one rank each, so
  the conversation's replica is tried first and, when it is at `max_ongoing_requests`, the next
  one in the key's own order (the load spills, the same way every time);
- None: the less loaded of two random replicas (power of two choices).

Ray builds the router inside each process holding a handle to the deployment (here, the front
deployment) and pickles this module by value (globals included), so it holds no state of its
own. Imports ray: only the Ray path loads this module.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from minfer.server.ray.affinity import rank


class AffinityRouter(RequestRouter):
    """Ranks replicas for a request by its session key (see the module docstring)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        key = None
        if pending_request is not None:
            # every rank of this round was offered: back off before the next round
            pending_request.routing_context.should_backoff = True
            if pending_request.args and isinstance(pending_request.args[0], str):
                key = pending_request.args[0]
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in rank(key, list(by_id))]
