"""`gorgo bench tune`: the tuner's optimiser inside the offline simulation, against a grid search.

The tuned run is the live loop on a virtual clock. The simulated router is the real `Router`; each
request becomes, at its first token, the early `Sample` the TTFT log would carry (its TTFT, no E2E)
and, when its last byte is back, the one its span would have been (TTFT, E2E, status, replica,
region, the decision's weights version and every cost term of the registry); both go through the
live `tuner.join.Join`, so the first reaches `Tuner.observe` and the end `Tuner.observe_end`, in
simulated time order (``--ends-only``: only the end, to `observe`). Every ``tick_s`` simulated
seconds (as `gorgo tuner` ticks) the bench asks `Tuner.next_weights(now)` and applies a proposal to
the router's `FleetState.set_weights` ``publish_delay_s`` later; a router refuses a version it has
passed, as the admin API does. A request with no first token (an engine refused it) becomes an
error sample with its close time as TTFT and E2E, so the error guard sees it.

Reference. Static weights on a log grid, on the same trace slice, load and seeds: ``--grid K``
values per weighted term of the registry over the optimiser's bounds, and every combination of
them (K x K for the TTFT objective's two weights); the score is the objective's (``--objective``,
default the fleet's: p95 TTFT, p95 E2E or the SLO's miss share) over the whole slice. The tuner
searches the objective's weights; the grid stays over the TTFT weights with the others (decode,
interference, reuse) at their defaults, as K^5 static runs would be too many. The grid's best
point is the one with the lowest mean score over seeds, and its score on each seed is that seed's
target (common random numbers: a tuned run on seed s is compared with the grid on seed s).

Convergence. Every incumbent a tuned run holds is re-run statically (its weights and the prefill
rates published with it) on the same slice and seed. The run has converged at sample n when the
incumbent from n on, to the end of the run, stays within ``tolerance`` (5 %) of the seed's target;
samples are requests the router's `gorgo` policy routed whose first token reached the tuner
(with early samples, before they completed), counted from the start.

A/A runs (`NullTuner`: the candidate is always the incumbent) measure how often the whole loop
accepts a candidate that is not better. Static runs are cached per trace slice, time scale and a
digest of the router and simulation source, so a rerun only simulates what changed.

Weights are mappings weight key -> factor throughout (`points`). The modules, by job: `run`
(tuned and static runs, the worker processes, the static-run cache), `stats` (grid best, Wilson
intervals, convergence, rolling p95, the per-run summaries), `report` (results.json, results.md
and the figures; matplotlib is imported only to draw) and `cli` (arguments and the run that ties
them together).
"""
