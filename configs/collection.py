"""Your own collection (docs/collection.md): documents and images from plain files, indexed and queried with a
model trained elsewhere. As shipped it indexes examples/collection/ with the demo's model:

  python index.py    --config configs/demo.py --workdir demo_work             # once: the demo's model
  python train.py    --config configs/demo.py --workdir demo_work             # (its summary-trained text tower)
  python index.py    --config configs/collection.py --workdir collection_work --config.index.encoder=demo_work
  python retrieve.py --config configs/collection.py --index collection_work --query examples/collection/query.txt
  python retrieve.py --config configs/collection.py --index collection_work --evaluate test

index.encoder names the other workdir: its index encoder (recorded in collection_work/index.json with its
fingerprints), its summary-trained model (recorded the same way) and its corpus' tokenizer are used; nothing is
trained here. Expected: 9 of the 10 example documents with one of their own images
(examples/collection/qrels/test.qrels) in their top 10. Your files:
--config.index.corpus.documents=FILE --config.index.corpus.images=DIR_OR_FILE [--config.index.corpus.qrels=DIR]
(and --config.index.image_cache.precomputed= when your images carry no embedding: the vision tower encodes them).
"""

from configs.demo import get_config as demo_config


def get_config(arg=None):
    if arg:
        raise ValueError(f"unknown config variant {arg!r}: configs/collection.py takes none")
    cfg = demo_config()
    example = "examples/collection"
    cfg.index.corpus.update(source="files", documents=f"{example}/documents.jsonl", images=f"{example}/images.jsonl",
                            qrels=f"{example}/qrels")
    cfg.index.encoder = ""  # another workdir (demo_work) or a converted BEiT-3 model directory: set on the command line
    cfg.index.image_cache.update(precomputed="corpus")
    # No train qrels: the entities of every document are indexed. About 40 images: a list of 10 per entity.
    cfg.index.entity_index.update(k=10, documents="all")
    cfg.index.image_text.enabled = False
    cfg.index.entity_text_match.enabled = False
    cfg.retrieval.update(top_k=10)
    return cfg
