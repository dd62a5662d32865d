"""Chat prompts for training and evaluating drafters of SmolLM2 (`decodelab.train_eagle`).

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
    "topic": ["Explain {x} in simple terms.", "What is {x}?", "Give me three facts about {x}.",
              "Why is {x} important?", "Write a short paragraph about {x}.", "How does {x} work?",
              "What are common misconceptions about {x}?", "Tell me something surprising about {x}.",
              "Summarize the key ideas of {x}.", "Teach me the basics of {x}."],
    "thing": ["Write a haiku about {x}.", "Write a short poem about {x}.", "Describe {x} in two sentences.",
              "Write a very short story about {x}."],
    "task": ["How do I {x}?", "Give me tips to {x}.", "What is the best way to {x}?",
             "Write step-by-step instructions to {x}."],
    "pair": ["Compare {x}.", "What is the difference between {x}?", "What are the pros and cons of {x}?"],
    "code": ["Write a Python function that {x}.", "Show me Python code that {x}."],
    "email": ["Write a short email to {x}."],
    "translate": ["Translate to French: {x}", "Translate to Spanish: {x}", "Correct the grammar: {x}"],
    "math": ["What is {a} plus {b}?", "What is {a} times {b}?", "If I have {a} apples and give away {b}, "
             "how many do I have left?", "A train travels {a} km in {b} hours. What is its average speed?"],
}
EVAL_TOPICS = """tornadoes; the Cold War; quantum computing; the Silk Road; migration of birds; the
stomach; cryptocurrency; the speed of light; the Moon's phases; the Byzantine Empire; mushrooms;
3D printing; the French language; the theory of relativity; the human skeleton; opera""".split(";")
EVAL_TEMPLATES = ["Can you describe {x} to a ten-year-old?", "List five interesting things about {x}.",
                  "What should everyone know about {x}?", "Write an introduction for an essay on {x}."]
EVAL_EXTRA = ["Write a limerick about a sleepy penguin.", "What should I pack for a weekend camping trip?",
              "Write a JavaScript function that checks if an array is sorted.",
              "How can I become a better listener?", "Suggest a name for a bakery that sells only pies.",
              "Write a text message inviting my friends to a picnic on Saturday.",
              "What is 17 multiplied by 23? Explain your steps.",
              "Give me a weekly workout plan for a beginner."]


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
    "topic": ["Write a quiz question about {x} and give the answer.", "What are the main challenges related to {x}?",
              "Describe the history of {x} briefly.", "How would you explain {x} to a friend?",
              "Give an example that illustrates {x}.", "What is the future of {x}?"],
    "task": ["What mistakes should I avoid when trying to {x}?", "I want to {x}. Where do I start?"],
    "thing": ["Write a four-line rhyming poem about {x}."],
    "code": ["Explain how to write a Python function that {x}."],
    "pair": ["Which is better: {x}? Explain briefly."],
}




def _items(text_list: list[str]) -> list[str]:
    return [" ".join(t.split()) for t in text_list if t.strip()]


def train_prompts(seed: int = 0) -> list[str]:
    """About 1,300 distinct training prompts: every template family over the training subjects."""
    rng = random.Random(seed)
    lists = {"topic": _items(TRAIN_TOPICS), "thing": _items(TRAIN_THINGS), "task": _items(TRAIN_TASKS),
             "pair": _items(TRAIN_PAIRS), "code": _items(TRAIN_CODE),
             "email": [f"{p} about {r}" for p in _items(TRAIN_PEOPLE) for r in _items(TRAIN_REASONS)],
             "translate": _items(TRAIN_SENTENCES)}
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
    prompts += [t.format(x=x) for x in _items(MORE_TOPICS) for t in rng.sample(topic_templates, 2)]
    prompts = sorted(set(prompts))
    rng.shuffle(prompts)
    return prompts


def eval_prompts() -> list[str]:
    """24 held-out prompts: other templates, other subjects."""
    topics = _items(EVAL_TOPICS)
    return [EVAL_TEMPLATES[i % len(EVAL_TEMPLATES)].format(x=t) for i, t in enumerate(topics)] + EVAL_EXTRA
