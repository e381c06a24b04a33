"""Offline training prompts, disjoint from the bench suite.

Three sources, all built on the machine without downloads: coding tasks from
the Python standard library (public functions' signatures and docstrings),
generated arithmetic word problems, and explanation/advice questions from
templates. Any prompt sharing a 6-word run with a bench prompt is dropped, so
the evaluation prompts stay held out.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import warnings
from pathlib import Path

BENCH_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "bench_prompts.json"
STDLIB_MODULES = (
    "bisect base64 calendar collections colorsys copy csv datetime difflib fnmatch fractions "
    "functools glob gzip hashlib heapq html itertools json keyword math operator os.path "
    "pathlib pprint random re secrets shlex shutil statistics string textwrap time urllib.parse "
    "uuid zlib decimal ipaddress struct unicodedata tempfile contextlib dataclasses enum "
    "argparse logging sqlite3 zipfile tarfile email.utils http.client socket threading queue "
    "subprocess typing abc weakref array cmath numbers locale gettext codecs io"
).split()

CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that {doc} Include a short example.",
    "Explain what `{qual}` does in Python and show a small usage example.",
    "Implement your own version of `{qual}` in plain Python ({doc_short}), then test it.",
    "When would I use `{qual}`? Give two practical examples with code.",
    "Write a Python script that demonstrates `{qual}` and explain the output.",
    "Show how to use `{qual}` correctly and mention one common mistake.",
)
CODE_EXTRA = (
    "Write a Python function that {task}, with a docstring and one example.",
    "Write a JavaScript function that {task}.",
    "Write a Python function that {task} and explain its time complexity.",
    "Write a unit test with pytest for a function that {task}.",
)
CODE_TASKS = (
    "counts the vowels in a string",
    "returns the largest element of a list without using max()",
    "flattens a nested list of lists",
    "checks whether a number is prime",
    "converts Celsius to Fahrenheit",
    "returns the word frequencies of a text as a dictionary",
    "rotates a list by k positions",
    "computes the factorial of n recursively",
    "removes all whitespace from a string",
    "finds the second smallest number in a list",
    "checks whether two strings are anagrams",
    "returns the running sum of a list",
    "groups a list of words by their first letter",
    "computes the greatest common divisor of two integers",
    "validates that a string looks like an email address",
    "transposes a matrix given as a list of lists",
    "capitalises the first letter of every word in a sentence",
    "splits a list into chunks of size n",
    "returns the indices of all occurrences of a value in a list",
    "sums the digits of an integer",
    "converts a Roman numeral to an integer",
    "finds the longest word in a sentence",
    "computes the median of a list of numbers",
    "reverses the order of words in a sentence",
    "returns the n largest values of a dictionary by value",
    "checks whether a list is sorted",
    "counts how many times each character occurs in a string",
    "converts a binary string to an integer",
    "returns the intersection of two lists without duplicates",
    "computes the dot product of two vectors",
    "implements bubble sort",
    "implements insertion sort",
    "implements a queue with two stacks",
    "parses a date string in the format YYYY-MM-DD",
    "computes the power set of a small list",
    "returns True if a string contains balanced parentheses",
    "finds the most common element in a list",
    "computes compound growth over n periods",
    "reads a text file and returns its number of words",
    "memoizes the results of an expensive function",
)

TOPICS = (
    "how a refrigerator keeps food cold",
    "what inflation is",
    "how rainbows form",
    "how the heart pumps blood",
    "what a black hole is",
    "how tides work",
    "what DNA does",
    "how a bill becomes law",
    "what gravity is",
    "how a battery stores energy",
    "what machine learning is",
    "how airplanes stay in the air",
    "what a database index is",
    "how public-key cryptography works",
    "what an API is",
    "how a web browser loads a page",
    "what garbage collection is in programming",
    "how the stock market works",
    "what a neural network is",
    "how earthquakes happen",
    "what the greenhouse effect is",
    "how a microwave oven heats food",
    "what a cache is",
    "how GPS finds your location",
    "what a virus is in biology",
    "how the moon affects the earth",
    "what an operating system does",
    "how interest on a loan works",
    "what a budget is",
    "how bees make honey",
    "what a prime number is",
    "how electricity reaches a house",
    "what a function is in mathematics",
    "how plants grow from seeds",
    "what the internet is",
    "how a car engine works",
    "what a password manager does",
    "how clouds form",
    "what sorting algorithms are",
    "how a camera captures an image",
    "what a spreadsheet is for",
    "how volcanoes erupt",
    "what the water cycle is",
    "how a thermostat works",
    "what big-O notation means",
    "how muscles grow",
    "what an election is",
    "how solar panels make electricity",
    "what a linked list is",
    "how sound travels",
    "what a queue is in computing",
    "how encryption protects messages",
    "what a loop is in code",
    "how the seasons change",
    "what a calorie is",
    "how wind turbines work",
    "what a variable is in programming",
    "how the eye sees colour",
    "what unit tests are",
    "how a lock and key work",
    "what a mortgage is",
    "how a bicycle gear system works",
)
TOPIC_TEMPLATES = (
    "Explain {topic}.",
    "Can you explain {topic} in a few sentences?",
    "Describe {topic} for a beginner.",
    "Give a short explanation of {topic}, with an example.",
    "I never understood {topic}. Can you help?",
)
ADVICE = (
    "Give me four tips for {x}.",
    "What is a good way to {x}?",
    "Write a short checklist for {x}.",
    "How should a beginner approach {x}?",
)
ADVICE_TOPICS = (
    "learning a new language",
    "saving money each month",
    "sleeping better",
    "preparing for a job interview",
    "keeping a houseplant alive",
    "studying for an exam",
    "cooking healthy meals on a budget",
    "organising a small team meeting",
    "writing a good cover letter",
    "staying focused while working from home",
    "planning a weekend trip",
    "learning to play the guitar",
    "starting a vegetable garden",
    "giving a short presentation",
    "reading more books",
    "keeping a tidy desk",
    "debugging a program",
    "naming variables in code",
    "writing documentation",
    "learning Python as a first language",
    "backing up important files",
)
WRITE = (
    "Write a short thank-you note to a neighbour who watered my plants.",
    "Write a two-sentence product description for a reusable water bottle.",
    "Write a short poem about autumn leaves.",
    "Write a polite message declining a meeting invitation.",
    "Write a short story opening about a lost robot.",
    "Write a haiku about the ocean.",
    "Write a short announcement that the office will be closed on Friday.",
    "Write a friendly reminder to a friend about returning a borrowed book.",
    "Write a limerick about a cat who loves boxes.",
    "Write three interview questions for a junior developer.",
)

NAMES = ("Anna", "Ben", "Chen", "Dina", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi")
ITEMS = ("apples", "pencils", "tickets", "books", "cupcakes", "marbles", "stickers", "bottles")


def _word_problem(rng: random.Random) -> str:
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    price = rng.choice((0.5, 0.75, 1.2, 1.5, 2, 2.25, 3, 4.5, 6))
    pct = rng.choice((10, 15, 20, 30, 40, 50))
    kinds = (
        f"{n} has {a} {item} and gives {b % a + 1} of them to {m}. Then {n} buys {c} more. "
        f"How many {item} does {n} have now?",
        f"A box holds {c} {item}. How many boxes are needed for {a * c + b % c} {item}? "
        "Explain your answer.",
        f"{n} buys {c} {item} at ${price} each and pays with a ${a + 40} bill. What is the change?",
        f"A bike rides {a * 3} km in {c} hours. What is its average speed? Show the calculation.",
        f"A price of ${a * 5} is reduced by {pct}%. What is the new price?",
        f"{n} reads {b} pages a day. How many days does a {b * c + a} page book take?",
        f"What is {a} times {b} plus {c * 7}? Work it out step by step.",
        f"A garden is {a} m long and {b} m wide. What are its area and perimeter?",
        f"{n} is {c} years older than {m}. Together they are {2 * a + c} years old. "
        "How old is each?",
        f"A worker earns ${a + 10} per hour and works {c + 20} hours a week. "
        "How much is that per year of 50 weeks?",
        f"Simplify the fraction {a * c}/{b * c} and explain each step.",
        f"What is {pct}% of {a * 20}? Explain how to compute it.",
        f"A pool holds {a * 100} liters and fills at {b + 10} liters per minute. "
        "How many minutes until it is full?",
        f"Solve for y: {c}y - {b} = {a}. Check the result.",
        f"The average of four numbers is {a}. Three of them are {b}, {c} and {a + 3}. "
        "What is the fourth?",
        f"If {c} workers build a wall in {a} days, how long would {c * 2} workers take?",
        f"Is {a * b + 1} a prime number? Explain how you check.",
        f"Convert {a * 100} minutes into hours and minutes.",
    )
    return rng.choice(kinds)


# A broader pool (v2): compositional frames over larger subject lists, so that
# replies vary in structure and vocabulary, not just in the numbers. The bench's
# own topics (hash tables, TCP/UDP, vaccines, commit messages, ...) are left out.
SUBJECTS = (
    "a refrigerator",
    "inflation",
    "a rainbow",
    "the human heart",
    "a black hole",
    "ocean tides",
    "DNA",
    "gravity",
    "a lithium battery",
    "machine learning",
    "an airplane wing",
    "a database",
    "public-key cryptography",
    "a REST API",
    "a web browser",
    "the stock market",
    "a neural network",
    "an earthquake",
    "the greenhouse effect",
    "a microwave oven",
    "a CPU cache",
    "GPS",
    "the moon",
    "an operating system",
    "a loan",
    "honey bees",
    "electricity in a house",
    "a car engine",
    "a password manager",
    "clouds",
    "a digital camera",
    "a volcano",
    "the water cycle",
    "a thermostat",
    "muscles",
    "solar panels",
    "sound",
    "the seasons",
    "calories",
    "wind turbines",
    "the human eye",
    "a mortgage",
    "bicycle gears",
    "coffee",
    "bread dough",
    "a compass",
    "the printing press",
    "the Roman Empire",
    "the Silk Road",
    "the Industrial Revolution",
    "democracy",
    "supply and demand",
    "a central bank",
    "compound interest",
    "a credit score",
    "insurance",
    "taxes",
    "a budget",
    "recycling",
    "composting",
    "coral reefs",
    "rain forests",
    "deserts",
    "glaciers",
    "the ozone layer",
    "antibiotics",
    "the immune system",
    "sleep",
    "dreams",
    "memory",
    "habits",
    "stress",
    "meditation",
    "caffeine",
    "vitamins",
    "protein",
    "a marathon",
    "yoga",
    "chess",
    "jazz",
    "the violin",
    "oil painting",
    "photography",
    "a film camera",
    "a telescope",
    "Mars",
    "the Sun",
    "comets",
    "the Milky Way",
    "satellites",
    "rockets",
    "a submarine",
    "a bridge",
    "a skyscraper",
    "concrete",
    "steel",
    "glass",
    "plastic",
    "paper",
    "a pencil",
    "ink",
    "a clock",
    "a calendar",
    "time zones",
    "maps",
    "an election",
    "a jury",
    "a contract",
    "copyright",
    "open-source software",
    "a spreadsheet",
    "a text editor",
    "email",
    "Wi-Fi",
    "Bluetooth",
    "a router",
    "DNS",
    "a firewall",
    "a VPN",
    "cloud computing",
    "a data center",
    "a QR code",
    "a barcode",
    "a credit card",
    "a blockchain",
    "a search engine",
    "a recommendation system",
    "a chatbot",
    "a robot vacuum",
    "3D printing",
    "an electric car",
    "a heat pump",
    "a nuclear power plant",
    "a hydroelectric dam",
    "a lighthouse",
    "a train",
    "a subway system",
    "traffic lights",
    "a roundabout",
    "an elevator",
    "a zipper",
    "velcro",
    "soap",
    "a thermometer",
    "a barometer",
    "lightning",
    "hurricanes",
    "snowflakes",
    "fog",
    "the northern lights",
    "photons",
    "atoms",
    "magnets",
    "friction",
    "buoyancy",
    "evaporation",
    "fermentation",
    "yeast",
    "cheese",
    "chocolate",
    "tea",
    "rice farming",
    "bees and pollination",
    "bird migration",
    "whales",
    "octopuses",
    "ants",
    "wolves",
    "dinosaurs",
    "fossils",
    "evolution",
    "genes",
    "blood types",
    "the liver",
    "the lungs",
    "the brain",
    "bones",
    "teeth",
    "skin",
    "hearing",
    "taste",
    "a pendulum",
    "a lever",
    "a pulley",
    "a gear train",
    "an electric motor",
    "a transistor",
    "a diode",
    "a capacitor",
    "a resistor",
    "binary numbers",
    "floating-point numbers",
    "a linked list",
    "a binary tree",
    "a graph algorithm",
    "a queue",
    "a priority queue",
    "dynamic programming",
    "regular expressions",
    "unit tests",
    "code review",
    "continuous integration",
    "containers",
    "virtual machines",
    "a shell",
    "environment variables",
    "a package manager",
    "semantic versioning",
    "an index in a book",
)
SUBJECT_FRAMES = (
    "How does {s} work?",
    "What is {s}, in plain words?",
    "Why is {s} important?",
    "What are the pros and cons of {s}?",
    "Explain {s} to a twelve-year-old.",
    "Give me three interesting facts about {s}.",
    "Describe the history of {s} in a short paragraph.",
    "What are common misconceptions about {s}?",
    "Describe {s} in one paragraph.",
    "How has {s} changed over the last fifty years?",
    "What would happen if there were no {s}?",
    "Write a short quiz with three questions about {s}, with answers.",
    "What is the most surprising thing about {s}?",
    "Explain {s} using an analogy.",
)
PAIRS = (
    ("weather", "climate"),
    ("a virus", "a bacterium"),
    ("RAM", "a hard disk"),
    ("a list", "a tuple in Python"),
    ("speed", "velocity"),
    ("mass", "weight"),
    ("a loan", "a grant"),
    ("stocks", "bonds"),
    ("a comet", "an asteroid"),
    ("a lake", "a pond"),
    ("baking soda", "baking powder"),
    ("a crocodile", "an alligator"),
    ("an emergency fund", "a savings account"),
    ("HTML", "CSS"),
    ("a library", "a framework"),
    ("an array", "a linked list"),
    ("latency", "bandwidth"),
    ("a democracy", "a republic"),
    ("a simile", "a metaphor"),
    ("a frog", "a toad"),
    ("a hurricane", "a tornado"),
    ("AC", "DC current"),
    ("static typing", "dynamic typing"),
    ("a microphone", "a speaker"),
    ("an LED", "an incandescent bulb"),
    ("SSD", "HDD storage"),
    ("a boat", "a ship"),
    ("a mountain", "a hill"),
    ("a sprint", "a marathon"),
    ("jam", "jelly"),
    ("a violin", "a viola"),
    ("a psychologist", "a psychiatrist"),
    ("empathy", "sympathy"),
    ("a recession", "a depression"),
    ("renting", "buying a home"),
    ("a debit card", "a credit card"),
    ("a for loop", "a while loop"),
    ("a class", "an object"),
    ("SQL", "NoSQL databases"),
    ("machine learning", "traditional programming"),
    ("a monitor", "a television"),
    ("a planet", "a star"),
    ("fission", "fusion"),
    ("a cold", "the flu"),
)
PAIR_FRAMES = (
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b} in a short table.",
    "{A} or {b}: which is better for a beginner, and why?",
    "Explain how {a} and {b} are alike and how they differ.",
)
ACTIVITIES = tuple(t for t in ADVICE_TOPICS if t != "debugging a program") + (
    "moving to a new city",
    "training a puppy",
    "making friends as an adult",
    "learning to draw",
    "taking better photos with a phone",
    "baking bread at home",
    "hosting a dinner party",
    "negotiating a salary",
    "managing a small budget for a club",
    "writing a novel",
    "starting a podcast",
    "learning to swim as an adult",
    "reducing screen time",
    "drinking more water",
    "preparing for a long flight",
    "camping for the first time",
    "painting a room",
    "fixing a leaking tap",
    "choosing a laptop",
    "learning touch typing",
    "keeping a journal",
    "speaking up in meetings",
    "mentoring a junior colleague",
    "onboarding a new employee",
    "planning a birthday party",
    "packing for a beach holiday",
    "learning chess",
    "cutting down on sugar",
    "commuting by bike",
    "decluttering a wardrobe",
    "setting up a home network",
    "protecting privacy online",
    "writing a résumé",
    "learning statistics",
    "teaching a child to read",
    "caring for an elderly parent",
    "applying to university",
    "preparing a vegetarian meal",
    "running a book club",
    "getting started with open source",
    "writing clean SQL queries",
    "learning Linux commands",
    "reviewing a colleague's report",
    "dealing with a difficult customer",
    "organising digital photos",
    "learning to cook rice perfectly",
    "improving handwriting",
)
ACTIVITY_FRAMES = (
    "Give me {n} tips for {x}.",
    "What should I know before {x}?",
    "What are common mistakes people make when {x}?",
    "Make a step-by-step plan for {x}.",
    "How can I get better at {x}?",
    "Write a short checklist for {x}.",
    "How should a beginner approach {x}?",
    "I am nervous about {x}. Any advice?",
    "What tools or resources help with {x}?",
    "Suggest a four-week plan for {x}.",
)
FORMS = (
    "a short poem",
    "a haiku",
    "a limerick",
    "the opening paragraph of a story",
    "a diary entry",
    "a two-sentence product description",
    "a short speech",
    "a dialogue between two friends",
    "a short fable with a moral",
    "a motivational note",
    "a short news report",
    "a recipe card",
    "a riddle with its answer",
    "a song chorus",
)
THEMES = (
    "a rainy Monday",
    "a lost umbrella",
    "the first day of spring",
    "a lighthouse keeper",
    "a city at night",
    "a friendly dragon",
    "an old bookshop",
    "a robot learning to cook",
    "a cup of tea",
    "the last day of school",
    "a mountain hike",
    "a broken clock",
    "a talking cat",
    "a message in a bottle",
    "the smell of bread",
    "a snowy village",
    "a new bicycle",
    "a garden in summer",
    "a trip to the moon",
    "an unexpected letter",
    "a busy train station",
    "a quiet library",
    "a lucky coin",
    "an autumn forest",
)
RECIPIENTS = (
    "my landlord",
    "a teacher",
    "my manager",
    "a customer",
    "a new neighbour",
    "a friend",
    "the support team of an online shop",
    "a hiring manager",
    "my team",
    "a supplier",
)
MATTERS = (
    "a late payment",
    "a broken heater",
    "taking a day off",
    "a delayed delivery",
    "a change in the project deadline",
    "thanking them for their help",
    "a meeting next week",
    "a refund request",
    "a schedule conflict",
    "a new office policy",
    "a welcome lunch",
)
TONES = ("short, polite", "friendly", "formal", "warm", "concise and direct")


def _chat_v2(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        return rng.choice(SUBJECT_FRAMES).format(s=rng.choice(SUBJECTS))
    if r < 0.5:
        a, b = rng.choice(PAIRS)
        return rng.choice(PAIR_FRAMES).format(a=a, b=b, A=a[0].upper() + a[1:])
    if r < 0.75:
        n = rng.choice(("three", "four", "five"))
        return rng.choice(ACTIVITY_FRAMES).format(n=n, x=rng.choice(ACTIVITIES))
    if r < 0.9:
        return f"Write {rng.choice(FORMS)} about {rng.choice(THEMES)}."
    tone, who, what = rng.choice(TONES), rng.choice(RECIPIENTS), rng.choice(MATTERS)
    return f"Write a {tone} email to {who} about {what}."


LANGUAGES = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby")
MORE_TASKS = (
    "counts the words in a sentence",
    "returns the unique elements of a list in order",
    "computes the least common multiple of two integers",
    "converts an integer to binary",
    "checks whether a year is a leap year",
    "returns the longest common prefix of strings",
    "finds the missing number in a list of 1..n",
    "computes the mean and standard deviation",
    "capitalises every other letter of a string",
    "merges two dictionaries",
    "finds all pairs in a list that sum to a target",
    "computes the nth triangular number",
    "converts a string to title case",
    "checks whether a string is a valid IPv4 address",
    "returns the digits of a number in reverse order",
    "computes simple interest",
    "finds the first non-repeating character in a string",
    "implements selection sort",
    "implements a stack with a fixed capacity",
    "removes vowels from a string",
    "returns the maximum depth of a nested list",
    "counts the lines in a text",
    "converts kilometres to miles",
    "generates a multiplication table",
    "checks whether a number is a perfect square",
    "computes the Hamming distance",
    "shuffles a list in place",
    "returns every k-th element of a list",
    "clamps a number to a range",
    "computes a moving average over a window",
    "parses a query string into a dictionary",
    "formats a number with thousands separators",
    "checks whether a matrix is symmetric",
    "computes the area of a polygon from its points",
    "returns the mode of a list",
    "finds the longest increasing run in a list",
    "converts snake_case to camelCase",
    "counts the set bits of an integer",
    "implements run-length encoding",
    "decodes a run-length encoded string",
    "validates a sudoku row",
    "computes the distance between two points",
    "finds duplicates in a list",
    "sorts a list of dictionaries by a key",
    "returns the k most frequent words",
    "implements a simple LRU cache",
    "computes the Collatz sequence of a number",
    "builds a histogram of integers",
)
ENTITIES = (
    ("BankAccount", "deposit, withdraw and show the balance"),
    ("Rectangle", "compute area and perimeter and compare sizes"),
    ("TodoList", "add, complete and list tasks"),
    ("Inventory", "add items, remove items and report stock"),
    ("Temperature", "convert between Celsius, Fahrenheit and Kelvin"),
    ("Library", "add books, lend books and return books"),
    ("Counter", "increment, decrement and reset"),
    ("Queue", "enqueue, dequeue and check the size"),
    ("Student", "add grades and compute the average"),
    ("ShoppingCart", "add products, remove products and compute the total"),
    ("Timer", "start, stop and report elapsed seconds"),
    ("Vector2D", "add, subtract and compute the length"),
    ("Playlist", "add songs, skip songs and shuffle"),
    ("Matrix", "add, multiply and transpose"),
    ("Thermostat", "set a target and decide whether to heat"),
)
SQL_TASKS = (
    ("employees(id, name, department, salary)", "the average salary per department"),
    ("orders(id, customer_id, amount, created_at)", "the number of orders per month"),
    ("products(id, name, price, stock)", "products that are out of stock"),
    ("students(id, name, grade)", "the three students with the best grades"),
    ("books(id, title, author, year)", "how many books each author wrote"),
    ("visits(id, page, user_id, day)", "the most visited page on each day"),
    ("flights(id, origin, destination, minutes)", "the longest flight from each origin"),
    ("payments(id, user_id, amount, status)", "users whose failed payments exceed $100"),
)
SHELL_TASKS = (
    "finds all files larger than 10 MB in a directory",
    "renames every .txt file to .md",
    "shows the ten largest directories",
    "counts unique IP addresses in a log file",
    "replaces a word in every file of a folder",
    "prints the disk usage of the home folder",
    "lists files modified in the last day",
    "compresses a folder into a tar.gz archive",
    "prints the 5 most common words in a text file",
    "checks whether a website is reachable",
)


def _snippet(rng: random.Random) -> str:
    a, b, c = rng.sample(range(1, 10), 3)
    name = rng.choice(("items", "nums", "vals", "data"))
    kinds = (
        f"{name} = [{a}, {b}, {c}]; print({name}[::-1], {name}[1:])",
        f"d = {{'a': {a}, 'b': {b}}}; d['c'] = d.get('c', 0) + {c}; print(d)",
        f"s = 'hello world'; print(s.split()[{a % 2}].upper() * {b % 3 + 1})",
        f"print([x * {a} for x in range({c}) if x % 2 == {b % 2}])",
        f"x = {a}; x += {b}; x //= {c}; print(x, {a} % {c})",
        f"t = ({a}, {b}); a, b = t; a, b = b, a; print(a - b)",
        f"print(sorted([{c}, {a}, {b}], reverse={rng.choice(('True', 'False'))}))",
        f"print(len(set('{'ab' * a}{'c' * b}')))",
        f"def f(n=[]): n.append({a}); return n\nf(); print(f())",
        f"print(sum(range({a}, {a + b})), max([{a}, {b}, {c}], key=lambda v: -v))",
    )
    return rng.choice(kinds)


def _code_v2(rng: random.Random, funcs: list[tuple[str, str, str, str]]) -> str:
    r = rng.random()
    if r < 0.3:
        lang, task = rng.choice(LANGUAGES[:4] + ("Python",) * 4), rng.choice(MORE_TASKS)
        frame = rng.choice(
            (
                "Write a {lang} function that {task}.",
                "Write a {lang} function that {task}, with comments.",
                "Show a {lang} function that {task} and one example call.",
                "How would you write a {lang} function that {task}? Explain briefly.",
            )
        )
        return frame.format(lang=lang, task=task)
    if r < 0.4:
        lang, task = rng.choice(LANGUAGES), rng.choice(MORE_TASKS + CODE_TASKS)
        return f"Write a {lang} function that {task}."
    if r < 0.5:
        cls, ops = rng.choice(ENTITIES)
        lang = rng.choice(("Python", "Python", "Java", "JavaScript"))
        return f"Write a {lang} class `{cls}` that can {ops}. Add a short usage example."
    if r < 0.6:
        return f"What does this Python code print, and why?\n```python\n{_snippet(rng)}\n```"
    if r < 0.67:
        table, want = rng.choice(SQL_TASKS)
        return f"Write an SQL query over the table {table} that returns {want}."
    if r < 0.72:
        return f"Write a shell command that {rng.choice(SHELL_TASKS)}, and explain it."
    if r < 0.8:
        return rng.choice(CODE_EXTRA).format(task=rng.choice(MORE_TASKS))
    qual, name, sig, doc = rng.choice(funcs)
    doc_short = doc.rstrip(".!?")
    doc = doc[0].lower() + doc[1:] if doc[:2].isalpha() and doc[1].islower() else doc
    return rng.choice(CODE_TEMPLATES).format(
        name=name, sig=sig, doc=doc, doc_short=doc_short, qual=qual
    )


def _math_v2(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return _word_problem(rng)
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    r = rng.choice((2, 3, 4, 5, 6, 8, 10, 12))
    kinds = (
        f"A bag has {a} red and {b} blue marbles. What is the probability of drawing a red one?",
        f"A coin is flipped {c % 5 + 2} times. What is the probability of getting all heads?",
        f"What is the area of a circle with radius {r} cm? Use pi = 3.14.",
        f"A triangle has a base of {a} cm and a height of {b} cm. What is its area?",
        f"A box is {a} cm by {b} cm by {c} cm. What is its volume in liters?",
        f"Convert {a * 3} miles to kilometres (1 mile = 1.609 km).",
        f"{n} runs {c} km in {a + 20} minutes. What is the pace in minutes per km?",
        f"A town of {a * 1000} people grows by {c}% a year. What is it after two years?",
        f"Split ${a * 10} between {n} and {m} in the ratio {c}:{r}.",
        f"What is the simple interest on ${a * 100} at {c}% per year for {r} years?",
        f"What are the next two numbers: {a}, {a + c}, {a + 2 * c}, {a + 3 * c}, ...?",
        f"What are the next two numbers: {c}, {c * 2}, {c * 4}, {c * 8}, ...?",
        f"Solve the system x + y = {a + b}, x - y = {a - b}. Show your steps.",
        f"Find the greatest common divisor and least common multiple of {a * c} and {b * c}.",
        f"A clock shows 3:{10 + c:02d}. What time will it be in {a * 7} minutes?",
        f"Mix {a} liters of {c}% juice with {b} liters of pure water. What is the juice share?",
        f"Find the mean, median and mode of {sorted([a, b, c, a, b + c, c])}.",
        f"In how many ways can {c % 5 + 3} books be arranged on a shelf?",
        f"{n} paints a fence in {c} hours and {m} in {r} hours. How long together?",
        f"What is {a}/{b} + {c}/{r}? Give the answer as a simplified fraction.",
        f"A phone costs ${a * 10} after a {r * 5}% discount. What was the original price?",
        f"What is the square root of {(c + 3) ** 2}, and how can you check it?",
        f"A map has a scale of 1:{r * 10000}. How far is {c} cm on the map in reality?",
        f"{n} scored {a}, {b} and {c + 50} on three tests. What score on a fourth test "
        "gives an average of 60?",
        f"A car travels at {a + 40} km/h for {c} hours and then {b + 30} km/h for {r} hours. "
        "How far does it go in total?",
        f"Write {a * 37} in Roman numerals and explain the steps.",
        f"What is {c} to the power of {r % 4 + 2}? Show the multiplication.",
        f"Is {a * b} divisible by {c}? Explain using the remainder.",
    )
    return rng.choice(kinds)


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:200]


def stdlib_functions() -> list[tuple[str, str, str, str]]:
    """(qualified name, name, signature, first docstring sentence) of public stdlib callables."""
    out = []
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        with warnings.catch_warnings():  # typing's deprecated aliases warn on access
            warnings.simplefilter("ignore", DeprecationWarning)
            out.extend(_documented(mod, mod_name))
    return out


def _documented(mod, mod_name: str) -> list[tuple[str, str, str, str]]:
    out = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or not callable(obj) or not getattr(obj, "__doc__", None):
            continue
        owner = (getattr(obj, "__module__", None) or "").lstrip("_").split(".")[0]
        if owner != mod_name.split(".")[0]:
            continue
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            sig = "(...)"
        doc = _first_sentence(obj.__doc__)
        if len(doc) > 10 and len(sig) < 80:
            out.append((f"{mod_name}.{name}", name, sig, doc))
    return out


def _shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def bench_shingles(path: Path = BENCH_PROMPTS) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for item in json.loads(path.read_text()):
        out |= _shingles(item["prompt"])
    return out


def _chat_v1(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return rng.choice(TOPIC_TEMPLATES).format(topic=rng.choice(TOPICS))
    if r < 0.9:
        return rng.choice(ADVICE).format(x=rng.choice(ADVICE_TOPICS))
    return rng.choice(WRITE)


def build_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` prompts {id, category, prompt}, the sources interleaved, none near a bench prompt.

    Ids carry the pool's version ("coding-v2-00042"): replies stored for an
    older pool keep their ids, so a data rerun never confuses the two.
    """
    rng = random.Random(seed)
    funcs = stdlib_functions()
    held_out = bench_shingles()

    def chat() -> str:
        return _chat_v1(rng) if rng.random() < 0.1 else _chat_v2(rng)

    makers = (
        ("coding", lambda: _code_v2(rng, funcs)),
        ("math", lambda: _math_v2(rng)),
        ("chat", chat),
    )
    prompts, seen = [], set()
    while len(prompts) < n:
        category, make = makers[len(prompts) % 3]
        for _ in range(50):
            text = make()
            if text not in seen and not (_shingles(text) & held_out):
                break
        seen.add(text)
        prompts.append(
            {"id": f"{category}-v2-{len(prompts):05d}", "category": category, "prompt": text}
        )
    return prompts
