"""The synthetic world in other languages (`cfir_jax.data.synthetic`, `SyntheticConfig.languages`): French, which has a
spaCy pipeline (the extra lang-fr), and Indonesian, which has none here (its entities come from the fallback rule).

Each sentence and caption template of `cfir_jax.data.synthetic_words` has its translation at the same position, so a
document or caption in another language is drawn with exactly the draws of the English one and rendered from the
translated template: the world's random stream, qrels and images are the English world's. Names stay as they are
(persons, places and institutions keep their names across languages, as CFIR's entities mostly do); the topics'
nouns are translated (French with its article: "le port" gives "du port", "au port").
"""

from __future__ import annotations

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.data.synthetic_words import (
    CAPTION_TEMPLATES,
    FILLER_TEMPLATES,
    NOUNS,
    ORG_TEMPLATES,
    PERSON_TEMPLATES,
    PLACE_TEMPLATES,
)

LANGUAGES = ("fr", "id")
LANGUAGE_STREAM = 17  # the languages' own random stream ([seed, LANGUAGE_STREAM]): the world's is untouched

_FR_NOUNS = (
    "le port|le festival|le chemin de fer|le pont|le château|le marché|la bibliothèque|le jardin|l'usine|le moulin|"
    "le verger|le vignoble|la cathédrale|l'observatoire|le théâtre|l'école|l'hôpital|le canal|le tunnel|le phare|"
    "la ferme|la carrière|la mine|la forêt|la prairie|l'île|la côte|la forteresse|le palais|le monastère|le village|"
    "l'aéroport|le stade|la brasserie|le chantier naval|la galerie|le laboratoire|le dépôt d'archives|l'expédition|"
    "l'exposition|le concert|le traité|l'élection|la campagne|la grève|l'inondation|la sécheresse|la récolte|"
    "le voyage|le relevé|le recensement|le défilé|la cérémonie|le tournoi|la régate|la foire|le barrage|"
    "le réservoir|la jetée|le bac|le tramway|la grande route|le musée|la collection|le manuscrit|le tableau|"
    "la sculpture|la fresque|le fossile|le télescope|la machine|la locomotive|le bateau à vapeur|l'avion|le satellite"
).split("|")
_ID_NOUNS = (
    "pelabuhan|festival|jalur kereta api|jembatan|kastil|pasar|perpustakaan|taman|pabrik|penggilingan|kebun buah|"
    "kebun anggur|katedral|observatorium|teater|sekolah|rumah sakit|kanal|terowongan|mercusuar|ladang|tambang batu|"
    "tambang|hutan|padang rumput|pulau|pantai|benteng|istana|biara|desa|bandara|stadion|pabrik bir|galangan kapal|"
    "galeri|laboratorium|arsip|ekspedisi|pameran|konser|perjanjian|pemilihan|kampanye|pemogokan|banjir|kemarau|"
    "panen|pelayaran|survei|sensus|pawai|upacara|turnamen|lomba perahu|pekan raya|bendungan|waduk|dermaga|feri|"
    "trem|jalan raya|museum|koleksi|naskah|lukisan|patung|mural|fosil|teleskop|mesin|lokomotif|kapal uap|pesawat|"
    "satelit"
).split("|")
NOUN = {"fr": dict(zip(NOUNS, _FR_NOUNS)), "id": dict(zip(NOUNS, _ID_NOUNS))}

# Position k of each tuple translates position k of the English tuple of the same name.
TEMPLATES = {
    "fr": {
        PERSON_TEMPLATES: (
            "En {year}, {P} a écrit un récit détaillé {de_n1}.",
            "{P} a passé plusieurs années à étudier {n1} et {n2}.",
            "Selon {P}, {n1} a changé rapidement à cette époque.",
            "Des récits plus tardifs attribuent à {P} la conception {de_n1}.",
            "Les lettres de {P} décrivent {n1} avec beaucoup de détails.",
        ),
        PLACE_TEMPLATES: (
            "{N1} près de {L} attirait de nombreux visiteurs chaque été.",
            "En {year}, les travaux {de_n1} de {L} ont commencé.",
            "Les voyageurs décrivaient souvent {L} comme le cœur {de_n1}.",
            "La route vers {L} passait près {de_n1}.",
        ),
        ORG_TEMPLATES: (
            "Des chercheurs du {O} ont publié un rapport sur {n1} en {year}.",
            "Le {O} conserve des archives {de_n1} depuis {year}.",
            "Un financement du {O} a payé la restauration {de_n1}.",
        ),
        FILLER_TEMPLATES: (
            "L'histoire {de_n1} était étroitement liée à celle {de_n2} de la région.",
            "Beaucoup considéraient {n1} comme une part importante de la vie locale.",
            "Au cours des décennies suivantes, {n1} et {n2} se sont développés ensemble.",
            "Les archives {de_n1} étaient conservées près {de_n2}.",
            "On disait que l'on pouvait voir {n1} depuis {n2}.",
            "Chaque année, {n1} attirait des foules venues aussi pour {n2}.",
            "On sait peu de choses sur les origines {de_n1}.",
            "Certains historiens estiment que {n1} comptait plus que {n2}.",
        ),
        CAPTION_TEMPLATES: ("Une photo de {}.", "Une image montrant {}.", "Une vieille photographie de {}.",
                            "Une vue de {}."),
    },
    "id": {
        PERSON_TEMPLATES: (
            "Pada tahun {year}, {P} menulis catatan rinci tentang {n1}.",
            "{P} menghabiskan beberapa tahun mempelajari {n1} dan {n2}.",
            "Menurut {P}, {n1} berubah dengan cepat pada masa itu.",
            "Catatan kemudian menyebut {P} sebagai perancang {n1}.",
            "Surat-surat {P} menggambarkan {n1} dengan sangat rinci.",
        ),
        PLACE_TEMPLATES: (
            "{N1} di dekat {L} menarik banyak pengunjung setiap musim panas.",
            "Pada tahun {year}, {n1} baru dibangun di {L}.",
            "Para pelancong sering menggambarkan {L} sebagai jantung {n1}.",
            "Jalan menuju {L} melewati {n1} tua.",
        ),
        ORG_TEMPLATES: (
            "Para peneliti di {O} menerbitkan laporan tentang {n1} pada tahun {year}.",
            "{O} telah menyimpan catatan tentang {n1} sejak tahun {year}.",
            "Dana dari {O} membiayai pemugaran {n1}.",
        ),
        FILLER_TEMPLATES: (
            "{N1} sangat terkait dengan {n2} di daerah itu.",
            "Banyak orang menganggap {n1} sebagai bagian penting dari kehidupan setempat.",
            "Selama beberapa dekade berikutnya {n1} dan {n2} tumbuh bersama.",
            "Catatan tentang {n1} disimpan di {n2} kecil di dekatnya.",
            "Konon {n1} dapat dilihat dari {n2}.",
            "Setiap tahun {n1} menarik banyak orang yang juga datang untuk {n2}.",
            "Sedikit yang diketahui tentang bagaimana {n1} pertama kali diatur.",
            "Beberapa sejarawan berpendapat bahwa {n1} lebih penting daripada {n2}.",
        ),
        CAPTION_TEMPLATES: ("Foto {}.", "Gambar yang memperlihatkan {}.", "Foto lama {}.", "Pemandangan {}."),
    },
}
# An image's other text fields: its scene ("at the harbour"), the scene alone (alt text), its credit.
AND = {"en": "and", "fr": "et", "id": "dan"}
AT = {"en": "at the {n}", "fr": "{a_n}", "id": "di {n}"}
SCENE = {"en": "The {n}", "fr": "{N}", "id": "{N}"}
CREDIT = {"en": "Photograph by {}", "fr": "Photographie de {}", "id": "Foto oleh {}"}


