"""The ``baton`` command line and the clients it uses (gRPC Inference and Admin)."""
