"""Who may call the API: the bearer key and where it comes from, the ring of keys the server
accepts, the tokens file of keys by digest with their tenants and roles, and the digests
themselves (standard library only, so `jobs-server hash-token` starts fast)."""
