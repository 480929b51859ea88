"""Bringing a cluster up and operating it: the local single-machine cluster, the Ray deployment
(``baton up``/``down``), the prefill and decode pools, and the cluster's config model."""
