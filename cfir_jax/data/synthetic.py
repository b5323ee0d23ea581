"""A seeded synthetic world of entities, images and documents, for running the whole pipeline on a CPU.

Generative story (every draw comes from one `numpy.random.Generator` seeded by `SyntheticConfig.seed`):

1. Topics. `num_topics` topics, each a unit vector u_t in R^D and a handful of lowercase nouns ("harbour",
   "festival") that filler sentences draw from.
2. Entities. `num_entities` named entities, each a person ("Mary Walker"), a place ("Lake Ashford", "Redwick
   River", "New Oakham") or an organisation ("the Stoneford Institute"), built from name pools that spaCy's small
   English NER recognises. Each entity belongs to one topic and has a latent unit vector v_e in R^D.
3. Images. Each image depicts 1-3 entities: the first one cycles through a shuffled list of all entities (so every
   entity is depicted), the others come from the first one's topic. Its embedding is
   normalise(sum_e v_e + topic_weight * u_t + noise * g / sqrt(D)), g ~ N(0, I): what a frozen image encoder
   would give if it saw exactly these entities in this kind of scene. Its pixels (`image`, a 96 px PNG) are
   drawn from the same facts (`render_image`): the topic's background colour, and per depicted entity a shape
   (circle: person, triangle: place, square: organisation) in that entity's own colour with its initials, so
   images of one entity look alike and the gallery of a retrieval shows what was found. The caption names the
   entities ("A photo of Mary Walker near Lake Ashford."). The demo imports the embeddings (they stand in for a
   pretrained vision tower that would see these images); the cache's vision-tower path runs on the pixels.
4. Documents. Each document is relevant to 1-`max_relevant` images (the second one from the first one's topic,
   images drawn without replacement while they last). Its text mentions every entity of its relevant images two or
   three times and a few distractor entities once, in sentence templates, interleaved with topic filler sentences
   until it is `min_words`-`max_words` words long. So the entity stage has something to find, the entity index
   finds the relevant images through their entities, and the distractors put wrong candidates in the union.
5. Image-side text. Each image may carry the text fields an AToMiC image has (`Image.texts`, keyed by
   caption_reference_description, caption_alt_text_description, caption_attribution_description), drawn from the
   same hidden facts, noisily: the reference description names the depicted entities, each left out with
   probability 1/4 and now and then joined by a wrong entity of the same topic; the alt text names a noun of the
   scene's topic; the attribution credits an unrelated person; any field may be missing, and some images have
   none. These draws come from their own generator (`[seed, IMAGE_TEXT_STREAM]`), so the rest of the world
   (documents, images, embeddings, qrels) is exactly what it was without them.
6. Qrels. document -> its relevant images (rel 1); documents are split train / validation / test by
   `split_fractions`.
7. Tokenizer. A sentencepiece unigram model trained on the documents and captions, with the BEiT-3 beit3.spm id
   conventions (<unk>=0, <s>=1, </s>=2, no pad piece), shipped as the corpus' `tokenizer.spm`.

8. Categories. Each document has a few category names (`Document.metadata["category"]`, as an AToMiC section's
   category field): one of its topic, from two of the topic's nouns ("Harbour festivals"), and one per planted entity
   of its relevant images, at most two ("Lake Ashford landmarks", "Mary Walker family"). They are derived, not
   drawn, so the rest of the world is exactly what it was without them (`index.entities.sources` reads them).

9. Languages (`SyntheticConfig.languages`, e.g. (("fr", 0.15), ("id", 0.1))): a share of the documents and of the
   images' text is written in French or Indonesian (`cfir_jax.data.synthetic_languages`), each chosen from its own
   stream and rendered from the very draws of the English text, so everything else is the English world's. The
   languages are not stated: the corpus stage detects them (`World.doc_langs` and `image_langs` hold the truth).

Ground truth: `Document.entities` lists the entities the text mentions (relevant ones first, then distractors);
`Image.entities` lists the entities the image depicts.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np

from cfir_jax.core import progress
from cfir_jax.core.config import IMAGE_TEXT_FIELDS as CAPTION_FIELDS
from cfir_jax.core.errors import CfirError
from cfir_jax.core.spm import train_tokenizer
from cfir_jax.data.corpus import SPLITS, Corpus, Document, Image
from cfir_jax.data.corpus_writer import corpus_is_complete, write_corpus
from cfir_jax.data.synthetic_images import IMAGE_SIZE, render_image  # noqa: F401 (IMAGE_SIZE: the images' side)
from cfir_jax.data.synthetic_languages import AT, CREDIT, SCENE, caption, draw_languages, noun_forms, render
from cfir_jax.data.synthetic_words import (
    CAPTION_TEMPLATES,
    FILLER_TEMPLATES,
    FIRST_NAMES,
    LAST_NAMES,
    NOUNS,
    ORG_PATTERNS,
    ORG_TEMPLATES,
    PERSON_TEMPLATES,
    PLACE_PATTERNS,
    PLACE_TEMPLATES,
    STEM_PREFIXES,
    STEM_SUFFIXES,
)

NAME = "synthetic"

# Persons take what the place and organisation pools (1,000 names each) leave; 60 x 60 person names cover it.
MAX_ENTITIES = 5000
# Bump when the images change, so a corpus generated with older pixels is regenerated instead of reused.
RENDER_VERSION = 1
# The image-side text's own random stream (see the docstring), and its version: a corpus generated before images
# had text (or with other text) is regenerated instead of reused.
IMAGE_TEXT_STREAM = 13
IMAGE_TEXT_VERSION = 1
# Documents' category names (`Document.metadata["category"]`, AToMiC's section field): derived from each document's
# planted entities and topic without a random draw, so every other draw of the world is what it was without them.
# Its version makes a corpus generated before documents had categories regenerate instead of being reused.
CATEGORY_VERSION = 1
# What a category says about a planted entity of each kind ("Lake Ashford landmarks", "Mary Walker family").
CATEGORY_NOUN = {"person": "family", "place": "landmarks", "org": "members"}


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Sizes and knobs of the synthetic world; the default generates in seconds, `tiny()` is for tests."""

    seed: int = 0
    num_entities: int = 600
    num_images: int = 5000
    num_documents: int = 2000
    num_topics: int = 20
    nouns_per_topic: int = 8
    dim: int = 64
    min_words: int = 250
    max_words: int = 450
    max_relevant: int = 2  # relevant images per document: 1..max_relevant
    max_distractors: int = 3  # distractor entities per document: 1..max_distractors
    topic_weight: float = 0.3
    noise: float = 0.2
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)  # train, validation, test
    vocab_size: int = 4000
    languages: tuple[tuple[str, float], ...] = ()  # (code, share) of documents and captions not in English

    @classmethod
    def tiny(cls, seed: int = 0, languages: tuple = ()) -> SyntheticConfig:
        """A world small enough to generate in a second or two (tests)."""
        return cls(seed=seed, num_entities=60, num_images=120, num_documents=40, num_topics=5, vocab_size=1000,
                   languages=languages)

    @classmethod
    def named(cls, size: str, seed: int = 0, languages: tuple = ()) -> SyntheticConfig:
        """'tiny' or 'default', with a share of other `languages` ((code, share), ...)."""
        if size == "tiny":
            return cls.tiny(seed, languages)
        if size == "default":
            return cls(seed=seed, languages=languages)
        raise CfirError(f"unknown synthetic size {size!r}; use 'tiny' or 'default'")


