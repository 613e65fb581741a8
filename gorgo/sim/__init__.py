"""Simulated fleet: engine model and server, link emulator, trace replay, offline simulation."""
