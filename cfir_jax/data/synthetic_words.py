"""The synthetic world's vocabulary (`cfir_jax.data.synthetic`): person, place and organisation names, the nouns of
its topics, and the sentence and caption templates its documents and images are written from. Changing any of them
changes every world drawn from a seed."""

FIRST_NAMES = (
    "James Mary John Patricia Robert Jennifer Michael Linda William Elizabeth David Barbara Richard Susan Joseph "
    "Jessica Thomas Sarah Charles Karen Daniel Nancy Matthew Lisa Anthony Margaret Mark Sandra Donald Ashley Steven "
    "Emily Paul Donna Andrew Michelle Joshua Carol Kenneth Amanda Kevin Melissa Brian Deborah George Stephanie "
    "Edward Rebecca Ronald Laura Timothy Helen Jason Sharon Jeffrey Cynthia Ryan Kathleen Jacob Anna"
).split()
LAST_NAMES = (
    "Smith Johnson Williams Brown Jones Miller Davis Wilson Anderson Taylor Thomas Moore Martin Jackson Thompson "
    "White Harris Clark Lewis Robinson Walker Young Allen King Wright Scott Hill Green Adams Baker Nelson Carter "
    "Mitchell Roberts Turner Phillips Campbell Parker Evans Edwards Collins Stewart Morris Rogers Reed Cook Morgan "
    "Bell Murphy Bailey Cooper Richardson Cox Howard Ward Peterson Gray Hughes Price Bennett"
).split()
# Place and organisation names are built from English-looking town names: prefix + suffix ("Ash" + "ford").
STEM_PREFIXES = ("Ash Brook Clear Elm Fair Glen Green Hart Kings Lang Marl North Oak Pine Red Rock Stone West Wood "
                 "Silver").split()
STEM_SUFFIXES = "ford field ton wood dale bury ham wick port ville".split()
PLACE_PATTERNS = ("{} River", "Lake {}", "New {}", "Mount {}", "{} Bay")
ORG_PATTERNS = ("{} Institute", "{} University", "{} Museum", "{} Foundation", "{} Corporation")

NOUNS = (
    "harbour festival railway bridge castle market library garden factory mill orchard vineyard cathedral "
    "observatory theatre school hospital canal tunnel lighthouse farm quarry mine forest meadow island coast "
    "fortress palace monastery village airport stadium brewery shipyard gallery laboratory archive expedition "
    "exhibition concert treaty election campaign strike flood drought harvest voyage survey census parade "
    "ceremony tournament regatta fair dam reservoir pier ferry tramway highway museum collection manuscript "
    "painting sculpture mural fossil telescope engine locomotive steamship aircraft satellite"
).split()

PERSON_TEMPLATES = (
    "In {year}, {P} wrote a detailed account of the {n1}.",
    "{P} spent several years studying the {n1} and its {n2}.",
    "According to {P}, the {n1} changed rapidly during that period.",
    "Later accounts credit {P} with the design of the {n1}.",
    "The letters of {P} describe the {n1} in great detail.",
)
PLACE_TEMPLATES = (
    "The {n1} near {L} attracted many visitors every summer.",
    "In {year}, a new {n1} was built at {L}.",
    "Travellers often described {L} as the heart of the {n1}.",
    "The road to {L} passed by an old {n1}.",
)
ORG_TEMPLATES = (
    "Researchers at the {O} published a report on the {n1} in {year}.",
    "The {O} has kept records of the {n1} since {year}.",
    "Funding from the {O} paid for the restoration of the {n1}.",
)
FILLER_TEMPLATES = (
    "The {n1} was closely linked to the {n2} of the area.",
    "Many people considered the {n1} an important part of local life.",
    "Over the following decades the {n1} and the {n2} grew together.",
    "Records of the {n1} were kept in a small {n2} nearby.",
    "It was said that the {n1} could be seen from the {n2}.",
    "Each year the {n1} drew crowds who also came for the {n2}.",
    "Little is known about how the {n1} was first organised.",
    "Some historians argue that the {n1} mattered more than the {n2}.",
)
CAPTION_TEMPLATES = ("A photo of {}.", "A picture showing {}.", "An old photograph of {}.", "A view of {}.")
