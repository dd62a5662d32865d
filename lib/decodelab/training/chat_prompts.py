"""Chat prompts for training and evaluating drafters of SmolLM2 (`decodelab.training.train_eagle`).

Training prompts fill templates (explanations, how-to, comparisons, poems, Python code, emails,
translation, arithmetic) with training subjects; held-out prompts use other templates and
other subjects, so the acceptance rate measured on them is not measured on training text.
"""

from __future__ import annotations

import random

TRAIN_TOPICS = """gravity; photosynthesis; the water cycle; black holes; the French Revolution; the Roman
Empire; climate change; vaccines; the immune system; electricity; magnetism; plate tectonics;
volcanoes; earthquakes; the solar system; the moon landing; DNA; evolution; the internet; machine
learning; neural networks; blockchain; inflation; the stock market; supply and demand; democracy;
the printing press; the Industrial Revolution; World War I; the Renaissance; ancient Egypt; the
Great Wall of China; rainbows; the seasons; tides; sound waves; light; atoms; chemical reactions;
the periodic table; recycling; renewable energy; solar panels; wind turbines; nuclear power; the
human heart; sleep; nutrition; exercise; meditation; stress; friendship; leadership; teamwork;
time management; public speaking; the Pythagorean theorem; prime numbers; fractions; probability;
statistics; algebra; geometry; calculus; compound interest; budgeting; credit scores; taxes;
coffee; chocolate; bread baking; fermentation; honey bees; dolphins; elephants; rainforests;
deserts; coral reefs; glaciers; the Amazon river; Mount Everest; the Olympic Games; chess;
football; jazz; classical music; poetry; Shakespeare; the Mona Lisa; photography; cloud
computing; cybersecurity; passwords; operating systems; databases; email; smartphones; electric
cars; airplanes; rockets; satellites; GPS; batteries; the Big Bang; antibiotics; bacteria;
viruses; allergies; the brain; memory; dreams; languages; writing systems; maps; money;
banking; trade; cities; farming; irrigation; forests; oceans; weather forecasting; hurricanes""".split(";")
TRAIN_THINGS = """a cat; the ocean; autumn; a rainy day; the city at night; a mountain; coffee; a old
library; the first snow; a lighthouse; the stars; a garden; a train journey; a lost key; the sunrise;
a robot; a dragon; a small village; an empty room; a birthday""".split(";")
TRAIN_TASKS = """bake bread; learn a new language; start running; save money; write a resume; plant
tomatoes; fix a flat bicycle tire; make a cup of tea; prepare for a job interview; clean a laptop
keyboard; organize my closet; study for an exam; improve my handwriting; start a blog; learn to
play guitar; make friends in a new city; sleep better; cook rice; change a light bulb; back up my
phone; train a puppy; write a thank-you note; reduce screen time; keep houseplants alive; plan a
birthday party; learn to swim; negotiate a salary; write a cover letter; build a birdhouse; stay
motivated""".split(";")
TRAIN_PAIRS = """cats and dogs; tea and coffee; trains and planes; books and movies; summer and winter;
Python and Java; renting and buying a home; cities and the countryside; email and phone calls;
running and swimming; solar and wind energy; lists and tuples in Python; weather and climate;
viruses and bacteria; stocks and bonds""".split(";")
TRAIN_CODE = """reverses a string; checks whether a number is prime; returns the factorial of n; sorts a
list of numbers; counts the vowels in a string; finds the largest element in a list; removes
duplicates from a list; checks whether a string is a palindrome; computes the Fibonacci numbers;
converts Celsius to Fahrenheit; merges two dictionaries; reads a text file and counts its lines;
returns the sum of a list; flattens a nested list; computes the average of a list""".split(";")
TRAIN_PEOPLE = """my manager; a teacher; my landlord; a customer; my neighbour; a colleague; the school
principal; a friend""".split(";")
TRAIN_REASONS = """a late delivery; asking for a day off; a broken heater; a meeting next week; thanking
them for their help; a change of schedule; a missing invoice; a new project""".split(";")
TRAIN_SENTENCES = """The weather is beautiful today.; I would like a cup of coffee, please.; Where is the
train station?; My brother works in a hospital.; We are going to the beach tomorrow.; This book is
very interesting.; Can you help me with my homework?; The museum opens at nine o'clock.""".split(";")
TRAIN_TEMPLATES = {
    "topic": [
        "Explain {x} in simple terms.",
        "What is {x}?",
        "Give me three facts about {x}.",
        "Why is {x} important?",
        "Write a short paragraph about {x}.",
        "How does {x} work?",
        "What are common misconceptions about {x}?",
        "Tell me something surprising about {x}.",
        "Summarize the key ideas of {x}.",
        "Teach me the basics of {x}.",
    ],
    "thing": [
        "Write a haiku about {x}.",
        "Write a short poem about {x}.",
        "Describe {x} in two sentences.",
        "Write a very short story about {x}.",
    ],
    "task": [
        "How do I {x}?",
        "Give me tips to {x}.",
        "What is the best way to {x}?",
        "Write step-by-step instructions to {x}.",
    ],
    "pair": ["Compare {x}.", "What is the difference between {x}?", "What are the pros and cons of {x}?"],
    "code": ["Write a Python function that {x}.", "Show me Python code that {x}."],
    "email": ["Write a short email to {x}."],
    "translate": ["Translate to French: {x}", "Translate to Spanish: {x}", "Correct the grammar: {x}"],
    "math": [
        "What is {a} plus {b}?",
        "What is {a} times {b}?",
        "If I have {a} apples and give away {b}, how many do I have left?",
        "A train travels {a} km in {b} hours. What is its average speed?",
    ],
}
EVAL_TOPICS = """tornadoes; the Cold War; quantum computing; the Silk Road; migration of birds; the
stomach; cryptocurrency; the speed of light; the Moon's phases; the Byzantine Empire; mushrooms;
3D printing; the French language; the theory of relativity; the human skeleton; opera""".split(";")
EVAL_TEMPLATES = [
    "Can you describe {x} to a ten-year-old?",
    "List five interesting things about {x}.",
    "What should everyone know about {x}?",
    "Write an introduction for an essay on {x}.",
]
EVAL_EXTRA = [
    "Write a limerick about a sleepy penguin.",
    "What should I pack for a weekend camping trip?",
    "Write a JavaScript function that checks if an array is sorted.",
    "How can I become a better listener?",
    "Suggest a name for a bakery that sells only pies.",
    "Write a text message inviting my friends to a picnic on Saturday.",
    "What is 17 multiplied by 23? Explain your steps.",
    "Give me a weekly workout plan for a beginner.",
]


