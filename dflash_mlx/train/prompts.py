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


def build_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` prompts {id, category, prompt}, the sources interleaved, none near a bench prompt."""
    rng = random.Random(seed)
    funcs = stdlib_functions()
    held_out = bench_shingles()

    def code() -> str:
        if rng.random() < 0.35:
            return rng.choice(CODE_EXTRA).format(task=rng.choice(CODE_TASKS))
        qual, name, sig, doc = rng.choice(funcs)
        doc_short = doc.rstrip(".!?")
        doc = doc[0].lower() + doc[1:] if doc[:2].isalpha() and doc[1].islower() else doc
        return rng.choice(CODE_TEMPLATES).format(
            name=name, sig=sig, doc=doc, doc_short=doc_short, qual=qual
        )

    def chat() -> str:
        r = rng.random()
        if r < 0.55:
            return rng.choice(TOPIC_TEMPLATES).format(topic=rng.choice(TOPICS))
        if r < 0.9:
            return rng.choice(ADVICE).format(x=rng.choice(ADVICE_TOPICS))
        return rng.choice(WRITE)

    makers = (("coding", code), ("math", lambda: _word_problem(rng)), ("chat", chat))
    prompts, seen = [], set()
    while len(prompts) < n:
        category, make = makers[len(prompts) % 3]
        for _ in range(50):
            text = make()
            if text not in seen and not (_shingles(text) & held_out):
                break
        seen.add(text)
        prompts.append(
            {"id": f"{category}-{len(prompts):05d}", "category": category, "prompt": text}
        )
    return prompts
