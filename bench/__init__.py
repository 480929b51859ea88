"""Benchmarks and drills: the conductor's decision latency, the KV store's data path, a trace
replayed against a live cluster, the simulator's replay front-end, chaos and the engine profile.
Nothing here is imported by serving code."""