MORE_TOPICS = """the Internet of Things; volcanic islands; the metric system; the Ottoman Empire; ancient Greece;
the Maya civilization; the Vikings; the Cold Chain in food; the human eye; hearing; the skin; the liver;
vitamins; protein; sugar; caffeine; the placebo effect; habits; motivation; creativity; curiosity; empathy;
negotiation; marketing; advertising; startups; remote work; job interviews; unemployment; minimum wage; taxes
on carbon; electric grids; hydrogen fuel; geothermal energy; dams; bridges; skyscrapers; elevators; concrete;
steel; glass; plastics; paper; cotton; silk; wool; rubber; salt; water purification; desalination; sewage
treatment; bicycles; motorcycles; ships; submarines; helicopters; drones; self-driving cars; traffic lights;
public transport; high-speed rail; the Panama Canal; the Suez Canal; the Sahara; Antarctica; the Arctic;
the Himalayas; the Alps; the Nile; the Mississippi River; the Pacific Ocean; islands; caves; rivers; lakes;
wetlands; grasslands; wolves; bears; owls; eagles; sharks; whales; octopuses; ants; butterflies; spiders;
frogs; snakes; penguins; kangaroos; horses; cows; chickens; wheat; rice farming; potatoes; tomatoes; apples;
bananas; olive oil; cheese; yogurt; pizza; sushi; spices; cooking pasta; baking cookies; vegetarian diets;
board games; video games; movies; animation; theater; ballet; painting; sculpture; architecture; fashion;
museums; libraries; universities; online learning; homework; exams; reading habits; novels; fairy tales;
mythology; philosophy; ethics; logic; critical thinking; the scientific method; experiments; telescopes;
microscopes; thermometers; clocks; calendars; time zones; leap years; eclipses; comets; Mars; Jupiter;
Saturn's rings; the Sun; meteor showers; the northern lights""".split(";")


