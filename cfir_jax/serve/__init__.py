"""The resident service's parts: the FastAPI app (`app`), the micro-batcher into the Retriever's batched path
(`batcher`), the resident index and its reload (`resident`), the background store verifier (`verifier`), the
Prometheus metrics (`metrics`) and the search page (`page`). The command that runs them is `cfir_jax.commands.serve`
(`python retrieve.py --index W --serve`)."""
