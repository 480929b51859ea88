"""The fronts: Baton's gRPC Inference and Admin services, the OpenAI-compatible HTTP API, and a
request's path through the cluster (validation, tokenization, auth, metrics, the live router).

Everything a client can send is parsed, checked and turned into typed messages here; the
deciding core (``conductor``) never sees a wire format."""
