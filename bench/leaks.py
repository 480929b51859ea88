"""What a cluster still holds once its load has stopped: the leak check ``baton chaos`` and
``baton bench fuzz`` end with.

``leaks(server)`` returns, after up to ``settle_s`` for the books to close, KV blocks still
pinned in the store nodes serving now, requests still booked in the conductor (prefills and
decodes), and sequences still running or waiting in the engines. All must be 0 on a cluster no
client is using.
"""

from __future__ import annotations

import asyncio
import time

from cluster.serve import BatonServer


async def leaks(server: BatonServer, settle_s: float = 30.0) -> dict[str, int]:
    """What is still held once the load stopped, after up to ``settle_s`` for books to close.
    Pins are read from the store nodes serving now (the last ones started)."""
    cluster = server.cluster
    deadline = time.monotonic() + settle_s
    while True:
        stores = {node_id: (await store.stats.remote()).pinned_blocks
                  for node_id, store in cluster.stores.items()}
        books = await cluster.conductor.status.remote()
        prefills, decodes = books.num_in_flight_prefills, books.num_in_flight_decodes
        in_engines = 0
        for instance_id in cluster.prefill_ids + cluster.decode_ids:
            stats = await cluster.actor(instance_id).stats.remote()
            in_engines += stats.num_running_reqs + stats.num_waiting_reqs
        held = {"pinned_blocks": sum(stores.values()), "booked_prefills": prefills,
                "booked_decodes": decodes, "engine_sequences": in_engines}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.5)
