"""Write the chat fine-tuning example that configs/chat-sft.yaml runs as shipped, offline:
`python -m tools.make_chat_example [OUT_DIR]` (default examples/chat) ->

- `word_rules.jsonl`: conversations in OpenAI's fine-tuning format whose answers follow a rule
  over words drawn per row: the user lists one word of each kind (an animal, a colour, a food, a
  tool) in a random order and asks for the word of one kind; the assistant answers that word
  alone. Some rows open with a system message, some ask a second question about the same list.
- `tiny-qwen2/`: a random-weight Qwen2 folder as tools/make_tiny_pretrained.py writes them
  (ChatML template, tied head), its byte-level BPE tokenizer trained on the conversations, so that
  a word is a token or two and a small model learns the rule in a few hundred steps.

Both are deterministic: the same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator

WORDS = {
    "animal": "cat dog horse mouse tiger eagle shark otter camel zebra goose frog",
    "colour": "red blue green yellow purple orange black white pink brown grey violet",
    "food": "bread rice apple cheese soup pasta honey olive melon bean cake pear",
    "tool": "hammer saw drill wrench ladder chisel rake shovel pliers axe file brush",
}
KINDS: dict[str, list[str]] = {kind: words.split() for kind, words in WORDS.items()}
SYSTEM = "Answer with one word."
CONVERSATIONS = 3000
TINY_QWEN2 = {
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # Wider than transformers' 0.02 start: token identities stand apart from the first step,
    # so this small a model learns the rule in a few hundred steps.
    "initializer_range": 0.2,
}


def question(kind: str, words: list[str]) -> str:
    return f"Which word is a {kind}: {' '.join(words)}?"


def answer(kind: str, words: list[str]) -> str:
    """The rule: the listed word of that kind."""
    return next(w for w in words if w in KINDS[kind])


def drawn(rng: random.Random) -> tuple[str, list[str]]:
    words = [rng.choice(KINDS[kind]) for kind in KINDS]
    rng.shuffle(words)
    return rng.choice(list(KINDS)), words


def conversations(count: int, seed: int = 0) -> Iterator[list[dict[str, str]]]:
    rng = random.Random(seed)
    for _ in range(count):
        kind, words = drawn(rng)
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.2 else []
        messages += [
            {"role": "user", "content": question(kind, words)},
            {"role": "assistant", "content": answer(kind, words)},
        ]
        if rng.random() < 0.3:
            other = rng.choice([k for k in KINDS if k != kind])
            messages += [
                {"role": "user", "content": f"And which is a {other}?"},
                {"role": "assistant", "content": answer(other, words)},
            ]
        yield messages


def write_conversations(path: str, count: int = CONVERSATIONS, seed: int = 0) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for messages in conversations(count, seed):
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def make_folder(folder: str, corpus: str) -> str:
    """The tiny Qwen2 folder, its tokenizer trained on `corpus` (the JSON Lines)."""
    from tools.make_tiny_pretrained import make_decoder

    with open(corpus, encoding="utf-8") as f:
        texts = [m["content"] for line in f for m in json.loads(line)["messages"]]
    return make_decoder(folder, "qwen2", sizes=TINY_QWEN2, vocab=512, texts=texts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="examples/chat")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    corpus = write_conversations(os.path.join(args.out, "word_rules.jsonl"))
    print(make_folder(os.path.join(args.out, "tiny-qwen2"), corpus))


if __name__ == "__main__":
    main()