EXTRA_TEMPLATES = {
    "topic": [
        "Write a quiz question about {x} and give the answer.",
        "What are the main challenges related to {x}?",
        "Describe the history of {x} briefly.",
        "How would you explain {x} to a friend?",
        "Give an example that illustrates {x}.",
        "What is the future of {x}?",
    ],
    "task": ["What mistakes should I avoid when trying to {x}?", "I want to {x}. Where do I start?"],
    "thing": ["Write a four-line rhyming poem about {x}."],
    "code": ["Explain how to write a Python function that {x}."],
    "pair": ["Which is better: {x}? Explain briefly."],
}


# A second, broader training set (`broad_train_prompts`): other subjects, other families
# (questions, creative writing in many forms, code in several languages, editing, planning,
# arithmetic). Written without the held-out templates, subjects or requests.
BROAD_SUBJECTS = """the nitrogen cycle; the carbon cycle; osmosis; ocean currents; the ozone layer; acid rain; soil
erosion; pollination; hibernation; camouflage in animals; food chains; ecosystems; biodiversity; extinction;
fossils; dinosaurs; the Ice Age; the kidneys; blood types; the nervous system; muscles; hormones; genetics;
cloning; stem cells; enzymes; cells; computer viruses; algorithms; binary numbers; open-source software;
virtual reality; augmented reality; social media; search engines; web browsers; programming languages;
artificial intelligence; robotics; Wi-Fi; Bluetooth; QR codes; barcodes; touchscreens; microchips;
semiconductors; data privacy; encryption; version control; spreadsheets; video streaming; podcasts; e-books;
the Aztecs; the Inca Empire; the Mongol Empire; the American Revolution; the civil rights movement; the Magna
Carta; the Black Death; the Age of Exploration; the samurai; knights in the Middle Ages; castles; the United
Nations; elections; human rights; urbanization; globalization; population growth; education systems;
insurance; pensions; mortgages; interest rates; exchange rates; freelancing; small businesses; customer
service; supply chains; online shopping; gardening; composting; houseplants; hiking; minimalism;
journaling; gratitude; procrastination; burnout; confidence; kindness; resilience; self-discipline; goal
setting; parenting; retirement; volunteering; meal planning; food waste; hydration; posture; yoga; the
piano; the violin; hip-hop; rock music; folk songs; comic books; graphic design; typography; calligraphy;
pottery; knitting; origami; film editing; stand-up comedy; magic tricks; festivals; New Year traditions;
Tokyo; Paris; New York City; London; Rome; Cairo; Rio de Janeiro; Sydney; Iceland; India; Brazil; Canada;
Kenya; Mexico; Norway; New Zealand; the Grand Canyon; Yellowstone National Park; the Dead Sea; the
Galapagos Islands; basketball; tennis; cycling; marathons; the World Cup; skiing; surfing""".split(";")
BROAD_SUBJECT_TEMPLATES = [
    "Tell me about {x}.",
    "Give me a short overview of {x}.",
    "Explain {x} to a beginner.",
    "What are three key facts about {x}?",
    "Write the opening of a blog post about {x}.",
    "Write a short quiz about {x}, with answers.",
    "What is the most interesting thing about {x}?",
    "How would a teacher explain {x}?",
    "Summarize {x} in one paragraph.",
    "What are some fun facts about {x}?",
    "Write a tweet about {x}.",
    "Which words are useful for talking about {x}?",
    "Describe {x} with an analogy.",
    "Write a short dialogue between two people discussing {x}.",
    "Why do people find {x} fascinating?",
    "Create a short study guide for {x}.",
    "Write three multiple-choice questions about {x}.",
]
BROAD_THINGS = """a paper boat; an old clock; a thunderstorm; a bicycle; the desert at noon; a forgotten letter;
a snowman; a busy market; a quiet forest; a river; a bridge; a sleepy dog; a street musician; a spaceship;
a haunted house; the last day of summer; a kite; a firefly; a window; a fox; the wind; a candle; an umbrella;
a sandcastle; a secret door; a tiny island; a city park; an astronaut far from home; a grandmother's kitchen;
a winter morning; a sunflower; a whale; a bookshop; a clockmaker; a lost balloon; a midnight train""".split(";")
BROAD_THING_TEMPLATES = [
    "Write a short poem about {x}.",
    "Write a story in five sentences about {x}.",
    "Write a song chorus about {x}.",
    "Describe {x} using all five senses.",
    "Write a riddle whose answer is {x}.",
    "Write a diary entry from the point of view of {x}.",
    "Write a free verse poem about {x}.",
    "Write the opening paragraph of a novel about {x}.",
    "Write a bedtime story about {x}.",
]
BROAD_TASKS = """make a budget; learn to code; paint a room; memorize vocabulary; wake up early; focus while
studying; brew coffee at home; clean a cast iron pan; remove a coffee stain; tie a tie; change a car tire;
read faster; take better notes; prepare for a marathon; start meditating; reduce stress at work; make a
good first impression; give constructive feedback; ask for a raise; care for a succulent; grow herbs
indoors; write a short story; start a podcast; edit a photo; learn chess; solve a Rubik's cube; make
pancakes; cook an omelette; make a smoothie; store fresh vegetables; choose a laptop; set up a home
network; protect my privacy online; create a strong password; learn to draw; deal with a difficult
coworker; apologize sincerely; comfort a friend; stop procrastinating; overcome stage fright; travel on a
budget; teach a child to read; write a good essay; get better at math; keep a journal""".split(";")
BROAD_TASK_TEMPLATES = [
    "How can I {x}?",
    "What are the steps to {x}?",
    "Give me a simple plan to {x}.",
    "What do beginners get wrong when they try to {x}?",
    "Explain how to {x} in five steps.",
    "I have one hour. How can I {x}?",
]
BROAD_CODE = """finds the second largest number in a list; counts word frequencies in a sentence; checks
whether two strings are anagrams; converts a binary string to an integer; returns the greatest common
divisor of two numbers; capitalizes every word in a sentence; checks whether a year is a leap year;
generates a random password; finds the common elements of two lists; rotates a list by k positions;
validates an email address; splits a list into chunks of size n; returns the n-th prime number; computes
the median of a list; transposes a matrix; counts the digits of a number; reverses the words in a
sentence; implements binary search; implements bubble sort; returns the longest word in a sentence;
converts minutes to hours and minutes; computes the area of a circle; sums the digits of a number;
prints a multiplication table; finds the minimum and maximum of a list; counts how often each character
appears in a string; checks whether a number is a perfect square; returns the first n even numbers;
merges two sorted lists; removes the punctuation from a string""".split(";")
BROAD_CODE_TEMPLATES = [
    "Write a {lang} function that {x}.",
    "Write a {lang} program that {x}, with comments.",
    "How would you write a function in {lang} that {x}?",
]
BROAD_LANGUAGES = ["Python", "Python", "C", "Java", "Go", "Rust"]
BROAD_PY_FEATURES = """list comprehensions; decorators; generators; f-strings; dictionaries; sets; classes;
inheritance; exceptions; modules; virtual environments; type hints; recursion; lambda functions; the with
statement; *args and **kwargs; slicing; the __init__ method; unit tests; the enumerate function""".split(";")
BROAD_PY_TEMPLATES = ["Explain {x} in Python with an example.", "When should I use {x} in Python?"]
BROAD_TECH_PAIRS = """a list and a set in Python; a class and an object; a compiler and an interpreter; HTTP
and HTTPS; RAM and storage; a process and a thread; git merge and git rebase; SQL and NoSQL databases; TCP
and UDP; a stack and a queue; a function and a method; an array and a linked list""".split(";")
BROAD_RECIPIENTS = """my professor; a hotel; my team; a client; a job recruiter; the city council; an old
friend; my doctor's office""".split(";")
BROAD_SUBJECTS_OF_MAIL = """rescheduling an appointment; a refund request; accepting a job offer; a thank-you
for a gift; a noise complaint; a project update; an apology for missing a deadline; asking for a
recommendation letter""".split(";")
BROAD_MAIL_TEMPLATES = ["Write a polite email to {x}.", "Draft a short letter to {x}.", "Write a formal email to {x}."]
BROAD_SENTENCES = """I think we should meet next week to talk about the project.; The children played in the
park until the sun went down.; Our company has decided to open a new office in Berlin.; She did not finish
her homework because she was tired.; Please send me the report before Friday.; The restaurant was crowded,
but the food was excellent.; He has been learning to play the piano for three years.; It is going to rain
this afternoon, so take an umbrella.; The new phone has a bigger screen and a better camera.; Scientists
found a new species of frog in the rainforest.; I forgot my keys at home this morning.; The concert was
cancelled because of the storm.""".split(";")
BROAD_SENTENCE_TEMPLATES = [
    "Rewrite this sentence to sound more formal: {x}",
    "Translate to German: {x}",
    "Translate to Italian: {x}",
    "Make this sentence shorter: {x}",
    "Explain the grammar of this sentence: {x}",
    "Turn this sentence into a question: {x}",
]
BROAD_QUESTIONS = """Why is the sky blue?; How do airplanes stay in the air?; Why do cats purr?; What causes
thunder?; How do magnets work?; Why do leaves change color in autumn?; Why is the ocean salty?; How do
bees make honey?; Why do we yawn?; How does a refrigerator keep food cold?; What makes a rainbow appear?;
Why do onions make us cry?; How do fish breathe underwater?; Why do we have fingerprints?; How does soap
clean our hands?; Why does ice float?; How do plants know which way is up?; What happens when we sleep?;
Why do stars twinkle?; How does a compass work?; Why do we get goosebumps?; How do noise-cancelling
headphones work?; What is the difference between weather and a season?; How are clouds formed?; Why is
exercise good for the brain?; How does a microwave oven heat food?; What makes bread rise?; Why do
some animals migrate?; How do vaccines get tested?; Why do we need to drink water?; How does a credit card
work?; What is a good way to learn new words?; Why is reading important?; How do I know if a news story is
true?; What makes a good friend?; Why do people procrastinate?; How can I stay calm before an exam?; What
is the best way to start a conversation?; How do I choose a good book?; Is it better to study in the
morning or at night?""".split(";")
BROAD_IDEAS = """a school science project; a rainy weekend; a team-building activity; a short film; a gift for
my father; a healthy breakfast; a blog about cooking; a small balcony garden; a family dinner; a history
presentation; a children's party game; a new mobile app""".split(";")
BROAD_IDEA_TEMPLATES = ["Give me five ideas for {x}.", "Brainstorm some creative ideas for {x}."]
BROAD_GENRES = """science fiction; mystery novels; history; poetry; cooking; travel writing; fantasy;
biographies""".split(";")
BROAD_CITIES = """Kyoto; Barcelona; Istanbul; Lisbon; Vienna; Prague; Amsterdam; Seoul""".split(";")


