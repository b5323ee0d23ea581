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
# The query and the two fits read the trained index and each writes its own store (W/sr_compact, W/reranker,
# W/convex_fusion, each atomically; none takes the writer lock), and none reads another's: they run side by side, so
# that each one's single-threaded stretches fill the other core. Their printouts follow in this order when all three
# have finished; when one failed, the demo stops after printing them.
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
# Each command's stdout and stderr go to one log, unbuffered, in the order a terminal would have shown them.
side() { local name=$1; shift; PYTHONUNBUFFERED=1 "$@" >"$LOGS/$name.log" 2>&1 & echo $! >"$LOGS/$name.pid"; }
echo; echo "== the query, the re-ranker's fit and the fusion's fit, side by side (about a minute)"
side query python retrieve.py --index "$WORK" --query examples/doc.txt --top-k 10 --html "$WORK/doc.html"
side reranker python retrieve.py --index "$WORK" --fit-reranker
side fusion python retrieve.py --index "$WORK" --fit-fusion
failed=""
for name in query reranker fusion; do
  wait "$(cat "$LOGS/$name.pid")" || failed="$failed $name"
done
for name in query reranker fusion; do
  case $name in
    query) echo; echo "== retrieve.py --query examples/doc.txt" ;;
    reranker) echo; echo "== beyond the paper: fit the re-ranker of SR's top 100 on the train split" ;;
    fusion) echo; echo "== beyond the paper: fit the convex fusion's weight of SR and BM25 on the train split" ;;
  esac
  cat "$LOGS/$name.log"
done
if [ -n "$failed" ]; then echo "demo.sh: failed:$failed" >&2; exit 1; fi
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
