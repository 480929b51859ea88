"""The wire: the generated gRPC stubs (``protos/baton/v1``), every message that crosses a process
(``protos.wire``) and the root of Baton's errors (``protos.errors``). The bottom layer: imports
no other room."""
