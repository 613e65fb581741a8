"""Development harness: starts, wires and stops real processes (Envoy, router, fleet, tuner).

Used by the tests, the demo and the benches; the router and the tuner never import it.
"""
