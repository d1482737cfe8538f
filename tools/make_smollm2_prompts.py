#!/usr/bin/env python3
"""Writes the prompt set of the SmolLM2 distillation example (docs/examples/smollm2.md):
examples/smollm2/{train,heldout}.jsonl, short single-turn chat instructions (factual questions,
arithmetic, rewriting, lists, definitions, ...) built from fixed templates and word lists.

Deterministic: the same files on every run (random.Random(SEED), no other input). Each line is
{"messages": [{"role": "user", "content": ...}]} (prompt-only: on-policy training and the
teacher-relative evaluations need no reference answer); the chat template renders it with the
model's default system prompt. Duplicates are removed before the split, so no held-out prompt
appears in the training file.

Usage: python3 tools/make_smollm2_prompts.py [--out examples/smollm2] [--train 400 --heldout 60]
"""
import argparse
import json
import os
import random

SEED = 20261130

COUNTRIES = [
    "France", "Germany", "Italy", "Spain", "Portugal", "Japan", "China", "India", "Brazil",
    "Canada", "Mexico", "Egypt", "Kenya", "Australia", "Russia", "Norway", "Sweden", "Finland",
    "Greece", "Turkey", "Argentina", "Peru", "Chile", "Poland", "Austria", "Ireland", "Belgium",
    "the Netherlands", "Switzerland", "Denmark", "South Korea", "Thailand", "Vietnam", "Indonesia",
    "Nigeria", "Morocco", "Cuba", "Hungary", "Iceland", "New Zealand",
]
ANIMALS = ["cat", "dog", "horse", "elephant", "dolphin", "eagle", "penguin", "lion", "frog",
           "bee", "whale", "owl", "shark", "rabbit", "cow", "snake", "spider", "camel"]
CATEGORIES = ["fruits", "vegetables", "colors", "animals that live in the ocean", "musical instruments",
              "planets", "sports", "countries in Europe", "kitchen tools", "types of trees",
              "programming languages", "birds", "flowers", "things you can find in a classroom",
              "breakfast foods", "board games", "metals", "weather conditions", "jobs", "vehicles"]
NOUNS = ["a volcano", "a computer", "photosynthesis", "gravity", "a library", "an atom",
         "democracy", "a rainbow", "a battery", "a glacier", "an island", "a poem", "a bridge",
         "the internet", "a calendar", "an engine", "a vaccine", "a desert", "an orchestra",
         "a telescope", "a river", "a museum", "a recipe", "an election"]
OPPOSITES = ["hot", "big", "fast", "happy", "light", "early", "open", "strong", "rich", "young",
             "loud", "wet", "high", "easy", "full", "soft", "clean", "empty", "inside", "begin"]
SYNONYMS = ["happy", "quick", "smart", "big", "tired", "angry", "beautiful", "small", "funny",
            "brave", "calm", "cold", "difficult", "strange", "important"]
SENTENCES = [
    "The cat sleeps on the warm window sill.",
    "We walk to the market every Saturday.",
    "She writes a letter to her grandmother.",
    "The children play football in the park.",
    "He drinks a cup of coffee before work.",
    "The train leaves the station at noon.",
    "They build a small house near the lake.",
    "I read a book about the history of Rome.",
    "The teacher explains the lesson slowly.",
    "My brother fixes old bicycles.",
    "The wind blows the leaves across the road.",
    "We cook pasta for dinner on Fridays.",
    "The bird sings in the morning.",
    "She paints the fence blue.",
    "The students finish their homework early.",
]
REWRITES = [
    "Rewrite this sentence in the past tense: {s}",
    "Rewrite this sentence in the future tense: {s}",
    "Make this sentence more formal: {s}",
    "Rewrite this sentence as a question: {s}",
    "Rewrite this sentence in the negative: {s}",
    "Shorten this sentence: {s}",
]
WORDS = ["apple", "table", "river", "garden", "window", "pencil", "orange", "planet", "silver",
         "forest", "music", "yellow", "rocket", "candle", "spring", "bottle", "island", "winter"]
TOPICS = ["the ocean", "autumn", "a rainy day", "the moon", "friendship", "mountains", "coffee",
          "a city at night", "the first day of school", "trains", "summer holidays", "robots",
          "the desert", "a birthday party", "snow"]
FACTS = [
    "Who wrote Romeo and Juliet?", "Who painted the Mona Lisa?", "How many days are in a week?",
    "How many continents are there?", "What is the largest planet in our solar system?",
    "What is the boiling point of water in Celsius?", "What gas do plants absorb from the air?",
    "What is the chemical symbol for gold?", "How many legs does a spider have?",
    "What is the tallest mountain in the world?", "What is the largest ocean on Earth?",
    "Which planet is known as the Red Planet?", "What is the freezing point of water in Fahrenheit?",
    "How many hours are in a day?", "What is the closest star to Earth?",
    "Who was the first person to walk on the Moon?", "What language is spoken in Brazil?",
    "How many sides does a hexagon have?", "What is the square root of 81?",
    "What is the longest river in Africa?", "What do bees make?", "What is H2O?",
    "How many minutes are in an hour?", "What color do you get by mixing blue and yellow?",
    "What is the main ingredient of guacamole?", "Which animal is known as the king of the jungle?",
    "How many strings does a standard guitar have?", "What is the currency of Japan?",
    "What is the hardest natural substance?", "In which year did World War II end?",
]


def build_prompts(rng):
    p = []
    for c in COUNTRIES:
        p.append(f"What is the capital of {c}?")
        p.append(f"Name one famous food from {c}.")
    for _ in range(120):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-", "*"])
        form = rng.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.",
                           "Calculate {a} {op} {b} and give only the number."])
        p.append(form.format(a=a, b=b, op=op))
    for a in ANIMALS:
        p.append(f"How many legs does a {a} have?")
        p.append(f"Where does a {a} usually live? Answer in one sentence.")
    for c in CATEGORIES:
        p.append(f"List three {c}.")
        p.append(f"Name five {c}, separated by commas.")
    for n in NOUNS:
        p.append(f"What is {n}? Answer in one sentence.")
    for w in OPPOSITES:
        p.append(f"What is the opposite of \"{w}\"?")
    for w in SYNONYMS:
        p.append(f"Give a synonym for \"{w}\".")
    for s in SENTENCES:
        for r in rng.sample(REWRITES, 3):
            p.append(r.format(s=s))
    for w in WORDS:
        p.append(f"Spell the word \"{w}\" backwards.")
        p.append(f"How many letters are in the word \"{w}\"?")
    for t in TOPICS:
        p.append(f"Write one sentence about {t}.")
        p.append(f"Write a short title for a story about {t}.")
    p.extend(FACTS)
    seen, out = set(), []
    for q in p:
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def write_jsonl(path, prompts):
    with open(path, "w", encoding="utf-8") as f:
        for q in prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/smollm2")
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--heldout", type=int, default=60)
    args = ap.parse_args()
    rng = random.Random(SEED)
    prompts = build_prompts(rng)
    need = args.train + args.heldout
    if len(prompts) < need:
        raise SystemExit(f"only {len(prompts)} distinct prompts, {need} asked")
    rng.shuffle(prompts)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "heldout.jsonl"), prompts[:args.heldout])
    write_jsonl(os.path.join(args.out, "train.jsonl"), prompts[args.heldout:need])
    print(f"{len(prompts)} distinct prompts: {args.heldout} held out, {args.train} train "
          f"({len(prompts) - need} unused) -> {args.out}/")


if __name__ == "__main__":
    main()
