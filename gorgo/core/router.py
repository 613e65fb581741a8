"""The request -> decision contract and its bookkeeping, shared by ext_proc and the simulator.

`route` picks a replica with the configured (or, where allowed, the requested) policy, prices the
winner with the cost model so every decision carries its predicted TTFT and terms, and counts the
request in flight; it returns a `Decision` or a `Rejection`, never raises for a refused request.
`complete` releases that accounting exactly once, whatever ended the request. `tick` owns every
periodic duty of the policies; both drivers (the ext_proc server and the simulator) call it every
``TICK_INTERVAL_S``, so a policy behaves the same live and offline.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gorgo.core.cost import cost_terms
from gorgo.core.decision import (
    NO_REPLICA,
    SHED,
    TOO_LARGE,
    UNKNOWN_MODEL,
    Decision,
    NoReplicaAvailable,
    Rejection,
)
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetError, FleetSpec, ModelSettings
from gorgo.core.membership import EnvoyView, FleetDiff, check_reloadable, diff_fleets
from gorgo.core.peers import CLOSED, OPENED, Booking, Echoes, PeerBookings
from gorgo.core.policies import REGISTRY, make_policy
from gorgo.core.policies.base import Policy, PolicyBase
from gorgo.core.state import FleetState

ROUTED_VERSIONS = 64  # weights versions whose decision counts are kept
TICK_INTERVAL_S = 0.25  # how often the drivers call Router.tick


@dataclass(slots=True)
class _Open:
    replica: int
    prompt_tokens: int
    uncached: int  # booked for prefill on the replica until the stream ends
    block_hashes: np.ndarray
    seqs: int = 1  # sequences it decodes there (`RequestFeatures.choices`) ...
    context: int | None = None  # ... over these prompt tokens between them (None: the prompt)


class Router:
    """One per router process (or per simulated router)."""

    def __init__(
        self,
        spec: FleetSpec,
        *,
        id_prefix: str = "d",
        salt: str = "",
        unbounded_prefix: bool | None = None,
        extra_policies: dict[str, Policy] | None = None,
    ) -> None:
        if spec.policy not in REGISTRY and spec.policy not in (extra_policies or {}):
            raise FleetError(
                f"policy: unknown policy {spec.policy!r} (known: {', '.join(REGISTRY)})"
            )
        self.spec = spec
        # The Envoy in front, whose modes and clusters a reload keeps: set by the shell
        # (`ExtProcServer`; None offline, where a reload keeps this router's own modes).
        self.envoy: EnvoyView | None = None
        # A default policy that models an unbounded cache (gorgo-paper) gets an unbounded index
        # unless the driver says (False: the live router, whose memory it would fill);
        # per-request overrides share whatever index the default chose.
        default_cls = (extra_policies or {}).get(spec.policy) or REGISTRY.get(spec.policy)
        if unbounded_prefix is None:
            unbounded_prefix = bool(getattr(default_cls, "unbounded_prefix", False))
        self.state = FleetState(spec, unbounded_prefix=unbounded_prefix)
        self._extra_policies = dict(extra_policies or {})
        # Mixed into the policies' random generators (`PolicyBase.reseed`): a live router's own
        # id. Offline routers go without: each has a fleet name of its own, and a run replays.
        self._salt = salt
        self._use(spec)
        self._ids = itertools.count(1)
        self._id_prefix = id_prefix
        self._open: dict[str, _Open] = {}
        self.shed_count = 0
        # Shared bookings (`gorgo.core.peers`): what this router publishes (None: sharing off,
        # the driver drains it) and the other routers' bookings it has applied.
        self.outbox: list[Booking] | None = None
        self._notify: Callable[[], None] | None = None
        self.peers = PeerBookings(spec.timeouts.request_s)
        self.echoes = Echoes()  # this router's own choices counted for its live peers
        # Bumped by every reload: signal results measured on an older fleet are dropped.
        self.generation = 0
        # weights version -> policy -> decisions: the tuner scores a version on every request it
        # routed, so it must know how many there were (its spans arrive only as they complete).
        # Not the fleet's: a reload (an admin drain, a DNS change) must not reset it.
        self.routed: dict[int, dict[str, int]] = {}

    def _use(self, spec: FleetSpec) -> None:
        """Everything derived from the fleet spec but the state."""
        self.spec = spec
        before = getattr(self, "policies", {})
        self.policies: dict[str, Policy] = {n: make_policy(n, spec) for n in REGISTRY}
        for name, policy in self.policies.items():
            if not isinstance(policy, PolicyBase):
                continue
            if self._salt:
                policy.reseed(self._salt)
            old = before.get(name)
            if type(old) is type(policy):
                policy.carry(old)
        self.policies.update(self._extra_policies)
        self.default_policy = spec.policy
        # Each name a request may ask for (aliases too) -> its model's settings (`models:`).
        self._settings = {n: m for r in spec.replicas for n in r.model_names
                          if (m := spec.settings_for(n)) is not None}
        # The most tokens (prompt plus output) each replica can hold: a request goes only where it
        # fits, and one longer than the largest candidate fits nowhere.
        self.capacity = np.array([r.kv_capacity_tokens for r in spec.replicas], dtype=np.int64)
        self.max_request_tokens = int(self.capacity.max())
        self._fits_all = int(self.capacity.min())
        self._refresh_due: dict[str, float] = {}

    def check_reload(self, spec: FleetSpec) -> None:
        """FleetError for a fleet `reload` would refuse; nothing changes either way (the shell
        asks before it writes what Envoy reads)."""
        if spec.policy not in self.policies:
            raise FleetError(
                f"policy: unknown policy {spec.policy!r} (known: {', '.join(REGISTRY)})")
        check_reloadable(self.spec, spec, self.envoy, bool(self.state.prefix.sizes().any()))

    def reload(self, spec: FleetSpec) -> FleetDiff:
        """Take on a new fleet: unchanged replicas keep their state (`FleetState.reindexed`) and
        their open requests, which are re-indexed; a removed replica's open requests are
        forgotten (its streams still finish; their `complete` finds nothing to release), and
        closed for the peers (a peer whose fleet kept the replica held them until the request
        timeout). Raises FleetError, changing nothing, for what a running router cannot take
        on."""
        self.check_reload(spec)
        diff = diff_fleets(self.spec, spec)
        self.echoes.clear(self.state)
        kept = set(diff.kept)  # a tuple's `in` made a reload open requests x replicas
        state = self.state.reindexed(spec, {n: n for n in kept})
        for key, entry in list(self._open.items()):
            j = state.index.get(self.state.names[entry.replica])
            if j is None or self.state.names[entry.replica] not in kept:
                del self._open[key]
                self._publish(key, CLOSED, entry)
            else:
                entry.replica = j
        self.peers.reindexed(self.state.names, state.index, kept)
        self.state = state
        self._use(spec)
        self.generation += 1
        return diff

    def replica_of(self, decision_id: str) -> int | None:
        """The replica an open request is booked on, as of the current fleet (None: closed, or
        its replica was removed)."""
        entry = self._open.get(decision_id)
        return None if entry is None else entry.replica

    def candidates(self, f: RequestFeatures) -> np.ndarray | Rejection | None:
        """The replicas serving the request's model (None: every replica serves every model),
        or the 404 naming the fleet's models."""
        masks = self.state.model_masks
        if not masks:
            return None
        model = self.spec.model_asked(f.model)
        if model is None and f.endpoint is None:  # /health, an extra path naming no model
            return None
        mask = masks.get(model) if model is not None else None
        if mask is None:
            asked = "No model was named" if f.model is None else f"The model {f.model!r} does " \
                "not exist"
            return Rejection(404, UNKNOWN_MODEL, 0.0,
                             f"{asked}; this fleet serves: {', '.join(self.spec.models)}.")
        return mask

    def admissible(self, f: RequestFeatures) -> np.ndarray | Rejection | None:
        """The replicas the request may go to (None: any), or the answer refusing it: those
        serving its model, narrowed to those whose KV pool holds it."""
        mask = self.candidates(f)
        return mask if isinstance(mask, Rejection) else self._fitting(f, mask)

    def _fitting(self, f: RequestFeatures,
                 mask: np.ndarray | None) -> np.ndarray | Rejection | None:
        """``mask`` (None: every replica) narrowed to the replicas whose KV pool holds one of the
        request's sequences (its prompt plus its output: an engine schedules `n` sequences, or a
        batch's prompts, as its pool frees), or the 400 when none of them does: a smaller
        replica was chosen whenever a larger one existed anywhere in the fleet, and its engine
        refused."""
        wanted = f.sequence_prompt_tokens + (f.max_tokens or 0)
        if wanted <= self._fits_all:  # the usual case: no array work
            return mask
        fits = self.capacity >= wanted
        if mask is not None:
            fits &= mask
        if not fits.any():
            most = int(self.capacity[mask].max()) if mask is not None else self.max_request_tokens
            prompt = ("in the prompt" if f.sequence_prompt_tokens == f.prompt_tokens
                      else "in its longest prompt")
            return Rejection(
                400, TOO_LARGE, 0.0,
                f"This request needs {wanted} tokens ({f.sequence_prompt_tokens} {prompt}, "
                f"{f.max_tokens or 0} for the completion); the largest replica "
                f"{'of its model ' if mask is not None else ''}holds {most}.")
        return fits

    def settings_for(self, f: RequestFeatures) -> ModelSettings | None:
        """The fleet file's settings for the request's model (the fleet's one model when it
        names none), or None."""
        model = self.spec.model_asked(f.model)
        return None if model is None else self._settings.get(model)

    def policy_for(self, f: RequestFeatures) -> Policy:
        """The requested policy when the fleet allows overrides and knows it, else the model's
        (``models.<name>.policy``), else the fleet's default."""
        if f.policy and self.spec.allow_policy_override and f.policy in self.policies:
            return self.policies[f.policy]
        m = self.settings_for(f)
        return self.policies[m.policy if m is not None and m.policy else self.default_policy]

    def tick(self, now: float) -> None:
        """Run every periodic duty due at ``now``: the precise view's pending holds, and each
        policy's refresh every ``refresh_interval_s``.

        Only the policies this router can route with are refreshed: the default and the models'
        own, and all of them when the fleet allows per-request overrides.
        """
        s = self.state
        s.now = now
        s.expire_pending(now)
        self.peers.expire(s, now)
        self.echoes.expire(s, now)
        names = self.policies if self.spec.allow_policy_override else dict.fromkeys(
            [self.default_policy, *(m.policy for m in self.spec.model_settings if m.policy)])
        for name in names:
            policy = self.policies[name]
            interval = policy.refresh_interval_s
            if interval > 0 and now >= self._refresh_due.get(name, -np.inf):
                policy.refresh(s)
                self._refresh_due[name] = now + interval

    def route(self, f: RequestFeatures, now: float) -> Decision | Rejection:
        """Choose a replica and count the request in flight, or say why not."""
        s = self.state
        s.now = now
        self.echoes.expire(s, now)
        mask = self.admissible(f)
        if isinstance(mask, Rejection):
            return mask
        # The model's replicas only, for the terms, admission and every policy
        # (FleetState.routable: another model's replica is neither a cache nor a load of this
        # request's), and its own weights and objective where the fleet file sets them
        # (FleetState.scoring), until it is booked.
        s.candidates, s.model_settings = mask, self.settings_for(f)
        try:
            terms = cost_terms(f, s)
            weights, _ = s.scoring()
            # Predicted TTFT, what the span reports and admission compares with the SLO: the
            # TTFT terms that are latencies of this request (not the penalty or congestion).
            predicted = terms.total(weights, latency_only=True)
            shed = self.shed_check(f, predicted)
            if shed is not None:
                self.shed_count += 1
                return shed
            d = self.policy_for(f).choose(f, s)
            i = d.replica
            d.terms = terms.at(i)
            d.predicted_ms = float(predicted[i])
            d.uncached_tokens = int(terms.uncached_tokens[i])
            d.prompt_tokens = f.prompt_tokens
            d.weights_version = weights.version  # 0 for a model's fixed weights: not the tuner's
            s.record_sent(i, f, d.uncached_tokens)
        except NoReplicaAvailable as exc:
            return Rejection(503, NO_REPLICA, exc.retry_after_s, "No healthy replica is available.")
        finally:
            s.candidates = s.model_settings = None
        d.id = f"{self._id_prefix}-{next(self._ids)}"
        self._count(d.weights_version, d.policy)
        self._open[d.id] = _Open(i, f.prompt_tokens, d.uncached_tokens, f.block_hashes,
                                 f.choices, f.context_tokens)
        self._publish(d.id, OPENED, self._open[d.id])
        if self.outbox is not None:
            self.echoes.add(s, i, f.prompt_tokens, d.uncached_tokens, self.peers.live_peers(now),
                            now)
        return d

    def share(self, notify: Callable[[], None] | None = None) -> None:
        """Publish this router's bookings from now on: into `outbox`, which the driver drains
        (``notify``, if given, is called after each new booking)."""
        if self.outbox is None:
            self.outbox = []
        self._notify = notify

    def stagger_s(self, now: float) -> float:
        """How long to hold a request before `route`: this router's rank among its live peers
        times the fleet's ``sharing.stagger_ms`` (0 without sharing or live peers), so the
        routers of one moment decide in turns, each after the earlier ones' bookings arrived
        (`gorgo.core.peers`). The driver waits (the simulator, the ext_proc service). At most a
        quarter of Envoy's ext_proc message timeout: a hold past it would fail the request open
        to the default route."""
        sharing = self.spec.sharing
        if self.outbox is None or sharing is None or not sharing.stagger_ms:
            return 0.0
        hold = self.peers.rank(self._id_prefix, now) * sharing.stagger_ms / 1000.0
        return min(hold, self.spec.timeouts.message_ms / 4000.0)

    @property
    def router_id(self) -> str:
        """This router's id among its peers: its decision ids' prefix."""
        return self._id_prefix

    def _publish(self, decision_id: str, kind: str, entry: _Open) -> None:
        if self.outbox is None:
            return
        self.outbox.append(Booking(
            self._id_prefix, decision_id, kind, self.state.names[entry.replica],
            entry.prompt_tokens, entry.uncached,
            tuple(entry.block_hashes.tolist()) if kind == OPENED else (), entry.seqs,
            entry.context))
        if self._notify is not None:
            self._notify()

    def apply_peer(self, booking: Booking, now: float) -> None:
        """Another router's booking (never one of this router's own)."""
        if booking.router != self._id_prefix:
            self.peers.apply(self.state, booking, now)

    def _count(self, version: int, policy: str) -> None:
        by_policy = self.routed.get(version)
        if by_policy is None:
            by_policy = self.routed[version] = {}
            if len(self.routed) > ROUTED_VERSIONS:
                del self.routed[min(self.routed)]
        by_policy[policy] = by_policy.get(policy, 0) + 1

    def shed_check(self, f: RequestFeatures, latency: np.ndarray) -> Rejection | None:
        """The 429 shedding this request (counted by `route`, not here: `explain` asks too):
        when even the best routable replica is predicted past its limit.

        The limit is the SLO stretched by priority, so higher priorities are shed later and no
        request whose best replica meets the SLO is ever shed. ``latency`` leaves out penalties:
        they rank a replica that failed below the others, but they are no wait, so a fleet back
        from an outage is not shed for the failures it had.
        """
        shed = self.spec.shedding
        if shed.slo_ms <= 0:
            return None
        best = float(np.where(self.state.routable(), latency, np.inf).min())
        if not np.isfinite(best):
            return None  # nothing routable: the policy says so
        priority = shed.default_priority if f.priority is None else max(f.priority, 0)
        limit = shed.slo_ms * (1.0 + shed.priority_step * priority)
        if best <= limit:
            return None
        return Rejection(
            429, SHED, max(1.0, (best - shed.slo_ms) / 1000.0),
            f"The fleet is overloaded: best predicted TTFT {best:.0f} ms exceeds the limit "
            f"{limit:.0f} ms. Retry later.",
            priority=f.priority,
        )

    def complete(self, decision_id: str) -> bool:
        """Release a request's in-flight accounting; False if it was already released."""
        entry = self._open.pop(decision_id, None)
        if entry is None:
            return False
        self._publish(decision_id, CLOSED, entry)
        self.state.unbook(entry.replica, entry.block_hashes, entry.prompt_tokens, entry.uncached,
                          seqs=entry.seqs, context=entry.context)
        return True

    def complete_all(self) -> int:
        """Release every open request (a stop: the peers count none of them after it)."""
        return sum(self.complete(d) for d in list(self._open))

    def reassign(self, decision_id: str, replica: int) -> bool:
        """A retry served the request elsewhere: move its accounting there (False if closed)."""
        entry = self._open.get(decision_id)
        if entry is None or entry.replica == replica:
            return False
        s = self.state
        s.unbook(entry.replica, entry.block_hashes, entry.prompt_tokens, entry.uncached,
                 served=False, seqs=entry.seqs, context=entry.context)
        cached = int(s.prefix.match(entry.block_hashes)[replica]) * self.spec.block_tokens
        entry.uncached = max(entry.prompt_tokens - cached, 0)
        s.book(replica, entry.block_hashes, entry.prompt_tokens, entry.uncached, entry.seqs,
               entry.context, arrival=False)
        self._publish(decision_id, CLOSED, entry)  # the peers move it too
        entry.replica = replica
        self._publish(decision_id, OPENED, entry)
        return True

    @property
    def open_requests(self) -> int:
        return len(self._open)
