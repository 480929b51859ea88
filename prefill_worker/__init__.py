"""The prefill pool's Ray actor: vLLM as KV producer; a prefill computes the prompt's KV into
the node's store."""
