"""A text corpus (`data.source: text_files`) -> a token dataset for language modelling, prepared
in pieces (app/data/pieces.py).

Every file the glob `data.path` matches is one document (sorted by path relative to the glob's
folder; files under a folder named in `data.exclude_dirs`, and empty files, left out). A
document's split is a pure function of (`data.seed`, its relative path), so no file straddles
train and val and adding files moves none that were there.

Two passes at most. Unless the pretrained model brings its own tokenizer, one task streams the
train documents into a byte-level BPE trainer (it holds the trainer's word counts, not the
text) and returns the tokenizer. Then a task a piece (a run of documents of about
DOCUMENT_BYTES_PER_PIECE) encodes each document followed by the end-of-text token (the trained
tokenizer's `<|endoftext|>`, or the pretrained folder's own `eos_token`) and packs each split's
tokens into rows of `model.max_length + 1`: a row holds a sequence and, shifted by one, its
next-token targets. Consecutive rows overlap by one token, so every token but the first of
a piece's split is a target exactly once; the tail shorter than a row is dropped.

The tokenizer travels with the dataset (`tokenizer.json`, hashed in the manifest like a shard),
then inside the run's preprocessor, its checkpoints and artifacts: byte-level BPE can encode any
text, so generation never meets an unknown character.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from app.config import Config
from app.data.kinds.tokens import EOS, Tokens
from app.data.pieces import (
    SPLITS,
    PieceResult,
    ShardWriter,
    SourcePlan,
    SplitRule,
    Target,
    Tasks,
    row_keys,
)
from app.data.preprocess import PretrainedLookup
from app.errors import UserError
from app.pretrained import Pretrained

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"
TOKENS_COLUMN = "input_ids"
STDLIB = "{stdlib}"  # in data.path: this Python's standard library folder
DOCUMENT_BYTES_PER_PIECE = 16 << 20  # documents a task reads, encodes and packs


@dataclass(frozen=True)
class Documents:
    """Documents by path relative to `root`, in source order."""

    root: str
    files: tuple[str, ...]

    def keys(self) -> np.ndarray:
        return row_keys(pa.table({"path": pa.array(self.files, pa.string())}), ["path"])


@dataclass(frozen=True)
class CorpusPiece:
    index: int
    documents: Documents


@dataclass(frozen=True)
class Encoding:
    """What a task makes of its documents: token rows of `block + 1` ids."""

    tokenizer: str  # the tokenizer as `tokenizers` serialises it
    block: int
    skip_bad_rows: bool
    separator: int  # the end-of-text token's id, after every document
    max_examples: int = 5


def planned(config: Config, tasks: Tasks, folder: str, bases: PretrainedLookup) -> SourcePlan:
    cfg = config.data
    assert cfg.path is not None  # DataConfig requires it for this source
    corpus, sizes = listed(cfg.path, cfg.exclude_dirs)
    rule = SplitRule(cfg.seed, cfg.val_fraction, cfg.test_fraction)
    per_split = documents_per_split(rule.codes(corpus.keys()))
    if not per_split.get("val"):
        raise UserError(
            f"data.path {cfg.path!r}: none of its {len(corpus.files)} documents falls in the val "
            f"split (data.val_fraction={cfg.val_fraction}, by path): add documents or raise "
            "data.val_fraction"
        )
    base = bases.base(Tokens)
    if base is None:
        tokenizer = trained_tokenizer(
            tasks, corpus, rule, config.model.vocab_size, cfg.skip_bad_rows
        )
    else:  # the pretrained model's own tokenizer: none is trained
        tokenizer = base.tokenizer_json()
    block = config.model.sequence_length(base.max_positions if base else None)
    encoding = Encoding(tokenizer, block, cfg.skip_bad_rows, end_of_text(tokenizer, base))
    return SourcePlan(
        kind="tokens",
        features=(TOKENS_COLUMN,),
        label="",
        schema=schema(block),
        pieces=pieces_of(corpus, sizes),
        run=functools.partial(prepare_piece, encoding=encoding),
        description={
            "source": "text_files",
            "path": cfg.path,
            "root": corpus.root,
            "exclude_dirs": cfg.exclude_dirs,
            "documents": len(corpus.files),
            "bytes": int(sum(sizes)),
            "tokenizer": f"{base.uri} (pretrained)" if base else "byte-level BPE",
            "vocab_size": vocab_size(tokenizer),
            "documents_per_split": per_split,
        },
        skip_bad_rows=cfg.skip_bad_rows,
        files={TOKENIZER_FILE: tokenizer.encode()},
        block_size=block,
        too_few=(
            f"the {{split}} split holds fewer tokens than one sequence of {block + 1}: add "
            "documents, raise data.val_fraction or lower model.max_length"
        ),
    )


def end_of_text(tokenizer: str, base: Pretrained | None) -> int:
    """The token after every document: the folder's own end of text, or the trained one's."""
    from tokenizers import Tokenizer

    token = base.end_of_text() if base else Tokenizer.from_str(tokenizer).token_to_id(EOS)
    if token is None:
        assert base is not None
        raise base.fail(
            "no end-of-text token to separate documents with (tokenizer_config.json eos_token, "
            "generation_config.json or config.json eos_token_id)"
        )
    return token


def listed(path: str, exclude_dirs: list[str]) -> tuple[Documents, list[int]]:
    """The corpus's non-empty files in source order, and their sizes in bytes."""
    pattern = expand_path(path)
    root = glob_root(pattern)
    files = text_file_paths(pattern, exclude_dirs)
    if not files:
        raise UserError(f"data.path {path!r}: no files match {pattern!r}")
    sizes = [os.path.getsize(f) for f in files]
    kept = [(os.path.relpath(f, root), s) for f, s in zip(files, sizes, strict=True) if s]
    if not kept:
        raise UserError(f"data.path {path!r}: all {len(files)} matching files are empty")
    return Documents(root, tuple(f for f, _ in kept)), [s for _, s in kept]