@dataclasses.dataclass(frozen=True)
class Entity:
    name: str
    kind: str  # "person", "place" or "org"
    topic: int


@dataclasses.dataclass
class World:
    """The generated world in memory: what `generate` writes, plus the latent vectors behind the embeddings."""

    entities: list[Entity]
    entity_vectors: np.ndarray  # [num_entities, D] unit rows
    topic_vectors: np.ndarray  # [num_topics, D] unit rows
    documents: list[Document]
    images: list[Image]
    qrels: dict[str, dict[str, dict[str, int]]]
    doc_langs: list[str] = dataclasses.field(default_factory=list)  # each document's language (the truth)
    image_langs: list[str] = dataclasses.field(default_factory=list)  # each image's text's language


def _normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _check_config(config: SyntheticConfig) -> None:
    capacity = MAX_ENTITIES
    if not 1 <= config.num_entities <= capacity:
        raise CfirError(f"SyntheticConfig.num_entities={config.num_entities}: must be in [1, {capacity}]")
    if config.num_topics < 1 or config.num_topics * config.nouns_per_topic > 4 * len(NOUNS):
        raise CfirError(f"SyntheticConfig.num_topics={config.num_topics}: must be in [1, {4 * len(NOUNS) // 8}]")
    if config.num_images < 1 or config.num_documents < 1 or config.dim < 2:
        raise CfirError("SyntheticConfig: num_images, num_documents must be >= 1 and dim >= 2")
    if not 0 < config.min_words <= config.max_words:
        raise CfirError(f"SyntheticConfig: need 0 < min_words <= max_words, got {config.min_words}, {config.max_words}")
    if len(config.split_fractions) != 3 or abs(sum(config.split_fractions) - 1) > 1e-6:
        raise CfirError(f"SyntheticConfig.split_fractions={config.split_fractions}: three fractions summing to 1")


