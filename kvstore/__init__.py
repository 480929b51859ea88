"""The pooled KV store: block keys, the host arena, the disk tier, the store node actor, the
Redis block directory, the transfer engine between nodes, KV events, the vLLM connector and the
store client engines use, and store attachment. It imports nothing above it: no decision code,
no worker."""
