"""What the prefill and decode workers share: the Ray actor base hosting one vLLM engine, its
store attachment, KV pulls from other nodes and its stats. The two worker rooms import this,
never each other."""
