"""The service on Ray Serve (`retrieve.py --index W --serve --engine ray`, declared in `serve`): the single process's
service (`cfir_jax.serve`) on fronts, with the index in shards. The command (`command`, sizing its Ray in `sizing`,
starting it in `ray_head`), the Ray Serve deployments (`deployments`), a front (`front`) and the HTTP ingress
(`gateway`), an index shard (`shard`), the front's scoring over the shards (`scoring`, and on Ray `ray_shards`), and
the reload protocol that decides which version every part serves (`reload`). docs/serving.md says how it runs and
fails."""
