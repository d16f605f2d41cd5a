"""Kimi's tokenizer: tiktoken-format byte-level BPE ranks run by HF `tokenizers`.

Files (as shipped with the checkpoint): `tiktoken.model` (one `base64(bytes) rank` line per
BPE rank) and `tokenizer_config.json` (`added_tokens_decoder`: the 256 special tokens that
follow the ranks). Encoding: pre-split with the Kimi regex, then tiktoken-style BPE (a piece
that is itself a token is taken whole; otherwise merge the adjacent pair whose concatenation
has the lowest rank). HF's BPE needs a merges list, so it is derived from the ranks the same
way tiktoken would build each token. Special ids are never produced from text: the HF model
knows only the ranks, and the chat template inserts special ids itself.

`write_test_tokenizer` writes a small vocabulary in the same format (ranks learned by BPE
training on an embedded text) so a synthesised checkpoint is a complete, servable model.
"""

from __future__ import annotations

import ast
import base64
import codecs
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.model.config import MAX_TOKEN_ID
from engine.errors import CheckpointError
from engine.jsonfile import load_json

MAX_TOKENIZER_CONFIG = 64 << 20  # the release's (256 added tokens + chat template) is ~100 KB

# The Kimi split regex (o200k rules + Han runs). `&&` is class intersection; both Oniguruma
# (HF tokenizers) and Rust's regex (tiktoken) support it, and the parity tests prove the
# two engines split identically.
SPLIT_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

N_SPECIAL = 256
# Named special tokens by offset from the first special id (spec 1.6); the rest are
# `<|reserved_token_{id}|>` as in Kimi's tokenizer.
SPECIAL_NAMES = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    21: "<|media_pad|>",
    255: "[PAD]",
}


def special_token_names(n_ranks: int) -> dict[int, str]:
    """id -> content of the 256 added tokens following `n_ranks` BPE ranks."""
    return {
        n_ranks + i: SPECIAL_NAMES.get(i, f"<|reserved_token_{n_ranks + i}|>")
        for i in range(N_SPECIAL)
    }


# ---------------------------------------------------------------------------------------
# byte <-> printable unicode mapping used by byte-level BPE vocabularies (GPT-2 convention)


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()


def _to_unicode(token: bytes) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in token)


# ---------------------------------------------------------------------------------------
# reading the files


def read_ranks(path: Path) -> dict[bytes, int]:
    """Parse `tiktoken.model`; ranks must be 0..n-1 and unique."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                b64, rank = line.split()
                ranks[base64.b64decode(b64, validate=True)] = int(rank)
            except ValueError as exc:
                raise CheckpointError(
                    f"{path} line {lineno} is not 'base64 rank'; the tokenizer file is damaged"
                ) from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def split_pattern_from_dir(directory: Path) -> str:
    """The regex from `tokenization_kimi.py` when shipped (assigned to `pat_str` as a
    literal or `"|".join([...literals])`), else the embedded copy."""
    path = directory / "tokenization_kimi.py"
    if not path.is_file():
        return SPLIT_PATTERN
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return SPLIT_PATTERN
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pat_str" for t in node.targets
        ):
            value = node.value
            try:
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
                    sep = ast.literal_eval(value.func.value)
                    parts = ast.literal_eval(value.args[0])
                    if value.func.attr == "join" and isinstance(sep, str):
                        return sep.join(parts)
                return str(ast.literal_eval(value))
            except (ValueError, IndexError, TypeError):
                return SPLIT_PATTERN
    return SPLIT_PATTERN


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop restricted to ranks below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that creates each multi-byte token, ordered by the token's rank."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = _bpe(ranks, token, rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def build_hf_tokenizer(ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN) -> HFTokenizer:
    vocab = {_to_unicode(tok): rank for tok, rank in ranks.items()}
    merges = [(_to_unicode(a), _to_unicode(b)) for a, b in derive_merges(ranks)]
    # ignore_merges: a piece that is itself a token is taken whole, as tiktoken does.
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


# ---------------------------------------------------------------------------------------
# the tokenizer


class StreamDecoder:
    """Token ids in, text out as soon as it is whole: never half a UTF-8 character.

    Invalid byte sequences become U+FFFD (only once they can no longer complete)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._dec.decode(self._tok.id_to_bytes(token_id))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