def _items(text_list: list[str]) -> list[str]:
    return [" ".join(t.split()) for t in text_list if t.strip()]


def _fill(rng: random.Random, templates: list[str], items: list[str], per_item: int | None = None) -> list[str]:
    """Each of `items` (cleaned by `_items`) put into `per_item` of the templates drawn at random,
    or into every template when per_item is None."""
    return [
        t.format(x=x)
        for x in _items(items)
        for t in (templates if per_item is None else rng.sample(templates, per_item))
    ]


def _distinct_shuffled(prompts: list[str], rng: random.Random) -> list[str]:
    """Duplicates dropped, then a seeded order (so the first n of a list are a fair sample)."""
    prompts = sorted(set(prompts))
    rng.shuffle(prompts)
    return prompts


def train_prompts(seed: int = 0) -> list[str]:
    """About 1,150 distinct training prompts: every template family over the training subjects."""
    rng = random.Random(seed)
    lists = {
        "topic": _items(TRAIN_TOPICS),
        "thing": _items(TRAIN_THINGS),
        "task": _items(TRAIN_TASKS),
        "pair": _items(TRAIN_PAIRS),
        "code": _items(TRAIN_CODE),
        "email": [f"{p} about {r}" for p in _items(TRAIN_PEOPLE) for r in _items(TRAIN_REASONS)],
        "translate": _items(TRAIN_SENTENCES),
    }
    prompts = []
    for kind, templates in TRAIN_TEMPLATES.items():
        if kind == "math":
            for i in range(40):
                prompts.append(templates[i % len(templates)].format(a=rng.randint(2, 99), b=rng.randint(2, 40)))
            continue
        for x in lists[kind]:
            picks = rng.sample(templates, min(len(templates), 3 if kind == "topic" else 2))
            prompts += [t.format(x=x) for t in picks]
    for kind, templates in EXTRA_TEMPLATES.items():
        prompts += [rng.choice(templates).format(x=x) for x in lists[kind]]
    topic_templates = TRAIN_TEMPLATES["topic"] + EXTRA_TEMPLATES["topic"]
    prompts += _fill(rng, topic_templates, MORE_TOPICS, 2)
    return _distinct_shuffled(prompts, rng)