def documents_per_split(codes: np.ndarray) -> dict[str, int]:
    counts = np.bincount(codes, minlength=len(SPLITS))
    return {name: int(n) for name, n in zip(SPLITS, counts, strict=True) if n or name != "test"}


def pieces_of(corpus: Documents, sizes: list[int]) -> list[CorpusPiece]:
    """Runs of consecutive documents of about DOCUMENT_BYTES_PER_PIECE each."""
    pieces: list[CorpusPiece] = []
    start, held = 0, 0
    for i, size in enumerate(sizes):
        held += size
        if held >= DOCUMENT_BYTES_PER_PIECE or i == len(sizes) - 1:
            run = Documents(corpus.root, corpus.files[start : i + 1])
            pieces.append(CorpusPiece(len(pieces), run))
            start, held = i + 1, 0
    return pieces


def schema(block: int) -> pa.Schema:
    return pa.schema([(TOKENS_COLUMN, pa.list_(pa.int32(), block + 1))])


def expand_path(path: str) -> str:
    return os.path.expanduser(path.replace(STDLIB, sysconfig.get_paths()["stdlib"]))


def glob_root(pattern: str) -> str:
    """The folder part of a glob before its first wildcard (documents are named relative to it)."""
    parts = pattern.split(os.sep)
    fixed = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts) - 1)
    return os.sep.join(parts[:fixed]) or os.sep


def text_file_paths(pattern: str, exclude_dirs: list[str]) -> list[str]:
    """Files matching `pattern`, sorted, none under an excluded folder name (below the root)."""
    root = glob_root(pattern)
    excluded = set(exclude_dirs)
    files = []
    for path in glob.glob(pattern, recursive=True):
        folders = os.path.relpath(path, root).split(os.sep)[:-1]
        if os.path.isfile(path) and not excluded.intersection(folders):
            files.append(path)
    return sorted(files)


