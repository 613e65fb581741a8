"""What every policy shares: the interface and a tie-break that favours no replica."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np

from gorgo.core.decision import Decision, NoReplicaAvailable
from gorgo.core.features import RequestFeatures, stable_hash
from gorgo.core.fleet import FleetSpec
from gorgo.core.state import FleetState

MAX_TIE_SETS = 4096  # sets of tied replicas whose turns are kept (then they start over)


class Policy(Protocol):
    """A pure, synchronous scorer: features and fleet state in, a decision out. No I/O.

    ``refresh`` recomputes slow-moving state (for example routing weights) off the request path;
    the live server and the simulator call it every ``refresh_interval_s`` seconds, and never
    when that is 0. `PolicyBase` supplies a no-op hook with interval 0.
    """

    name: str
    refresh_interval_s: float

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision: ...

    def refresh(self, s: FleetState) -> None: ...


class PolicyBase:
    """Shared plumbing: masking of unroutable replicas and the rotating tie-break."""

    name = "base"
    refresh_interval_s = 0.0  # no background refresh
    unbounded_prefix = False  # True: the Router keeps an unbounded prefix index when default
    carried: tuple[str, ...] = ()  # attributes a reload carries over (`carry`)
    # A policy that draws: its generator ``rng``'s seed, before the fleet name (`generator`)
    seed_prefix: str | None = None

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        # Per set of tied replicas, the turns taken: one counter for every set (one model's
        # pair, then another's) put each model's ties on one replica.
        self._turns: dict[bytes, int] = {}

    def refresh(self, s: FleetState) -> None:
        """Recompute slow-moving state; nothing to do for a policy that scores per request."""

    def carry(self, old: PolicyBase) -> None:
        """Go on from ``old``, this policy as built for the fleet before a reload: a reload (an
        admin drain, a DNS change, SIGHUP, a touched file) must not restart the tie-break's
        rotation, round robin's turn or a generator's sequence (reloads every 2 requests sent
        all of round robin's traffic to half the replicas). What is indexed by replica
        (plans, salts) is rebuilt for the new fleet, not carried."""
        self._turns = old._turns
        for name in self.carried:
            setattr(self, name, getattr(old, name))

    def generator(self, salt: str = "") -> np.random.Generator:
        """A drawing policy's generator, seeded from its ``seed_prefix`` and the fleet name (an
        offline run replays) and ``salt``, a live router's id (`reseed`)."""
        seed = f"{self.seed_prefix}{self.spec.name}"
        return np.random.default_rng(stable_hash(f"{seed}:{salt}" if salt else seed))

    def reseed(self, salt: str) -> None:
        """Give this router its own random sequence (a policy that draws none has nothing to
        do): routers of one fleet seed alike, so live routers (several processes, `--workers`)
        all drew one sequence, in step, and herded where each should draw apart."""
        if self.seed_prefix is not None:
            self.rng = self.generator(salt)

    def pick_lowest(
        self,
        scores: np.ndarray,
        s: FleetState,
        tiebreak: Callable[[], np.ndarray] | None = None,
    ) -> Decision:
        """The lowest score among routable replicas; ties rotate so none is favoured.

        ``tiebreak`` (evaluated only when there is a tie) narrows the tied replicas to those with
        its lowest value before the rotation.
        """
        ok = s.routable()
        masked = np.where(ok, scores, np.inf).astype(float, copy=False)
        best = float(np.fmin.reduce(masked))  # a NaN score never wins, nor hides the others
        if not math.isfinite(best):
            raise NoReplicaAvailable(retry_after(s))
        ties = np.flatnonzero(masked <= best + 1e-9 * max(1.0, abs(best)))
        if tiebreak is not None and len(ties) > 1:
            second = np.asarray(tiebreak())[ties]
            ties = ties[second <= second.min()]
        if len(ties) == 1:
            i = int(ties[0])
        else:  # turns of this very set: a tie after each other choice always fell on one index
            key = ties.tobytes()
            if key not in self._turns and len(self._turns) >= MAX_TIE_SETS:
                self._turns.clear()
            turn = self._turns[key] = self._turns.get(key, 0) + 1
            i = int(ties[turn % len(ties)])
        return Decision(replica=i, policy=self.name, scores=masked, routable=ok)


def routable_or_raise(s: FleetState) -> np.ndarray:
    """The routable mask, for policies that must look at the routable set before scoring."""
    ok = s.routable()
    if not ok.any():
        raise NoReplicaAvailable(retry_after(s))
    return ok


def retry_after(s: FleetState) -> float:
    """Seconds until a replica the request could use may be back (at least 1): the first probe
    of its ejected candidates, within one probe interval while none in the fleet is routable
    (healthy and not draining: then every replica is probed each interval,
    `FleetState.probe_due`)."""
    back = ~s.healthy & ~s.draining
    if s.candidates is not None:  # another model's healthy replica is no reason to come back
        back &= s.candidates
    if not back.any():
        return 1.0
    wait = float(np.min(s.retry_at[back])) - s.now
    if not s.serving().any():
        wait = min(wait, s.spec.signals.probe_interval_s)
    return max(1.0, wait)
