"""The language processing that runs both offline (index stages) and at query time (retrieval): spaCy entities with
their worker pool (`entities`, `entity_pool`) and a query's helper process (`entity_process`), and the summarizers,
BART and extractive (`summarizer`)."""
