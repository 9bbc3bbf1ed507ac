"""A deterministic, generated-in-code character-level corpus.

Nothing is downloaded: a small probabilistic grammar produces English-like
sentences with learnable structure (number agreement between determiner,
noun and verb, "a"/"an", capitalisation, punctuation, small additions whose
answers are always right). A character-level model picks up spelling within
tens of steps and the grammar over a few hundred, so the loss visibly falls.

Usage::

    from recipes.data import GrammarDataModule

    dm = GrammarDataModule(block_size=64, batch_size=16, seed=1234)
    print(dm.tokenizer.vocab_size, dm.tokenizer.decode(dm.tokenizer.encode("The cat.")))
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))  # (16, 64) int64 each, y is x shifted by one
"""

from __future__ import annotations

import math
import random

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = ["CharTokenizer", "GrammarDataModule", "TokenWindowDataset", "generate_corpus", "padded_vocab_size"]

# --- grammar -----------------------------------------------------------------

# (singular, plural)
NOUNS = [
    ("cat", "cats"), ("dog", "dogs"), ("fox", "foxes"), ("bird", "birds"),
    ("child", "children"), ("teacher", "teachers"), ("farmer", "farmers"),
    ("robot", "robots"), ("owl", "owls"), ("mouse", "mice"), ("sailor", "sailors"),
    ("engineer", "engineers"), ("artist", "artists"), ("horse", "horses"),
]
OBJECTS = [
    "the ball", "a red apple", "the old map", "an orange", "the small boat",
    "a letter", "the garden", "the bread", "a green hat", "the river", "a song",
    "the moon", "an idea", "the door",
]
# (third-person singular, plural/base, past)
VERBS = [
    ("sees", "see", "saw"), ("finds", "find", "found"), ("likes", "like", "liked"),
    ("carries", "carry", "carried"), ("watches", "watch", "watched"),
    ("paints", "paint", "painted"), ("builds", "build", "built"),
    ("follows", "follow", "followed"), ("wants", "want", "wanted"),
]
INTRANSITIVE = [
    ("sleeps", "sleep", "slept"), ("runs", "run", "ran"), ("sings", "sing", "sang"),
    ("waits", "wait", "waited"), ("laughs", "laugh", "laughed"),
]
ADJECTIVES = ["big", "small", "old", "young", "happy", "quiet", "brave", "clever", "tired", "red"]
PLACES = ["in the park", "by the sea", "at night", "near the house", "under the tree", "on monday"]
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
    "seventeen", "eighteen",
]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """Return ``(phrase, is_plural)``; determiner, adjective and noun agree."""
    singular, plural = rng.choice(NOUNS)
    adjective = rng.choice(ADJECTIVES) if rng.random() < 0.5 else None
    if rng.random() < 0.5:
        head = f"{adjective} {singular}" if adjective else singular
        det = rng.choice(["the", _article(head), "this", "my"])
        return f"{det} {head}", False
    count = rng.randint(2, 9)
    det = rng.choice(["the", "these", "some", NUMBER_WORDS[count]])
    head = f"{adjective} {plural}" if adjective else plural
    return f"{det} {head}", True


def _statement(rng: random.Random) -> str:
    subject, plural = _noun_phrase(rng)
    tense = rng.choice([0, 0, 1])  # 0 present, 1 past
    if rng.random() < 0.65:
        verb = rng.choice(VERBS)
        form = verb[2] if tense else verb[1 if plural else 0]
        obj = rng.choice(OBJECTS) if rng.random() < 0.6 else _noun_phrase(rng)[0]
        sentence = f"{subject} {form} {obj}"
    else:
        verb = rng.choice(INTRANSITIVE)
        form = verb[2] if tense else verb[1 if plural else 0]
        sentence = f"{subject} {form}"
    if rng.random() < 0.4:
        sentence += f" {rng.choice(PLACES)}"
    if rng.random() < 0.2:
        be = ("were" if plural else "was") if tense else ("are" if plural else "is")
        sentence += f" because {'they' if plural else 'it'} {be} {rng.choice(ADJECTIVES)}"
    return sentence + "."


