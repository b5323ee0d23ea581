#!/usr/bin/env bash
# The whole CFIR pipeline on the synthetic world, on a CPU, in minutes, with no downloads:
# install -> generate the world -> build the index -> train the language expert -> retrieve -> fit the re-ranker
# -> evaluate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
. .venv/bin/activate
WORK=${WORK:-demo_work}
python index.py --config configs/demo.py --workdir "$WORK"
python train.py --config configs/demo.py --workdir "$WORK"
echo; echo "== retrieve.py --query examples/doc.txt"
python retrieve.py --index "$WORK" --query examples/doc.txt --top-k 10 --html "$WORK/doc.html"
echo; echo "== beyond the paper: fit the re-ranker of SR's top 100 on the train split"
python retrieve.py --index "$WORK" --fit-reranker
echo; echo "== beyond the paper: fit the convex fusion's weight of SR and BM25 on the train split"
python retrieve.py --index "$WORK" --fit-fusion
echo; echo "== evaluation on the synthetic test split"
python retrieve.py --index "$WORK" --evaluate test --compare --plot "$WORK/recall.png"
# The paper's Figure 7 entities (issue 29): SOURCES="spacy+categories categories" bash scripts/demo.sh also rebuilds
# the entities and the entity index of a copy of the workdir with each index.entities.sources and prints its rows.
for S in ${SOURCES:-}; do
  echo; echo "== the rows with index.entities.sources=$S (docs/protocol.md)"
  rm -rf "$WORK-$S" && cp -r "$WORK" "$WORK-$S"
  python index.py --config configs/demo.py --workdir "$WORK-$S" --config.index.entities.sources="$S"
  python retrieve.py --index "$WORK-$S" --evaluate test --compare
done