def _make_entities(rng: np.random.Generator, config: SyntheticConfig) -> list[Entity]:
    """Unique names: half persons, a quarter places, a quarter organisations (as far as the pools allow)."""
    stems = [p + s for p in STEM_PREFIXES for s in STEM_SUFFIXES]
    persons = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    places = [p.format(s) for p in PLACE_PATTERNS for s in stems]
    orgs = [p.format(s) for p in ORG_PATTERNS for s in stems]
    n_places = min(len(places), config.num_entities // 4)
    n_orgs = min(len(orgs), config.num_entities // 4)
    n_persons = config.num_entities - n_places - n_orgs
    picked = (
        [(n, "person") for n in rng.choice(persons, n_persons, replace=False)]
        + [(n, "place") for n in rng.choice(places, n_places, replace=False)]
        + [(n, "org") for n in rng.choice(orgs, n_orgs, replace=False)]
    )
    order = rng.permutation(len(picked))
    topics = rng.integers(0, config.num_topics, len(picked))
    return [Entity(str(picked[j][0]), picked[j][1], int(t)) for j, t in zip(order, topics)]


def _mention_sentence(rng: np.random.Generator, entity: Entity, nouns: list[str], lang: str = "en"
                      ) -> tuple[str, str]:
    """(the English sentence, the sentence in `lang`) of one draw."""
    templates = {"person": PERSON_TEMPLATES, "place": PLACE_TEMPLATES, "org": ORG_TEMPLATES}[entity.kind]
    k = int(rng.integers(len(templates)))
    n1, n2 = rng.choice(nouns, 2, replace=False)
    slots = {"person": "P", "place": "L", "org": "O"}
    year = int(rng.integers(1800, 2000))
    fields = {slots[entity.kind]: entity.name, "n1": str(n1), "n2": str(n2), "year": year}
    return templates[k].format(**fields), render(lang, templates, k, **fields)


def _filler_sentence(rng: np.random.Generator, nouns: list[str], lang: str = "en") -> tuple[str, str]:
    n1, n2 = rng.choice(nouns, 2, replace=False)
    k = int(rng.integers(len(FILLER_TEMPLATES)))
    return FILLER_TEMPLATES[k].format(n1=n1, n2=n2), render(lang, FILLER_TEMPLATES, k, n1=str(n1), n2=str(n2))


def _caption(rng: np.random.Generator, names: list[str], lang: str = "en") -> str:
    return caption(lang, int(rng.integers(len(CAPTION_TEMPLATES))), names)


def build_world(config: SyntheticConfig = SyntheticConfig()) -> World:
    """Draws the whole world in memory (see the module docstring for the story). Every draw comes from one
    generator, in this order: entities, their vectors, topics, images, documents, the split."""
    _check_config(config)
    rng = np.random.default_rng(config.seed)
    doc_langs, image_langs = draw_languages(config.languages, config.num_documents, config.num_images, config.seed)
    entities = _make_entities(rng, config)
    entity_vectors = _normalise(rng.standard_normal((len(entities), config.dim)))
    topic_vectors = _normalise(rng.standard_normal((config.num_topics, config.dim)))
    topic_nouns = [list(rng.choice(NOUNS, config.nouns_per_topic, replace=False)) for _ in range(config.num_topics)]
    images, image_topic = _draw_images(rng, config, entities, entity_vectors, topic_vectors, image_langs)
    documents, relevant = _draw_documents(rng, config, entities, images, image_topic, topic_nouns, doc_langs)
    images = _with_image_texts(images, entities, image_topic, topic_nouns, config.seed, image_langs)
    qrels = _split_qrels(rng, config, documents, images, relevant)
    return World(entities, entity_vectors, topic_vectors, documents, images, qrels, doc_langs, image_langs)


def _draw_images(rng: np.random.Generator, config: SyntheticConfig, entities: list[Entity],
                 entity_vectors: np.ndarray, topic_vectors: np.ndarray, langs: list[str]
                 ) -> tuple[list[Image], list[int]]:
    """The images (without their text fields) and each one's topic (module docstring, step 3)."""
    by_topic: list[list[int]] = [[] for _ in range(config.num_topics)]
    for e, ent in enumerate(entities):
        by_topic[ent.topic].append(e)
    # The first entity cycles through a shuffled entity list so every entity gets depicted.
    cycle = np.concatenate([rng.permutation(len(entities)) for _ in range(config.num_images // len(entities) + 1)])
    images, image_topic = [], []
    for i in progress.bar(range(config.num_images), desc="world: images", unit="img"):
        first = int(cycle[i])
        topic = entities[first].topic
        others = [e for e in by_topic[topic] if e != first]
        k = min(int(rng.integers(1, 4)), 1 + len(others))
        members = [first] + [int(e) for e in rng.choice(others, k - 1, replace=False)] if k > 1 else [first]
        noise = rng.standard_normal(config.dim) / np.sqrt(config.dim)
        emb = _normalise(
            entity_vectors[members].sum(0) + config.topic_weight * topic_vectors[topic] + config.noise * noise
        )
        names = [entities[e].name for e in members]
        caption = _caption(rng, names, langs[i])
        images.append(Image(image_id=f"img{i:07d}", caption=caption, url="",
                            image=render_image(entities, members, topic, i, config.seed), embedding=emb,
                            entities=tuple(names)))
        image_topic.append(topic)
    return images, image_topic


def _draw_documents(rng: np.random.Generator, config: SyntheticConfig, entities: list[Entity], images: list[Image],
                    image_topic: list[int], topic_nouns: list[list[str]], langs: list[str]
                    ) -> tuple[list[Document], list[list[int]]]:
    """The documents and each one's relevant image indices (module docstring, step 4)."""
    images_of_topic: list[list[int]] = [[] for _ in range(config.num_topics)]
    for i, topic in enumerate(image_topic):
        images_of_topic[topic].append(i)
    # Relevant images are drawn without replacement while they last, so most images belong to one document.
    pool = list(rng.permutation(config.num_images))
    used = np.zeros(config.num_images, bool)
    documents, relevant = [], []
    entity_index = {ent.name: e for e, ent in enumerate(entities)}
    for d in progress.bar(range(config.num_documents), desc="world: documents", unit="doc"):
        rel = _draw_relevant(rng, config, pool, used, images_of_topic, image_topic)
        rel_names: list[str] = []
        for i in rel:
            rel_names += [n for n in images[i].entities if n not in rel_names]
        candidates = [e.name for e in entities if e.name not in rel_names]
        n_distract = min(int(rng.integers(1, config.max_distractors + 1)), len(candidates))
        distractors = [str(n) for n in rng.choice(candidates, n_distract, replace=False)] if n_distract else []
        mentions = [s for n in rel_names for s in [n] * int(rng.integers(2, 4))] + distractors
        nouns = topic_nouns[image_topic[rel[0]]]
        text = _document_text(rng, config, [entities[entity_index[n]] for n in mentions], nouns, langs[d])
        title = rel_names[0]
        documents.append(Document(doc_id=f"doc{d:06d}", text=f"{title}. {text}", title=title,
                                  entities=tuple(rel_names + distractors),
                                  metadata={"category": _categories(rel_names, entities, entity_index, nouns)}))
        relevant.append(rel)
    return documents, relevant


def _draw_relevant(rng: np.random.Generator, config: SyntheticConfig, pool: list, used: np.ndarray,
                   images_of_topic: list[list[int]], image_topic: list[int]) -> list[int]:
    """One document's relevant images: the next unused image of the pool, and maybe a second of its topic."""
    while pool and used[pool[-1]]:
        pool.pop()
    first = int(pool.pop()) if pool else int(rng.integers(config.num_images))
    used[first] = True
    rel = [first]
    if int(rng.integers(1, config.max_relevant + 1)) > 1:
        same = [i for i in images_of_topic[image_topic[first]] if i != first and not used[i]]
        if same:
            second = int(same[rng.integers(len(same))])
            used[second] = True
            rel.append(second)
    return rel


def _document_text(rng: np.random.Generator, config: SyntheticConfig, mentioned: list[Entity],
                   nouns: list[str], lang: str = "en") -> str:
    """One sentence per mention, shuffled, with topic filler sentences inserted until the text is long enough (the
    English words counted, so that every language takes the same draws); in `lang`."""
    sentences = [_mention_sentence(rng, entity, nouns, lang) for entity in mentioned]
    rng.shuffle(sentences)
    target = int(rng.integers(config.min_words, config.max_words + 1))
    words = sum(len(s.split()) for s, _ in sentences)
    while words < target:
        filler = _filler_sentence(rng, nouns, lang)
        sentences.insert(int(rng.integers(len(sentences) + 1)), filler)
        words += len(filler[0].split())
    return " ".join(s for _, s in sentences)


def _split_qrels(rng: np.random.Generator, config: SyntheticConfig, documents: list[Document], images: list[Image],
                 relevant: list[list[int]]) -> dict[str, dict[str, dict[str, int]]]:
    """document -> its relevant images (rel 1), the documents split train / validation / test (step 6)."""
    qrels: dict[str, dict[str, dict[str, int]]] = {s: {} for s in SPLITS}
    n_train = round(config.split_fractions[0] * config.num_documents)
    n_validation = round(config.split_fractions[1] * config.num_documents)
    for rank, d in enumerate(rng.permutation(config.num_documents)):
        split = "train" if rank < n_train else "validation" if rank < n_train + n_validation else "test"
        qrels[split][documents[d].doc_id] = {images[i].image_id: 1 for i in relevant[d]}
    return qrels


def _categories(rel_names: list[str], entities: list[Entity], entity_index: dict[str, int],
                nouns: list[str]) -> tuple[str, ...]:
    """A document's category names, as a Wikipedia section's (AToMiC's `category` field): one of its topic (two of
    the topic's nouns: "Harbour festivals") and one per planted entity of its relevant images, at most two ("Lake
    Ashford landmarks"). No random draw: the world's stream is untouched."""
    topic = f"{nouns[0].capitalize()} {nouns[-1]}s"
    named = [f"{n} {CATEGORY_NOUN[entities[entity_index[n]].kind]}" for n in rel_names[:2]]
    return (topic, *named)


def _with_image_texts(images: list[Image], entities: list[Entity], image_topic: list[int],
                      topic_nouns: list[list[str]], seed: int, langs: list[str]) -> list[Image]:
    """The images with their noisy, sometimes missing text fields (module docstring, step 5), from their own stream."""
    rng = np.random.default_rng([seed, IMAGE_TEXT_STREAM])
    by_topic: dict[int, list[str]] = {}
    for ent in entities:
        by_topic.setdefault(ent.topic, []).append(ent.name)
    persons = [e.name for e in entities if e.kind == "person"] or [e.name for e in entities]
    out = []
    for img, topic, lang in zip(images, image_topic, langs):
        texts: dict[str, tuple[str, ...]] = {}
        if rng.random() < 0.85:  # some images carry no text at all
            names = [n for n in img.entities if rng.random() >= 0.25]
            wrong = [n for n in by_topic[topic] if n not in img.entities]
            if wrong and rng.random() < 0.2:
                names.append(str(wrong[rng.integers(len(wrong))]))
            noun = noun_forms(lang, str(topic_nouns[topic][rng.integers(len(topic_nouns[topic]))]))
            if names and rng.random() < 0.8:
                texts[CAPTION_FIELDS[0]] = (_caption(rng, names, lang).rstrip(".") + f" {AT[lang].format(**noun)}.",)
            if rng.random() < 0.5:
                texts[CAPTION_FIELDS[1]] = (SCENE[lang].format(**noun),)
            if rng.random() < 0.3:
                texts[CAPTION_FIELDS[2]] = (CREDIT[lang].format(persons[rng.integers(len(persons))]),)
        out.append(dataclasses.replace(img, texts=texts))
    return out


def generate(out_dir: str | os.PathLike, config: SyntheticConfig = SyntheticConfig(), detect=None) -> Corpus:
    """Generates the synthetic world into the corpus directory `out_dir` (reused when it holds this config);
    `detect`: each text's language (`cfir_jax.data.corpus_writer.write_corpus`)."""
    recorded = {k: v for k, v in dataclasses.asdict(config).items() if k != "languages" or v}  # English: as before
    fields = {"config": recorded, "source": "synthetic", "render_version": RENDER_VERSION,
              "image_text_version": IMAGE_TEXT_VERSION, "category_version": CATEGORY_VERSION}
    if corpus_is_complete(out_dir, NAME, fields):
        return Corpus.open(out_dir)
    world = build_world(config)
    with tempfile.TemporaryDirectory() as tmp:
        spm_path = Path(tmp) / "tokenizer.spm"
        texts = [d.text for d in world.documents] + [i.caption for i in world.images]
        vocab = train_tokenizer(texts, spm_path, config.vocab_size, config.seed)
        return write_corpus(
            out_dir, NAME, world.documents, world.images, world.qrels, spm_path, tokenizer_vocab_size=vocab,
            detect=detect, **fields)
