"""The language processing that runs both offline (index stages) and at query time (retrieval): spaCy entities with
their worker pool (`entities`), and the summarizers, BART and extractive (`summarizer`)."""
