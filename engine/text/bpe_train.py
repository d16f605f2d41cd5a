"""A test vocabulary in Kimi's tokenizer format, learned deterministically by BPE training
on an embedded text (`TRAINING_TEXT`), so a synthesised checkpoint is a complete, servable
model. The text supports ~50k ranks; larger vocabularies (the real 163,584) are grown past
that with generated word merges (`grow_ranks`). Not Kimi's vocabulary; the demo steering
(engine/decode/steer.py) reuses the text's words."""

from __future__ import annotations

import base64
import heapq
import json
import random
import re
from pathlib import Path

from engine.text.tokenizer import bpe_parts, special_token_names, split_pieces

MAX_RANKS = 1 << 18  # the real vocabulary has 163,584 ranks


def _training_counts(extended: bool) -> dict[bytes, int]:
    """Pre-token counts: the text (weighted so its merges come first) plus fillers (word
    variants, numbers; letter trigrams when `extended`) so larger vocabularies still have
    merges to learn."""
    counts: dict[bytes, int] = {}
    pieces = split_pieces(TRAINING_TEXT)
    for piece in pieces:
        counts[piece.encode()] = counts.get(piece.encode(), 0) + 1000
    words = sorted({p.strip() for p in pieces if p.strip().isascii() and p.strip().isalpha()})
    fillers = []
    for w in words:
        fillers += [w, " " + w, w.capitalize(), " " + w.capitalize(), " " + w.upper()]
    fillers += [str(i) for i in range(1000)] + [f"{i:03d}" for i in range(100)]
    for f in fillers:
        counts.setdefault(f.encode(), 10)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            for form in (f" {a}{b}", f"{a}{b}", f" {a.upper()}{b}"):
                counts.setdefault(form.encode(), 2)
    for a in letters if extended else "":
        for b in letters:
            for c in letters:
                for form in (f" {a}{b}{c}", f"{a}{b}{c}", f" {a.upper()}{b}{c}"):
                    counts.setdefault(form.encode(), 1)
    return counts


def learn_ranks(n_ranks: int) -> dict[bytes, int]:
    """256 single bytes then `n_ranks - 256` merges, by BPE training (deterministic:
    the most frequent pair wins, ties go to the smaller byte string pair). The letter
    trigram fillers (slow to train on) are used only when the vocabulary needs them, and
    past what the text supports the vocabulary is grown (`grow_ranks`)."""
    if not 256 <= n_ranks <= MAX_RANKS:
        raise ValueError(f"a test vocabulary has 256 to {MAX_RANKS} ranks, not {n_ranks}")
    ranks = _learn(n_ranks, extended=False)
    if len(ranks) < n_ranks:
        ranks = _learn(n_ranks, extended=True)
    return grow_ranks(ranks, n_ranks)


_HEAD = re.compile(rb" ?[A-Z]*[a-z]*")  # with a lowercase tail, still one pre-split piece
_TAIL = re.compile(rb"[a-z]+")
_MAX_GROWN_BYTES = 16


def grow_ranks(ranks: dict[bytes, int], n_ranks: int) -> dict[bytes, int]:
    """`ranks` extended to `n_ranks` by generated merges, deterministically (seeded).

    Each new token is a word-like token + a lowercase one (so text can produce it: it stays
    one piece of the split regex), kept only if it has exactly one split into two existing
    tokens and tiktoken's merge loop over the lower ranks ends at that split: then
    `derive_merges` finds its merge and HF's merge-list BPE encodes as tiktoken does."""
    ranks = dict(ranks)
    heads = [t for t in sorted(ranks, key=ranks.__getitem__) if _HEAD.fullmatch(t)]
    tails = [t for t in heads if _TAIL.fullmatch(t)]
    rng = random.Random(0)
    while len(ranks) < n_ranks:
        a, b = heads[rng.randrange(len(heads))], tails[rng.randrange(len(tails))]
        token = a + b
        if len(token) > _MAX_GROWN_BYTES or token in ranks:
            continue
        splits = sum(token[:k] in ranks and token[k:] in ranks for k in range(1, len(token)))
        if splits == 1 and bpe_parts(ranks, token, len(ranks)) == [a, b]:
            ranks[token] = len(ranks)
            heads.append(token)
    return ranks


