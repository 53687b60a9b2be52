"""Chat data (`data.source: chat`) -> token rows for a chat fine-tune, prepared in pieces
(app/data/pieces.py): one piece a file.

`data.path` is a JSON Lines file, or a folder of them (`*.jsonl`, local or on an object store),
one conversation a line, in OpenAI's fine-tuning format:

    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

(an assistant message may carry `"weight": 0` to leave it untrained), or a prompt and its
completion, as strings or as lists of messages:

    {"prompt": "...", "completion": "..."}

Each conversation is rendered by the pretrained folder's chat template (the plain one when it
has none) and tokenized by its tokenizer (app/data/chat_render.py), which also marks the tokens
the loss counts (`data.train_on`: the assistant turns with their end-of-turn tokens, or all).
A conversation's split is a pure function of (`data.seed`, its messages), so a conversation
repeated in the data never lands on both sides. Each split's conversations are packed several
to a row of `model.max_length + 1` tokens (`data.pack`; app/data/packing.py) in source order,
so the shards are byte-identical for the same input. A bad line (not JSON, an unknown role, a
content that is not a string, no assistant turn, over `model.max_length` tokens unless
`data.truncate`) refuses the source naming its file and line, or is counted and left out under
`data.skip_bad_rows`.
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from app import storage
from app.chat_template import PLAIN_TEMPLATE, TemplateRefused
from app.config import Config
from app.data.chat_render import ROLES, ChatFormat, Renderer, RowRefused, turn_end_token
from app.data.kinds.tokens import Tokens
from app.data.packing import WINDOW, Rows, Tokenized, packed
from app.data.pieces import SPLITS, PieceResult, ShardWriter, SourcePlan, Target, Tasks, row_keys
from app.data.preprocess import PretrainedLookup
from app.data.text_files import TOKENIZER_FILE
from app.errors import UserError
from app.pretrained import Pretrained

TOKENS, TRAINED, SEGMENTS = "input_ids", "trained", "segments"
EXTENSIONS = (".jsonl",)
LINES_PER_BATCH = 1024  # lines a task parses before it splits and tokenizes them


@dataclass(frozen=True)
class ChatPiece:
    index: int
    path: str  # a local path or URI


@dataclass(frozen=True)
class Encoding:
    fmt: ChatFormat
    pad: int  # the id after a row's last sequence
    pack: bool
    max_examples: int = 5


def planned(config: Config, tasks: Tasks, folder: str, bases: PretrainedLookup) -> SourcePlan:
    cfg = config.data
    base = bases.base(Tokens)
    if base is None:
        raise UserError(
            "data.source chat needs model.pretrained: its tokenizer and chat template turn the "
            "conversations into tokens"
        )
    files = chat_files(cfg.path)
    width = config.model.sequence_length(base.max_positions) + 1
    fmt = chat_format(config, base, width)
    return SourcePlan(
        kind="tokens",
        features=(TOKENS, TRAINED, SEGMENTS),
        label="",
        schema=schema(width),
        pieces=[ChatPiece(i, f) for i, f in enumerate(files)],
        run=functools.partial(prepare_piece, encoding=Encoding(fmt, fmt.turn_end, cfg.pack)),
        description={
            "source": "chat",
            "path": cfg.path,
            "files": len(files),
            "tokenizer": f"{base.uri} (pretrained)",
            "template": "the folder's" if fmt.template != PLAIN_TEMPLATE else "plain",
            "turn_end": fmt.turn_end,
            "train_on": cfg.train_on,
            "pack": cfg.pack,
            "date": cfg.chat_date,
        },
        skip_bad_rows=cfg.skip_bad_rows,
        files={TOKENIZER_FILE: fmt.tokenizer.encode()},
        block_size=width - 1,
        too_few=(
            "the {split} split holds no conversation: add conversations or raise data.val_fraction"
        ),
    )


def chat_format(config: Config, base: Pretrained, width: int) -> ChatFormat:
    from tokenizers import Tokenizer

    cfg = config.data
    template = base.chat_template()
    specials = base.special_tokens()
    tokenizer = base.tokenizer_json()
    try:
        turn_end = turn_end_token(
            template or PLAIN_TEMPLATE, specials, Tokenizer.from_str(tokenizer)
        )
    except TemplateRefused as e:
        raise base.fail(f"its chat template refuses a one-question conversation ({e})") from None
    if turn_end is None:
        raise base.fail(
            "its chat template closes an assistant turn with no special token, so a model "
            "trained on it could not learn where to stop"
            if template
            else "no eos_token in tokenizer_config.json to end the plain template's turns with"
        )
    return ChatFormat(
        template=template or PLAIN_TEMPLATE,
        special_tokens=specials,
        tokenizer=tokenizer,
        add_special_tokens=template is None,
        turn_end=turn_end,
        train_on=cfg.train_on,
        date=cfg.chat_date,
        max_tokens=width,
        truncate=cfg.truncate,
    )


def chat_files(path: str | None) -> list[str]:
    """The JSON Lines files `path` names: itself, or every `*.jsonl` under it, sorted."""
    from app.data.table_source import listed_files

    files = [f for f in listed_files(path, "chat") if f.lower().endswith(EXTENSIONS)]
    if not files:
        raise UserError(f"data.path {path!r}: no .jsonl files")
    return files


def schema(width: int) -> pa.Schema:
    return pa.schema(
        [
            (TOKENS, pa.list_(pa.int32(), width)),
            (TRAINED, pa.list_(pa.uint8(), width)),
            (SEGMENTS, pa.list_(pa.int32(), width)),
        ]
    )


# --- a piece: one file's conversations -> packed rows ---------------------------------------------


def prepare_piece(piece: ChatPiece, target: Target, encoding: Encoding) -> PieceResult:
    """The file's conversations checked, split, tokenized, packed and written, a window of
    conversations a split at a time (the task never holds the file)."""
    out = PieceResult(piece.index)
    renderer = Renderer(encoding.fmt)
    writer = ShardWriter(target, piece.index, schema(encoding.fmt.max_tokens))
    waiting: dict[int, list[Tokenized]] = {code: [] for code in range(len(SPLITS))}
    for lines in batches(piece.path):
        out.rows += len(lines)
        conversations, problems = parsed(lines, piece.path, renderer)
        out.note_bad(len(problems), problems, encoding.max_examples)
        if not conversations:
            continue
        keys = row_keys(pa.table({"key": [key for _, key, _ in conversations]}), ["key"])
        for code, (_, _, seq) in zip(target.rule.codes(keys), conversations, strict=True):
            waiting[int(code)].append(seq)
        for code, seqs in waiting.items():
            if len(seqs) >= WINDOW:
                write_rows(
                    writer, code, packed(seqs, encoding.fmt.max_tokens, encoding.pad, encoding.pack)
                )
                waiting[code] = []
    for code, seqs in waiting.items():
        if seqs:
            write_rows(
                writer, code, packed(seqs, encoding.fmt.max_tokens, encoding.pad, encoding.pack)
            )
    out.shards = writer.close()
    return out


def batches(path: str) -> Iterator[list[tuple[int, str]]]:
    """(line number from 1, text) of the file's non-blank lines, LINES_PER_BATCH at a time."""
    fs, local = storage.filesystem(path)
    batch: list[tuple[int, str]] = []
    with fs.open_input_stream(local) as raw:
        for number, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8", errors="replace"), 1):
            if line.strip():
                batch.append((number, line))
            if len(batch) == LINES_PER_BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def parsed(
    lines: list[tuple[int, str]], path: str, renderer: Renderer
) -> tuple[list[tuple[int, str, Tokenized]], dict[int, str]]:
    """(line, split key, tokens) of the good lines, and why each bad one is refused."""
    good, problems = [], {}
    name = os.path.basename(path) if storage.is_local(path) else path
    for number, line in lines:
        try:
            messages = conversation(line)
            good.append((number, canonical(messages), renderer.tokenized(messages)))
        except RowRefused as e:
            problems[number] = f"{name}:{number}: {e}"[:300]
    return good, problems


