"""`gorgo bench tune`: the tuner's optimiser inside the offline simulation, against a grid search.

The tuned run is the live loop on a virtual clock. The simulated router is the real `Router`; each
request that completes becomes the `Sample` its span would have been (TTFT, E2E, status, replica,
region, the decision's weights version and every cost term of the registry) and goes to
`Tuner.observe` when its last byte is back, in simulated time order. Every ``tick_s`` simulated
seconds (as `gorgo tuner` ticks) the bench asks `Tuner.next_weights(now)` and applies a proposal to
the router's `FleetState.set_weights` ``publish_delay_s`` later; a router refuses a version it has
passed, as the admin API does. A request with no first token (an engine refused it) becomes an
error sample with its close time as TTFT and E2E, so the error guard sees it.

Reference. Static weights on a log grid, on the same trace slice, load and seeds: ``--grid K``
values per weighted term of the registry over the optimiser's bounds, and every combination of
them (K x K for today's two weights, K^n for n); the objective is the p95 TTFT of the whole slice.
The grid's best point is the one with the lowest mean p95 over seeds, and its p95 on each seed is
that seed's target (common random numbers: a tuned run on seed s is compared with the grid on
seed s).

Convergence. Every incumbent a tuned run holds is re-run statically (its weights and the prefill
rates published with it) on the same slice and seed. The run has converged at sample n when the
incumbent from n on, to the end of the run, stays within ``tolerance`` (5 %) of the seed's target;
samples are completed requests the router's `gorgo` policy routed, counted from the start.

A/A runs (`NullTuner`: the candidate is always the incumbent) measure how often the whole loop
accepts a candidate that is not better. Static runs are cached per trace slice, time scale and a
digest of the router and simulation source, so a rerun only simulates what changed.

Weights are mappings weight key -> factor throughout (`points`). The modules, by job: `run`
(tuned and static runs, the worker processes, the static-run cache), `stats` (grid best, Wilson
intervals, convergence, rolling p95, the per-run summaries), `report` (results.json, results.md
and the figures; matplotlib is imported only to draw) and `cli` (arguments and the run that ties
them together).
"""