def _question(rng: random.Random) -> str:
    subject, plural = _noun_phrase(rng)
    aux = "do" if plural else "does"
    verb = rng.choice(VERBS)[1]  # base form after do/does
    return f"{aux} {subject} {verb} {rng.choice(OBJECTS)}?"


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    text = _statement(rng) if r < 0.7 else _question(rng) if r < 0.85 else _arithmetic(rng)
    return text[0].upper() + text[1:]


def generate_corpus(num_chars: int, seed: int = 1234) -> str:
    """Generate at least ``num_chars`` characters of text, deterministic in ``seed``.

    Sentences are joined by spaces, with a newline ending each paragraph of 3-6
    sentences.
    """
    rng = random.Random(seed)
    paragraphs: list[str] = []
    total = 0
    while total < num_chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 6)))
        paragraphs.append(paragraph)
        total += len(paragraph) + 1
    return "\n".join(paragraphs) + "\n"


# --- tokenizer and dataset ---------------------------------------------------


class CharTokenizer:
    """Character-level tokenizer whose vocabulary is the sorted set of chars in ``text``."""

    def __init__(self, text: str) -> None:
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int] | Tensor) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class TokenWindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """``(input, target)`` windows of ``block_size`` tokens; target is input shifted by one.

    Windows start every ``stride`` tokens (``stride == block_size`` gives
    non-overlapping windows).
    """

    def __init__(self, tokens: Tensor, block_size: int, stride: int | None = None) -> None:
        if tokens.numel() <= block_size:
            raise ValueError(f"need more than block_size={block_size} tokens, got {tokens.numel()}")
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        self._len = (tokens.numel() - block_size - 1) // self.stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round up so the LM head / embedding can be split evenly across tp ranks."""
    return math.ceil(vocab_size / multiple) * multiple


class GrammarDataModule(pl.LightningDataModule):
    """Train/val dataloaders over the generated corpus (first 90% train, last 10% val).

    The corpus and tokenizer are built eagerly in ``__init__`` (it takes well
    under a second) so the vocabulary size is known before the model is built:
    :attr:`vocab_size` is the model vocabulary this data needs, the tokenizer's
    rounded up to a multiple of ``vocab_multiple`` (divisible by tp, so the
    embedding and LM head split evenly over the tensor-parallel ranks).
    Under a distributed strategy Lightning swaps in a ``DistributedSampler``
    using the strategy's ``distributed_sampler_kwargs``.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 16,
        num_chars: int = 1_000_000,
        val_fraction: float = 0.1,
        stride: int | None = None,
        num_workers: int = 0,
        seed: int = 1234,
        vocab_multiple: int = 1,
    ) -> None:
        super().__init__()
        self.vocab_multiple = vocab_multiple
        self.block_size = block_size
        self.batch_size = batch_size
        self.stride = stride
        self.num_workers = num_workers
        self.seed = seed
        self.text = generate_corpus(num_chars, seed=seed)
        self.tokenizer = CharTokenizer(self.text)
        tokens = torch.tensor(self.tokenizer.encode(self.text), dtype=torch.long)
        split = int(len(tokens) * (1.0 - val_fraction))
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]
        self.train_set: TokenWindowDataset | None = None
        self.val_set: TokenWindowDataset | None = None

    @property
    def vocab_size(self) -> int:
        """The model vocabulary: the tokenizer's, padded up to a multiple of ``vocab_multiple``."""
        return padded_vocab_size(self.tokenizer.vocab_size, self.vocab_multiple)

    def setup(self, stage: str | None = None) -> None:
        self.train_set = TokenWindowDataset(self.train_tokens, self.block_size, self.stride)
        self.val_set = TokenWindowDataset(self.val_tokens, self.block_size, self.block_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        # drop_last keeps every batch the same shape (pipeline microbatching and
        # compiled/sharded kernels prefer fixed shapes).
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
        )
