"""Baton's fleet simulator: replays a request trace through the same placement policies the live
conductor calls, over a discrete-event model of prefill and decode instances, their device KV
caches and their nodes' host and disk tiers. ``baton bench replay`` is its command line."""
