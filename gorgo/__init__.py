"""GORGO: route LLM requests by predicted TTFT = network RTT + queue wait + uncached prefill."""

__version__ = "0.1.0"
