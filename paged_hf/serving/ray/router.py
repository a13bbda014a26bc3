"""A Ray Serve request router for engine replicas: prefix- and adapter-aware, falling back to the least loaded.

Ray Serve calls `choose_replicas` with the candidates and the pending request; we return ranks of replicas
(most preferred first) and Ray sends the request to the least loaded replica of the first rank that has room
(`max_ongoing_requests`). The request's `routing` keyword (a `RoutingHint`, made by the ingress) says:
- `replica`: a target (the ingress asks every replica for /metrics and /v1/models): that one only;
- `adapter`: only replicas that have it loaded (else it would be a 404), those with it resident on the
  device first (no swap);
- `block_hashes`: the replica last sent the longest prefix of these blocks first, unless it has more than
  `imbalance` requests more than the least loaded one; `on_request_routed` records where each prefix went.
Policy `round_robin` (for comparison) ignores the prefix: each request to the next replica in turn.

Which adapters a replica holds comes from its `record_routing_stats()` (polled by Ray) and, sooner, from the
ingress when it loads or unloads one there (`note_adapter`). Routers register themselves by deployment name
so that the ingress (same process) can list the replicas and tell the router about adapters.
"""

from __future__ import annotations

import itertools
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from paged_hf.serving.ray.routing import PrefixOwners, RoutingHint

#: the routers of this process, by deployment name (the ingress's handles create them)
ROUTERS: dict[str, "PagedRequestRouter"] = {}


class PagedRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", imbalance: int = 8, **kwargs) -> None:
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"routing policy must be 'prefix' or 'round_robin', got {policy!r}")
        self.policy, self.imbalance = policy, imbalance
        self.owners = PrefixOwners()
        self._turn = itertools.count()
        self._adapters: dict[str, set[str]] = {}  # replica -> adapters the ingress saw it load (until stats agree)
        from paged_hf.serving.ray import router as module  # noqa: PLC0415 - the live module (this class may be a pickled copy)

        module.ROUTERS[self._deployment_id.name] = self

    # --- what the ingress tells us -------------------------------------------------------------------
    def replica_names(self) -> list[str]:
        return sorted(replica_id.unique_id for replica_id in self.curr_replicas)

    def note_adapter(self, replica: str, adapter: str, loaded: bool) -> None:
        names = self._adapters.setdefault(replica, set())
        (names.add if loaded else names.discard)(adapter)

    # --- Ray's hooks ---------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if not candidate_replicas:
            return []
        if hint.replica is not None:
            target = [r for r in candidate_replicas if r.replica_id.unique_id == hint.replica]
            return [target] if target else [candidate_replicas]
        pool, fallback = self._adapter_pools(hint.adapter, candidate_replicas)
        if self.policy == "round_robin":
            ordered = sorted(fallback, key=lambda r: r.replica_id.unique_id)
            return [[ordered[next(self._turn) % len(ordered)]], fallback]
        first = self._prefix_owner(hint, pool) or self._least_loaded(pool)
        return [[first], pool] + ([fallback] if fallback is not pool else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hint = _hint(pending_request)
        if hint.block_hashes and hint.replica is None:
            self.owners.record(hint.block_hashes, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.owners.forget(replica_id.unique_id)
        self._adapters.pop(replica_id.unique_id, None)

    # --- helpers -------------------------------------------------------------------------------------
    def _adapter_pools(self, adapter: str | None, candidates: list[RunningReplica]):
        """(preferred replicas, acceptable replicas) for a request's adapter: those with it resident on the
        device, those with it loaded; every candidate when none has it (the replica then answers 404)."""
        if adapter is None:
            return candidates, candidates
        having = [r for r in candidates if adapter in self._loaded(r)]
        if not having:
            return candidates, candidates
        resident = [r for r in having if adapter in r.routing_stats.get("resident_adapters", ())]
        return (resident, having) if resident else (having, having)

    def _loaded(self, replica: RunningReplica) -> set[str]:
        return set(replica.routing_stats.get("adapters", ())) | self._adapters.get(replica.replica_id.unique_id, set())

    def _prefix_owner(self, hint: RoutingHint, pool: list[RunningReplica]) -> RunningReplica | None:
        """The replica holding the longest prefix, unless it is much busier than the least loaded one."""
        by_name = {r.replica_id.unique_id: r for r in pool}
        name, _ = self.owners.longest_match(hint.block_hashes, set(by_name))
        if name is None:
            return None
        loads = {n: self._queue_len(r) for n, r in by_name.items()}
        return by_name[name] if loads[name] <= min(loads.values()) + self.imbalance else None

    def _least_loaded(self, pool: list[RunningReplica]) -> RunningReplica:
        """Fewest requests, then fewest prefixes owned (new prefixes spread over the replicas), then random."""
        return min(pool, key=lambda r: (self._queue_len(r), self.owners.num_roots(r.replica_id.unique_id),
                                        random.random()))

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def _hint(pending_request: PendingRequest | None) -> RoutingHint:
    hint = pending_request.kwargs.get("routing") if pending_request is not None else None
    return hint if isinstance(hint, RoutingHint) else RoutingHint()
