"""The Envoy ext_proc server: the I/O shell around the routing core (gRPC, probes, metrics)."""
