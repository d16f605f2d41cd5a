"""Kimi's tokenizer: tiktoken-format byte-level BPE ranks run by HF `tokenizers`.

Files (as shipped with the checkpoint): `tiktoken.model` (one `base64(bytes) rank` line per
BPE rank) and `tokenizer_config.json` (`added_tokens_decoder`: the 256 special tokens that
follow the ranks). Encoding: pre-split with the Kimi regex, then tiktoken-style BPE (a piece
that is itself a token is taken whole; otherwise merge the adjacent pair whose concatenation
has the lowest rank). HF's BPE needs a merges list, so it is derived from the ranks the same
way tiktoken would build each token. Special ids are never produced from text: the HF model
knows only the ranks, and the chat template inserts special ids itself.

`engine/text/bpe_train.py` writes a small vocabulary in the same format (ranks learned by
BPE training on an embedded text) so a synthesised checkpoint is a complete, servable model.
"""

from __future__ import annotations

import ast
import base64
import codecs
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import CheckpointError
from engine.jsonfile import load_json
from engine.core.config import MAX_TOKEN_ID

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
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
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


def bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
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
        parts = bpe_parts(ranks, token, rank)
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


# Control characters a client would act on (BEL, ESC, C1), not whitespace it shows.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _escape_controls(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class StreamDecoder:
    """Token ids in, text out as soon as it is whole: never half a UTF-8 character.

    Bytes that can no longer form a character (random weights write them often), and
    control characters, come out escaped as the text `\\xNN`: never U+FFFD, never a
    raw BEL or ESC for a client's terminal. A tail still incomplete at the end is escaped
    by `flush`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")

    def add(self, token_id: int) -> str:
        return _escape_controls(self._dec.decode(self._tok.id_to_bytes(token_id)))

    def flush(self) -> str:
        return _escape_controls(self._dec.decode(b"", final=True))


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
        config = load_json(
            config_path, MAX_TOKENIZER_CONFIG, "restore the checkpoint's own tokenizer_config.json"
        )
        try:
            added = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{config_path} has no readable added_tokens_decoder; restore the checkpoint's "
                "own tokenizer_config.json"
            ) from None
        n = len(ranks)
        bad = [i for i, c in added.items() if not isinstance(c, str) or not 0 <= i < MAX_TOKEN_ID]
        if bad:
            raise CheckpointError(
                f"{config_path}: added token {bad[0]} is not a string with an id in "
                f"0..{MAX_TOKEN_ID - 1}; restore the checkpoint's own tokenizer_config.json"
            )
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


def split_pieces(text: str, pattern: str = SPLIT_PATTERN) -> list[str]:
    """The pre-tokenizer's pieces of `text` (what BPE then runs on, one piece at a time)."""
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return [p for p, _ in split.pre_tokenize_str(text)]
