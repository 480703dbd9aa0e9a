"""Prefix-aware routing across replicas, through Ray Serve's request-router interface: a request whose
prompt opens like one routed before goes to the replica that served it, whose prefix cache likely
still holds those blocks, unless that replica is busier than the others by more than a margin.

Serve ships a router of this kind for Serve LLM (ray.serve.llm's PrefixCacheAffinityRouter), but it
imports vLLM or SGLang and reads only requests with a `prompt`/`messages` attribute holding text. This
one keys warpspec's own requests (gRPC GenerateRequest: token ids or text) and keeps its table in
the router itself: each proxy and each DeploymentHandle routes with what it has seen.

Keys follow the replicas' prefix cache: a prompt of token ids is cut into 16-token blocks, each named
by a hash chained over the blocks before it (core/block_manager.py names KV blocks the same way), so two
prompts share key i exactly when their first 16 * (i + 1) tokens agree. A text prompt is cut into
64-character pieces instead. Requests without a prompt in their arguments (HTTP requests, whose body
the proxy has not read when it routes) are routed by power of two choices, as without this router.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from warpspec.serving.serve_internals import ChoiceHookRouter

TOKENS_PER_KEY = 16  # the default KV block size: whole blocks are what a replica's prefix cache reuses
CHARS_PER_KEY = 64


def generate_request(arg):
    """The GenerateRequest in a routed call's argument, or None: Serve's gRPC proxy passes the message
    pickled inside its gRPCRequest wrapper (raw bytes skip Ray's serializer), a DeploymentHandle
    caller passes it as it is."""
    if isinstance(arg, bytes):
        try:
            arg = pickle.loads(arg)  # noqa: S301 - the bytes come from Serve's own proxy
        except Exception:  # noqa: BLE001 - any other payload: no prompt to key
            return None
    arg = getattr(arg, "user_request_proto", arg)
    return arg if type(arg).__name__ == "GenerateRequest" else None


def prefix_keys(pending_request: PendingRequest | None) -> list[int]:
    """The chained block hashes of the request's prompt: [h(b0), h(h(b0), b1), ...]; [] without one."""
    prompt = None
    for arg in pending_request.args if pending_request is not None else ():
        request = generate_request(arg)
        if request is not None:
            prompt = list(request.prompt_token_ids.ids) if request.HasField("prompt_token_ids") else request.prompt
            break
    if not prompt:
        return []
    size = TOKENS_PER_KEY if isinstance(prompt, list) else CHARS_PER_KEY
    keys, key = [], 0
    for start in range(0, len(prompt) - size + 1, size):  # whole pieces only, like whole KV blocks
        key = hash((key, tuple(prompt[start : start + size]) if size == TOKENS_PER_KEY
                    else prompt[start : start + size]))
        keys.append(key)
    return keys


class PrefixAffinityRouter(ChoiceHookRouter):
    def initialize_state(self, max_keys: int = 200_000, max_queue_gap: int = 4) -> None:
        """max_keys: prefix keys remembered (least recently routed forgotten first). max_queue_gap:
        the replica holding a prefix is passed over when its queue is longer than the shortest
        candidate's by more than this."""
        self.max_keys, self.max_queue_gap = max_keys, max_queue_gap
        self.owner: OrderedDict[int, ReplicaID] = OrderedDict()  # key -> the replica that last served it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The replica holding the longest prefix of the prompt first, then power of two choices."""
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        candidates = {r.replica_id: r for r in candidate_replicas}
        holder = None
        for key in prefix_keys(pending_request):
            replica_id = self.owner.get(key)
            if replica_id not in candidates:
                break  # later keys chain through this one: nobody holds a longer prefix
            holder = replica_id
        if holder is None or self._much_busier(holder, candidates):
            return fallback
        return [[candidates[holder]], *fallback]

    def _much_busier(self, replica_id: ReplicaID, candidates: dict[ReplicaID, RunningReplica]) -> bool:
        """By the queue lengths Serve has cached (unknown ones do not count against the holder)."""
        cache = self.replica_queue_len_cache
        lengths = [n for n in (cache.get(r) for r in candidates) if n is not None]
        own = cache.get(replica_id)
        return own is not None and bool(lengths) and own - min(lengths) > self.max_queue_gap

    def on_replica_chosen(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        """Serve's own choice, remembered (serve_internals.py says why it is taken there)."""
        for key in prefix_keys(pending_request):
            self.owner[key] = replica.replica_id
            self.owner.move_to_end(key)
        while len(self.owner) > self.max_keys:
            self.owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self.owner.items() if owner == replica_id]:
            del self.owner[key]