def _learn(n_ranks: int, extended: bool) -> dict[bytes, int]:
    """Up to `n_ranks` ranks: fewer when the text has no pair left to merge."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [([bytes([b]) for b in w], c) for w, c in sorted(_training_counts(extended).items())]
    pair_count: dict[tuple[bytes, bytes], int] = {}
    where: dict[tuple[bytes, bytes], set[int]] = {}

    def add_pairs(wi: int, sign: int) -> None:
        syms, c = words[wi]
        for pair in zip(syms, syms[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + sign * c
            if sign > 0:
                where.setdefault(pair, set()).add(wi)
                heapq.heappush(heap, (-pair_count[pair], pair))

    for wi, (syms, c) in enumerate(words):
        for pair in zip(syms, syms[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + c
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, pair) for pair, c in pair_count.items()]
    heapq.heapify(heap)
    while len(ranks) < n_ranks:
        while heap:
            neg, pair = heapq.heappop(heap)
            if pair_count.get(pair, 0) == -neg and -neg > 0 and pair[0] + pair[1] not in ranks:
                break
        else:
            return ranks
        merged = pair[0] + pair[1]
        ranks[merged] = len(ranks)
        for wi in sorted(where.pop(pair, ())):
            syms, c = words[wi]
            if not any(a == pair[0] and b == pair[1] for a, b in zip(syms, syms[1:])):
                continue
            add_pairs(wi, -1)
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == pair[0] and syms[i + 1] == pair[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[wi] = (out, c)
            add_pairs(wi, +1)
        pair_count.pop(pair, None)
    return ranks


def write_test_tokenizer(out_dir: str | Path, n_ranks: int) -> None:
    """Write `tiktoken.model` (exactly `n_ranks` ranks) and `tokenizer_config.json`
    (256 added tokens at ids n_ranks..n_ranks+255, in Kimi's order)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = learn_ranks(n_ranks)
    lines = [
        f"{base64.b64encode(tok).decode()} {rank}"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="ascii")
    names = special_token_names(n_ranks)
    config = {
        "added_tokens_decoder": {
            str(i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, content in names.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": None,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "k3_test_vocabulary": "learned from engine/text/bpe_train.py's embedded text "
        "(grown by generated merges past what it supports); not Kimi's",
    }
    text = json.dumps(config, indent=2) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


TRAINING_TEXT = """\
The lighthouse keeper woke before the sun, as she had done every morning for thirty years.
She climbed the one hundred and twelve steps of the tower, wiped the salt from the glass,
and wrote three lines in the log: the wind, the sea, and the ships she had seen. It's a small
life, people said, but she didn't think so. From the top of the tower she could see the whole
coast, the fishing boats going out, the gulls following them, and the town waking up below.

When the storm came in the autumn, it came fast. The sky turned from grey to black in less
than an hour, and the waves grew so tall that they broke over the rocks and ran up the path
to her door. She lit the lamp early. She knew that somewhere out there a boat was trying to
find the harbour, and that the light was the only thing that would tell them where the rocks
were. "We'll be fine," she said to the cat, who did not believe her. They've seen worse.

A computer is a machine that follows instructions. The instructions are called a program,
and the person who writes them is called a programmer. Most programs are written in a
language that people can read, such as Python, and then turned into a form that the machine
can run. A good program is simple, clear and correct; a great program is also fast. When a
program does not do what you expected, you have found a bug, and the work of finding out why
is called debugging. It is often the most interesting part of the job.

Large language models are programs that predict the next word in a text. They are trained
on a great deal of writing, and they learn which words tend to follow which. To answer a
question, the model reads the question, thinks about it, and then writes an answer one token
at a time. A token is a piece of a word: a whole word, part of a word, a number or a sign.
The model that runs on your own machine must fit in its memory, or stream its weights from
the disk while it works. That is slower, but it means that you can run a very large model on
a small computer, if you are patient. Each token takes time; the answer arrives word by word.

Here is a simple question and its answer. What is the capital of France? The capital of
France is Paris. What is two plus two? Two plus two is four. How many days are there in a
week? There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday
and Sunday. Which is larger, the sun or the moon? The sun is much larger than the moon, but
it is also much farther away, so they look about the same size in the sky.

In the kitchen, the bread was rising. I'm going to bake it at two hundred degrees for forty
minutes, my grandmother said, and you're going to wash the dishes while we wait. I'd rather
read my book, I told her. You'll read it later, she said, and she was right, as she always
was. The smell of the bread filled the house, and the rain on the window made the room feel
warm and safe. We ate the first slice with butter and honey, standing at the table.

Numbers: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 24, 32, 42, 64, 100, 128, 256, 365,
512, 1000, 1024, 2048, 4096, 2026, 3.14, 2.78, 1.56, 93, 896, 16, 12:30, 09:15, 50%, $20.
The model has 93 layers and 896 experts; 16 experts are active for each token.

def greet(name):
    return "Hello, " + name + "!"

for i in range(10):
    print(i, greet("world"))

Some people think that the best way to learn is to read; others think that the best way is
to do. I think that you need both. You should read about a thing, then try it, then read
again, and then try again. After a while, you will find that you understand it, and that
you can explain it to someone else. That is the real test: if you can explain it simply,
you know it well. If you can't, then you should go back and learn it once more.

Dear friend, thank you for your letter. The weather here has been good, and the garden is
full of flowers. We planted tomatoes, beans and potatoes in the spring, and now we have more
than we can eat. Please come and visit us in the summer; there is always a room for you.
Write soon, and tell me about your work and your family. With love, from all of us.

The river ran north through the valley, past the old mill and the stone bridge, and on to
the lake where the children swam in July. In the evening the water was still and dark, and
the mountains stood upside down in it. An old man sat on the bench by the water every day,
feeding the ducks and talking to anyone who would listen about the year the river froze.

Yes. No. Maybe. Of course! Why not? Really? I see. Thank you. Please. Sorry. Hello!
Goodbye. OK, let me think about this step by step. First, second, third, finally. However,
therefore, because, although, unless, until, while, whether, either, neither, both, each.
The answer is: yes, because the facts support it. Let me check again... Yes, that's right.

机器学习是人工智能的一个分支。今天天气很好，我们去公园散步吧。我喜欢读书和写字。
这个模型有九十三层，每个词元只用一小部分专家。你好，世界！谢谢你的帮助。
日本語のテキストも少し入れます。こんにちは、世界。ありがとうございます。カタカナとひらがな。
한국어 문장도 조금 넣습니다. 안녕하세요, 세계. 감사합니다.
Emoji: 😀 😃 🎉 👍 🚀 ❤️ ✨ 🌍 🔥 ✅ — and symbols like © ® ™ € £ ¥ ° ± × ÷ → ← ↑ ↓ • … « » “ ” ‘ ’.
Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Kraków, Ελληνικά, Русский язык.
"""