@dataclass
class Tokenizer:
    hf: HFTokenizer
    token_bytes: list[bytes]  # id -> bytes, ranks then specials (utf-8 of their content)
    specials: dict[str, int]  # content -> id
    n_ranks: int
    bos_id: int
    eos_id: int
    pad_id: int | None

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        d = Path(directory)
        model_path, config_path = d / "tiktoken.model", d / "tokenizer_config.json"
        for p in (model_path, config_path):
            if not p.is_file():
                raise CheckpointError(
                    f"{p} is missing; pass --tokenizer DIR pointing at the folder with "
                    "tiktoken.model and tokenizer_config.json"
                )
        ranks = read_ranks(model_path)
        config = load_json(config_path, MAX_TOKENIZER_CONFIG,
                           "restore the checkpoint's own tokenizer_config.json")
        try:
            added = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{config_path} has no readable added_tokens_decoder; restore the checkpoint's "
                "own tokenizer_config.json") from None
        n = len(ranks)
        bad = [i for i, c in added.items() if not isinstance(c, str) or not 0 <= i < MAX_TOKEN_ID]
        if bad:
            raise CheckpointError(
                f"{config_path}: added token {bad[0]} is not a string with an id in "
                f"0..{MAX_TOKEN_ID - 1}; restore the checkpoint's own tokenizer_config.json")
        if any(i < n for i in added):
            raise CheckpointError(f"{config_path}: added token ids overlap the {n} BPE ranks")
        token_bytes = [b""] * (n + (max(added) + 1 - n if added else 0))
        for tok, rank in ranks.items():
            token_bytes[rank] = tok
        for i, content in added.items():
            token_bytes[i] = content.encode("utf-8")
        specials = {content: i for i, content in added.items()}

        def special_id(key: str, default: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return specials.get(value if isinstance(value, str) and value else default)

        return cls(
            hf=build_hf_tokenizer(ranks, split_pattern_from_dir(d)),
            token_bytes=token_bytes,
            specials=specials,
            n_ranks=n,
            bos_id=special_id("bos_token", "[BOS]"),
            eos_id=special_id("eos_token", "[EOS]"),
            pad_id=special_id("pad_token", "[PAD]"),
        )

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in `text` stay ordinary text."""
        if not text:
            return []
        # encode_batch lets go of the GIL while it works (encode does not): a megabyte
        # of text tokenised in the server's worker thread leaves its event loop running
        return self.hf.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def special(self, name: str) -> int:
        """Id of a special token by its content, e.g. `<|open|>`."""
        try:
            return self.specials[name]
        except KeyError:
            raise KeyError(f"no special token {name!r} in this tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return token_id >= self.n_ranks

    def id_to_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self.token_bytes):
            return self.token_bytes[token_id]
        return b""  # ids past the tokenizer (a model vocab larger than the tokenizer)

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        data = b"".join(
            self.id_to_bytes(i) for i in ids if not (skip_special and self.is_special(i))
        )
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


# ---------------------------------------------------------------------------------------
# a small test vocabulary, learned deterministically from embedded text


def _pieces(text: str, pattern: str = SPLIT_PATTERN) -> list[str]:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return [p for p, _ in split.pre_tokenize_str(text)]


def _training_counts(extended: bool) -> dict[bytes, int]:
    """Pre-token counts: the text (weighted so its merges come first) plus fillers (word
    variants, numbers; letter trigrams when `extended`) so larger vocabularies still have
    merges to learn."""
    counts: dict[bytes, int] = {}
    pieces = _pieces(TRAINING_TEXT)
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
    trigram fillers (slow to train on) are used only when the vocabulary needs them."""
    try:
        return _learn(n_ranks, extended=False)
    except _Exhausted:
        pass
    try:
        return _learn(n_ranks, extended=True)
    except _Exhausted as exc:
        raise ValueError(
            f"the embedded training text supports only {exc.args[0]} ranks, not {n_ranks}"
        ) from None


class _Exhausted(Exception):
    pass


def _learn(n_ranks: int, extended: bool) -> dict[bytes, int]:
    if n_ranks < 256:
        raise ValueError("a byte-level vocabulary needs at least 256 ranks")
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
            raise _Exhausted(len(ranks))
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
        "k3_test_vocabulary": "learned from engine/tokenizer.py's embedded text; not Kimi's",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


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
