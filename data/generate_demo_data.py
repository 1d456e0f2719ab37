"""Write the demo data that `sft/train.py` trains on when given no arguments.

The records are written by this project (no third-party text), regular enough that a tiny model's loss
falls within a minute: arithmetic, word reversal, capitals, counting and small conversations.
Run `python data/generate_demo_data.py` to regenerate; the output is deterministic.
"""

import json
import random
import uuid
from pathlib import Path

# the real files, shipped in the wheel; data/*.json(l) beside this script are links to them
HERE = Path(__file__).resolve().parent.parent / "sft" / "data" / "demo"
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Egypt": "Cairo", "Peru": "Lima", "Norway": "Oslo", "Chile": "Santiago",
    "India": "New Delhi", "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Iran": "Tehran",
}
WORDS = ["apple", "river", "planet", "garden", "silver", "window", "rocket", "pencil", "forest", "bridge",
         "candle", "dragon", "island", "button", "mirror", "travel", "winter", "yellow", "orange", "guitar"]
NO_INPUT = ["", "", "", "No input", "<noinput>", "N/A"]  # real Alpaca data uses such placeholders


def alpaca_records(rng: random.Random) -> list[dict]:
    records = []
    for _ in range(120):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        records.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}",
                        "output": f"{a} + {b} = {a + b}."})
    for word in WORDS * 3:
        records.append({"instruction": f"Reverse the letters of the word \"{word}\".", "input": rng.choice(NO_INPUT),
                        "output": f"The reversed word is \"{word[::-1]}\"."})
    for country, city in list(CAPITALS.items()) * 4:
        records.append({"instruction": f"What is the capital of {country}?", "input": rng.choice(NO_INPUT),
                        "output": f"The capital of {country} is {city}."})
    for _ in range(60):
        word = rng.choice(WORDS)
        records.append({"instruction": "Count the letters in the word.", "input": word,
                        "output": f"The word \"{word}\" has {len(word)} letters."})
    rng.shuffle(records)
    return records


def oasst_messages(rng: random.Random) -> list[dict]:
    """Flat OASST1-style message list: a prompt, ranked assistant replies, and follow-ups."""
    ids = iter(uuid.UUID(int=rng.getrandbits(128)) for _ in range(10_000))
    messages = []

    def add(parent, role, text, rank=None, tree=None):
        mid = str(next(ids))
        messages.append({"message_id": mid, "parent_id": parent, "role": role, "text": text, "lang": "en",
                         "rank": rank, "deleted": False, "review_result": True,
                         "message_tree_id": tree or mid})
        return mid

    for country, city in CAPITALS.items():
        root = add(None, "prompter", f"Tell me about {country}.")
        best = add(root, "assistant", f"{country} is a country whose capital is {city}.", rank=0, tree=root)
        add(root, "assistant", f"I do not know much about {country}.", rank=1, tree=root)
        follow = add(best, "prompter", f"What is the capital of {country} again?", tree=root)
        add(follow, "assistant", f"The capital of {country} is {city}.", rank=0, tree=root)
    for word in WORDS:
        root = add(None, "prompter", f"Spell {word} backwards, please.")
        add(root, "assistant", f"Backwards, {word} is {word[::-1]}.", rank=0, tree=root)
    return messages


def main() -> None:
    rng = random.Random(0)
    (HERE / "alpaca_demo.json").write_text(json.dumps(alpaca_records(rng), indent=2, ensure_ascii=False) + "\n")
    with open(HERE / "oasst_demo.jsonl", "w") as f:
        for message in oasst_messages(rng):
            f.write(json.dumps(message, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