def conversation(line: str) -> list[dict[str, Any]]:
    """One line's messages, checked: RowRefused says what is wrong, naming the field."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise RowRefused(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise RowRefused(f"a JSON {type(record).__name__}, not an object")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        messages = [
            *as_messages(record["prompt"], "user"),
            *as_messages(record["completion"], "assistant"),
        ]
    else:
        raise RowRefused('expected "messages", or "prompt" and "completion"')
    if not isinstance(messages, list) or not messages:
        raise RowRefused("messages: expected a non-empty list")
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowRefused("no assistant message: nothing to train on")
    return messages


def as_messages(value: Any, role: str) -> list[Any]:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise RowRefused(f"{where}: expected an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise RowRefused(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
    if not isinstance(message.get("content"), str):
        raise RowRefused(f"{where}.content is not a string")
    if message.get("weight", 1) not in (0, 1):
        raise RowRefused(f"{where}.weight must be 0 or 1")


def canonical(messages: list[dict[str, Any]]) -> str:
    """The conversation's split key: its roles and contents, whatever else a line holds."""
    return json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)


def write_rows(writer: ShardWriter, code: int, rows: Rows) -> None:
    columns = {
        TOKENS: rows.ids,
        TRAINED: rows.trained,
        SEGMENTS: rows.segments,
    }
    table = pa.table(
        {
            name: pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
            for name, values in columns.items()
        }
    )
    writer.add(table, np.zeros(0), np.full(len(rows), code))


def first_prompt(path: str | None) -> list[dict[str, Any]]:
    """The messages before the first answer of the data's first good conversation (the
    pipeline's sample request)."""
    for _, line in (pair for lines in batches(chat_files(path)[0]) for pair in lines):
        try:
            messages = conversation(line)
        except RowRefused:
            continue
        return messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]
    raise UserError(f"data.path {path!r}: no conversation to send as a sample")
