"""The deciding core: where each request's prefill and decode run.

The KV index (who holds which block in which tier, fed by KV events), the queue book
(``state.ConductorState``), the placement policies as pure functions over a snapshot
(``snapshot``, ``baselines``, ``baton_policy``), the one prefill price (``pricing``), admission
(``admission``), the cost model, and the ``Conductor`` Ray actor that gathers the state, calls
them and applies the result. It never sees a wire format and knows nothing of how workers are
started (``cluster.control`` adds the pool verbs)."""