def _with_preposition(noun: str, preposition: str) -> str:
    """A French noun with its article after 'de' or 'à' ("le port" -> "du port", "au port")."""
    for article, de, a in (("le ", "du ", "au "), ("la ", "de la ", "à la "), ("l'", "de l'", "à l'")):
        if noun.startswith(article):
            return (de if preposition == "de" else a) + noun[len(article):]
    return f"{preposition} {noun}"


def noun_forms(lang: str, noun: str, slot: str = "n") -> dict[str, str]:
    """The forms a template of `lang` may use of the English `noun` in `slot` ("n1": {n1}, {N1}, {de_n1}, {a_n1})."""
    if lang == "en":
        return {slot: noun, slot.upper(): noun.capitalize()}
    word = NOUN[lang][noun]
    forms = {slot: word, slot.upper(): word[:1].upper() + word[1:]}
    if lang == "fr":
        forms.update({f"de_{slot}": _with_preposition(word, "de"), f"a_{slot}": _with_preposition(word, "à")})
    return forms


def render(lang: str, templates: tuple[str, ...], k: int, **slots) -> str:
    """Template k of the English tuple `templates`, in `lang`, with its slots (the nouns as English words)."""
    if lang == "en":
        return templates[k].format(**slots)
    nouns = {}
    for slot in ("n1", "n2"):
        if slot in slots:
            nouns.update(noun_forms(lang, slots.pop(slot), slot))
    return TEMPLATES[lang][templates][k].format(**slots, **nouns)


def caption(lang: str, k: int, names: list[str]) -> str:
    """Caption template k naming `names` ("A, B and C") in `lang`."""
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" {AND[lang]} " + names[-1]
    return (CAPTION_TEMPLATES if lang == "en" else TEMPLATES[lang][CAPTION_TEMPLATES])[k].format(listed)


def draw_languages(shares, num_documents: int, num_images: int, seed: int) -> tuple[list[str], list[str]]:
    """The language of each document and of each image's text: English, or one of `shares` ((code, share), ...)
    with that probability, from the languages' own stream; all English, with no draw, when `shares` is empty."""
    if not shares:
        return ["en"] * num_documents, ["en"] * num_images
    codes, p = [str(c) for c, _ in shares], [float(x) for _, x in shares]
    if any(c not in LANGUAGES for c in codes) or len(set(codes)) < len(codes) or min(p) < 0 or sum(p) > 1:
        raise CfirError(f"synthetic languages {list(shares)}: distinct codes among {', '.join(LANGUAGES)}, each with "
                        "a share >= 0, the shares summing to at most 1")
    rng = np.random.default_rng([seed, LANGUAGE_STREAM])
    choices, probs = ["en", *codes], [max(0.0, 1.0 - sum(p)), *p]
    return [str(x) for x in rng.choice(choices, num_documents, p=probs)], \
        [str(x) for x in rng.choice(choices, num_images, p=probs)]


def parse_shares(text: str) -> tuple[tuple[str, float], ...]:
    """'fr:0.15,id:0.1' (index.corpus.synthetic_languages) -> (("fr", 0.15), ("id", 0.1)); '' -> ()."""
    out = []
    for part in (p.strip() for p in str(text or "").split(",")):
        if not part:
            continue
        code, _, share = part.partition(":")
        try:
            out.append((code.strip(), float(share)))
        except ValueError:
            raise CfirError(f"index.corpus.synthetic_languages={text!r}: expected code:share pairs such as "
                            "'fr:0.15,id:0.1'") from None
    return tuple(out)