def read_document(path: str) -> tuple[str, str | None]:
    """A file's text, or why it is not a document."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), None
    except UnicodeDecodeError as e:
        return "", f"{path}: not UTF-8 text (byte {e.start}: {e.reason})"


# --- the tokenizer -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerJob:
    corpus: Documents
    rule: SplitRule
    vocab_size: int
    skip_bad_rows: bool


def trained_tokenizer(
    tasks: Tasks, corpus: Documents, rule: SplitRule, vocab: int, skip_bad_rows: bool
) -> str:
    """A byte-level BPE tokenizer trained, in one task, on the train documents alone."""
    job = TokenizerJob(corpus, rule, vocab, skip_bad_rows)
    tokenizer, problem = tasks.map(train_on_documents, [job], "prepare: tokenizer")[0]
    if problem:
        raise UserError(f"{problem} (data.skip_bad_rows=true skips such documents)")
    return tokenizer


def train_on_documents(job: TokenizerJob) -> tuple[str, str | None]:
    """(the tokenizer, or "" and the first train document that is not UTF-8 text)."""
    problems: list[str] = []

    def texts() -> Iterator[str]:
        codes = job.rule.codes(job.corpus.keys())
        for rel, code in zip(job.corpus.files, codes, strict=True):
            if code != 0:
                continue
            text, problem = read_document(os.path.join(job.corpus.root, rel))
            if problem and not job.skip_bad_rows:
                problems.append(problem)
                return
            yield text

    tokenizer = train_tokenizer(texts(), job.vocab_size)
    return ("", problems[0]) if problems else (tokenizer.to_str(), None)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2's scheme): every byte is in the base alphabet, so any text encodes
    and decodes back to itself exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def vocab_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab_size()


# --- a piece: documents -> token rows ------------------------------------------------------------


def prepare_piece(piece: CorpusPiece, target: Target, encoding: Encoding) -> PieceResult:
    """The piece's documents encoded, each split's tokens packed into rows and written."""
    from tokenizers import Tokenizer

    out = PieceResult(piece.index)
    texts: dict[int, list[str]] = {code: [] for code in range(len(SPLITS))}
    codes = target.rule.codes(piece.documents.keys())
    for i, (rel, code) in enumerate(zip(piece.documents.files, codes, strict=True)):
        text, problem = read_document(os.path.join(piece.documents.root, rel))
        out.rows += 1
        if problem:
            out.note_bad(1, {i: problem}, encoding.max_examples)
        elif text.strip():
            texts[int(code)].append(text)
    tokenizer = Tokenizer.from_str(encoding.tokenizer)
    writer = ShardWriter(target, piece.index, schema(encoding.block))
    for code, documents in texts.items():
        ids = encode_documents(tokenizer, documents, encoding.separator)
        rows = pack(ids, encoding.block)
        log.debug(
            "piece %d, %s: %d tokens, %d rows", piece.index, SPLITS[code], len(ids), len(rows)
        )
        if len(rows):
            column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
            writer.add(pa.table({TOKENS_COLUMN: column}), np.zeros(0), np.full(len(rows), code))
    out.shards = writer.close()
    return out


def encode_documents(tokenizer, texts: list[str], separator: int) -> np.ndarray:
    """All documents' token ids in order, each followed by the end-of-text token `separator`."""
    encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    pieces = [np.asarray([*e.ids, separator], dtype=np.int32) for e in encoded]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def pack(ids: np.ndarray, block_size: int) -> np.ndarray:
    """[rows, block_size + 1] windows starting every `block_size` tokens (overlapping by one)."""
    rows = (len(ids) - 1) // block_size
    if rows <= 0:
        return np.zeros((0, block_size + 1), dtype=ids.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(ids, block_size + 1)
    return np.ascontiguousarray(windows[: rows * block_size : block_size])