def broad_train_prompts(seed: int = 1) -> list[str]:
    """About 1,000 more training prompts, broader than `train_prompts` (other subjects and
    families), none of them a held-out prompt, template or subject."""
    rng = random.Random(seed)
    prompts = _fill(rng, BROAD_SUBJECT_TEMPLATES, BROAD_SUBJECTS, 3)
    prompts += _fill(rng, BROAD_THING_TEMPLATES, BROAD_THINGS, 3)
    prompts += _fill(rng, BROAD_TASK_TEMPLATES, BROAD_TASKS, 2)
    prompts += [
        t.format(x=x, lang=rng.choice(BROAD_LANGUAGES))
        for x in _items(BROAD_CODE)
        for t in rng.sample(BROAD_CODE_TEMPLATES, 2)
    ]
    prompts += _fill(rng, BROAD_PY_TEMPLATES, BROAD_PY_FEATURES)
    prompts += [f"What is the difference between {x}?" for x in _items(BROAD_TECH_PAIRS)]
    prompts += [
        rng.choice(BROAD_MAIL_TEMPLATES).format(x=f"{who} about {what}")
        for who in _items(BROAD_RECIPIENTS)
        for what in _items(BROAD_SUBJECTS_OF_MAIL)
    ]
    prompts += _fill(rng, BROAD_SENTENCE_TEMPLATES, BROAD_SENTENCES, 3)
    prompts += _items(BROAD_QUESTIONS)
    prompts += _fill(rng, BROAD_IDEA_TEMPLATES, BROAD_IDEAS)
    prompts += [f"Recommend three books for someone who likes {x}." for x in _items(BROAD_GENRES)]
    prompts += [f"Plan a one-day visit to {x}." for x in _items(BROAD_CITIES)]
    arithmetic = [
        "What is {a} minus {b}?",
        "What is {a} divided by {b}?",
        "What is {b} percent of {a}?",
        "Solve for x: {b}x + {a} = {c}.",
        "A pen costs {b} cents. How much do {a} pens cost?",
        "What is the square of {b}?",
        "Convert {a} kilometers to miles.",
        "A recipe needs {b} eggs for 4 people. How many eggs do I need for {c} people?",
    ]
    for i in range(80):
        a, b, c = rng.randint(10, 999), rng.randint(2, 60), rng.randint(2, 12)
        prompts.append(arithmetic[i % len(arithmetic)].format(a=a, b=b, c=c))
    return _distinct_shuffled(prompts, rng)


def eval_prompts() -> list[str]:
    """24 held-out prompts: other templates, other subjects."""
    topics = _items(EVAL_TOPICS)
    return [EVAL_TEMPLATES[i % len(EVAL_TEMPLATES)].format(x=t) for i, t in enumerate(topics)] + EVAL_EXTRA
