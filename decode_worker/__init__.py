"""The decode pool's Ray actor: vLLM as KV consumer; loads a prompt's KV from the store and
streams its tokens."""
