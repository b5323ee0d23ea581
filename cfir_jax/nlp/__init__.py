"""The language processing that runs both offline (index stages) and at query time (retrieval): spaCy entities
(`entities`) and the one module that runs spaCy in other processes (`entity_workers`: the service's, bulk retrieval's,
index.py's and a query's worker pools; `entity_worker_main`, a worker's own side), and the summarizers, BART and
extractive (`summarizer`)."""
