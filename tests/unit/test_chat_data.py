"""Chat fine-tuning's data path without Ray: conversations rendered by the folder's chat template
and tokenized, the tokens the loss counts found from the template's own output (Llama 3.1-,
Qwen2.5-, Qwen3- and Mistral-shaped templates and the plain one; a template with `{% generation
%}` markers agrees with transformers' assistant mask), bad lines refused by file and line, the
end of turn an end id, and prepared shards that repeat byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from app.chat_template import PLAIN_TEMPLATE
from app.data.chat_render import ChatFormat, Renderer, RowRefused, turn_end_token
from app.data.pieces import InProcess
from app.data.prepare import read_manifest, split_files
from app.errors import ConfigError, UserError
from app.pipeline.stages import prepare
from app.pretrained import open_pretrained
from app.tasks.lm.train import SEGMENTS_KEY, TOKENS_KEY, TRAINED_KEY, token_rows
from tests.unit.unit_helpers import REPO

pytestmark = pytest.mark.unit

CHAT_YAML = REPO / "configs" / "chat-sft.yaml"
CONVERSATION = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "Which word is a food: bread cat red?"},
    {"role": "assistant", "content": "bread"},
    {"role": "user", "content": "And which is an animal?"},
    {"role": "assistant", "content": "cat"},
]

# Templates in the shapes the families ship (written for these tests, same turn markers).
LLAMA31 = (
    "{{- bos_token }}"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nToday Date: ' + date_string + '\n\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
QWEN25 = (  # ChatML, with Qwen2.5's default system message
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN3 = (  # ChatML; the answer after the last question gets a think block, earlier ones none
    "{%- set ns = namespace(last_query=messages | length - 1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- if loop.index0 > ns.last_query and loop.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
MARKED = (  # ChatML with transformers' {% generation %} markers around what is trained
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from tools.make_tiny_pretrained import make_decoder

    root = tmp_path_factory.mktemp("chat-folders")
    return {name: make_decoder(str(root / name), name) for name in ("qwen2", "llama", "mistral")}


def renderer(folder: str, template: str | None, **settings) -> Renderer:
    from tokenizers import Tokenizer

    base = open_pretrained(folder)
    source, specials = template or PLAIN_TEMPLATE, base.special_tokens()
    tokenizer = base.tokenizer_json()
    fmt = ChatFormat(
        template=source,
        special_tokens=specials,
        tokenizer=tokenizer,
        add_special_tokens=template is None,
        turn_end=turn_end_token(source, specials, Tokenizer.from_str(tokenizer)),
        train_on=settings.get("train_on", "assistant"),
        date="2026-01-01",
        max_tokens=settings.get("max_tokens", 256),
        truncate=settings.get("truncate", False),
    )
    return Renderer(fmt)


def expected_mask(r: Renderer, starts: list[str], end: str) -> np.ndarray:
    """The tokens overlapping each assistant turn's text, from `starts[i]` (the content, or what
    the template writes before it inside the turn) through the first `end` after it."""
    text = r.render(CONVERSATION, False)
    encoding = r.tokenizer.encode(text, add_special_tokens=r.fmt.add_special_tokens)
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    question = CONVERSATION[1]["content"]
    cursor = text.index(question) + len(question)
    for start_text in starts:
        start = text.index(start_text, cursor)
        stop = text.index(end, start) + len(end)
        for i, (a, b) in enumerate(encoding.offsets):
            mask[i] |= b > a and b > start and a < stop
        cursor = stop
    return mask


@pytest.mark.parametrize(
    "family, template, starts, end",
    [
        ("llama", LLAMA31, ["bread", "cat"], "<|eot_id|>"),
        ("qwen2", QWEN25, ["bread", "cat"], "<|im_end|>"),
        ("qwen2", QWEN3, ["bread", "<think>"], "<|im_end|>"),  # the think block trained as written
        ("mistral", "folder", ["bread", "cat"], "</s>"),
        ("qwen2", None, [" bread", " cat"], "<|im_end|>"),  # the plain template: eos ends a turn
    ],
    ids=["llama3.1", "qwen2.5", "qwen3", "mistral", "plain"],
)
def test_the_trained_tokens_are_each_assistant_turn_and_its_end_of_turn(
    folders, family, template, starts, end
):
    if template == "folder":
        template = open_pretrained(folders[family]).chat_template()
    r = renderer(folders[family], template)
    tokens = r.tokenized(CONVERSATION)
    assert tokens.trained.tolist() == expected_mask(r, starts, end).tolist()
    trained_text = r.tokenizer.decode(
        [int(i) for i, t in zip(tokens.ids, tokens.trained, strict=True) if t],
        skip_special_tokens=False,
    )
    assert trained_text.count(end) == 2  # each turn's end of turn, nothing else of the template
    assert "Which word" not in trained_text and "system" not in trained_text


def test_the_template_date_is_the_configured_day(folders):
    r = renderer(folders["llama"], LLAMA31)
    assert "Today Date: 01 Jan 2026" in r.render(CONVERSATION, False)


def test_a_template_with_generation_markers_agrees_with_transformers_assistant_mask(folders):
    from transformers import AutoTokenizer

    r = renderer(folders["qwen2"], MARKED)
    tokenizer = AutoTokenizer.from_pretrained(folders["qwen2"])
    out = tokenizer.apply_chat_template(
        CONVERSATION,
        chat_template=MARKED,
        return_dict=True,
        return_assistant_tokens_mask=True,
        tokenize=True,
    )
    tokens = r.tokenized(CONVERSATION)
    assert tokens.ids.tolist() == list(out["input_ids"])
    assert tokens.trained.tolist() == list(out["assistant_masks"])


def test_train_on_all_trains_every_token_but_the_first(folders):
    tokens = renderer(folders["qwen2"], QWEN25, train_on="all").tokenized(CONVERSATION)
    assert tokens.trained[0] == 0 and tokens.trained[1:].all()


def test_an_assistant_turn_of_weight_zero_is_left_out(folders):
    r = renderer(folders["qwen2"], QWEN25)
    weighted = [dict(m) for m in CONVERSATION]
    weighted[2]["weight"] = 0
    tokens = r.tokenized(weighted)
    trained = r.tokenizer.decode(
        [int(i) for i, t in zip(tokens.ids, tokens.trained, strict=True) if t],
        skip_special_tokens=False,
    )
    assert trained == "cat<|im_end|>"


def test_a_long_conversation_is_refused_or_cut(folders):
    whole = renderer(folders["qwen2"], QWEN25).tokenized(CONVERSATION)
    short = len(whole.ids) - 2  # the last turn's end of turn does not fit
    with pytest.raises(RowRefused, match="over model.max_length"):
        renderer(folders["qwen2"], QWEN25, max_tokens=short).tokenized(CONVERSATION)
    cut = renderer(folders["qwen2"], QWEN25, max_tokens=short, truncate=True)
    tokens = cut.tokenized(CONVERSATION)
    assert tokens.ids.tolist() == whole.ids[:short].tolist()
    assert tokens.trained.tolist() == whole.trained[:short].tolist()


def test_a_template_that_ends_no_turn_with_a_special_token_has_no_turn_end(folders):
    from tokenizers import Tokenizer

    base = open_pretrained(folders["qwen2"])
    plain_text = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    tokenizer = Tokenizer.from_str(base.tokenizer_json())
    assert turn_end_token(plain_text, base.special_tokens(), tokenizer) is None


# --- prepare: JSON Lines -> packed shards --------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def chats(count: int, offset: int = 0) -> list[str]:
    return [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"Say {i}."},
                    {"role": "assistant", "content": f"{i}"},
                ]
            }
        )
        for i in range(offset, offset + count)
    ]


def chat_config(config_factory, folder: str, path: Path, *overrides: str):
    return config_factory(
        f"model.pretrained={folder}",
        f"data.path={path}",
        "data.val_fraction=0.25",
        "model.max_length=64",
        *overrides,
        path=CHAT_YAML,
    )


BAD_LINES = [
    ("not json", "not JSON"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "messages[0].role 'tool' is not one of"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content is not a string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": []}', "messages: expected a non-empty list"),
    ('{"text": "hi"}', 'expected "messages", or "prompt" and "completion"'),
    (json.dumps({"prompt": "x " * 200, "completion": "y"}), "over model.max_length"),
]


@pytest.mark.parametrize("line, why", BAD_LINES, ids=[w for _, w in BAD_LINES])
def test_a_bad_line_refuses_the_source_naming_its_file_and_line(
    config_factory, folders, tmp_path, line, why
):
    path = write_lines(tmp_path / "chats.jsonl", [*chats(3), line, *chats(3, 3)])
    config = chat_config(config_factory, folders["qwen2"], path)
    with pytest.raises(UserError) as e:
        prepare(config, InProcess())
    assert str(e.value).startswith("chats.jsonl:4: ") and why in str(e.value)
    assert "data.skip_bad_rows=true" in str(e.value)


def test_bad_lines_are_counted_and_left_out_under_skip_bad_rows(config_factory, folders, tmp_path):
    path = write_lines(tmp_path / "chats.jsonl", [*chats(40), *(line for line, _ in BAD_LINES)])
    config = chat_config(config_factory, folders["qwen2"], path, "data.skip_bad_rows=true")
    summary = prepare(config, InProcess())
    assert summary["skipped"] == len(BAD_LINES)
    assert summary["skipped_examples"][0].startswith("chats.jsonl:41: not JSON")


def test_prompt_completion_records_train_the_completion(config_factory, folders, tmp_path):
    line = json.dumps({"prompt": "Say hi.", "completion": "hi"})
    path = write_lines(tmp_path / "chats.jsonl", [line] * 1 + chats(30))
    config = chat_config(config_factory, folders["qwen2"], path, "data.pack=false")
    prepare(config, InProcess())
    rows = all_rows(config)
    assert (rows[SEGMENTS_KEY].max(axis=1) == 1).all()  # unpacked: one conversation a row


def all_rows(config, split: str | None = None) -> dict[str, np.ndarray]:
    manifest = read_manifest(config.data_output)
    splits = [split] if split else list(manifest.splits)
    batches = [b for s in splits for b in token_rows(split_files(config.data_output, manifest, s))]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_prepared_chat_shards_repeat_byte_for_byte_and_keep_conversations_whole(
    config_maker, folders, tmp_path
):
    path = write_lines(tmp_path / "chats.jsonl", chats(200) + chats(20))  # 20 repeated
    overrides = [f"model.pretrained={folders['qwen2']}", f"data.path={path}"]
    overrides += ["data.val_fraction=0.25", "model.max_length=128"]
    digests = []
    for run in ("a", "b"):
        config = config_maker(tmp_path / run, *overrides, path=CHAT_YAML)
        prepare(config, InProcess())
        manifest = read_manifest(config.data_output)
        digests.append([s.sha256 for split in manifest.splits.values() for s in split.shards])
    assert digests[0] == digests[1]
    rows = {s: all_rows(config, s) for s in ("train", "val")}
    texts = {s: set(conversation_texts(config, rows[s])) for s in rows}
    assert not texts["train"] & texts["val"]  # a repeated conversation stays on one side
    assert sum(len(t) for t in texts.values()) == 200
    packed = rows["train"][SEGMENTS_KEY].max(axis=1)
    assert packed.mean() > 2  # several conversations to a row
    for r in rows.values():  # a row's first token is never trained
        assert not r[TRAINED_KEY][:, 0].any()


def conversation_texts(config, rows: dict[str, np.ndarray]) -> list[str]:
    from tokenizers import Tokenizer

    from app.data.packing import unpacked

    base = open_pretrained(config.model.pretrained)
    tokenizer = Tokenizer.from_str(base.tokenizer_json())
    sequences = unpacked(rows[TOKENS_KEY], rows[TRAINED_KEY], rows[SEGMENTS_KEY])
    return [tokenizer.decode(s.ids.tolist(), skip_special_tokens=False) for s in sequences]


def test_the_template_end_of_turn_ends_generation_where_the_eos_is_another(folders, tmp_path):
    """Qwen2.5's base models: eos <|endoftext|>, turns closed by <|im_end|>."""
    import shutil

    from app.data.kinds.tokens import Tokens

    folder = str(tmp_path / "qwen2-base")
    shutil.copytree(folders["qwen2"], folder)
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        with open(os.path.join(folder, name)) as f:
            config = json.load(f)
        if "eos_token" in config:
            config["eos_token"] = "<|endoftext|>"
        if "eos_token_id" in config:
            config["eos_token_id"] = 0  # <|endoftext|>
        with open(os.path.join(folder, name), "w") as f:
            json.dump(config, f)
    base = open_pretrained(folder)
    manifest = {"feature_columns": ["input_ids"], "label_column": "", "block_size": 16}
    pre = Tokens.adopt(manifest, base.tokenizer_json(), base)
    im_end = pre.tokenizer.token_to_id("<|im_end|>")
    assert 0 in pre.end_ids and im_end in pre.end_ids


def test_the_shipped_example_is_what_its_tool_writes(tmp_path):
    """examples/chat (configs/chat-sft.yaml's data and folder) is reproducible."""
    from safetensors.torch import load_file

    from tools.make_chat_example import main

    main([str(tmp_path)])
    shipped = REPO / "examples" / "chat"
    for name in ("word_rules.jsonl", "tiny-qwen2/tokenizer.json", "tiny-qwen2/chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
    made, kept = (load_file(p / "tiny-qwen2" / "model.safetensors") for p in (tmp_path, shipped))
    assert made.keys() == kept.keys() and all((made[k] == kept[k]).all() for k in made)


def test_packed_chat_rows_cannot_cross_pipeline_stages(config_factory, folders, tmp_path):
    path = write_lines(tmp_path / "chats.jsonl", chats(3))
    staged = ("train.strategy=pipeline", "train.num_workers=2")
    with pytest.raises(ConfigError, match="data.pack=false"):
        chat_config(config_factory, folders["qwen2"], path, *staged)
    assert chat_config(config_factory, folders["qwen2"], path, *staged, "data.pack=false")


def test_a_template_refusing_an_answered_conversation_is_refused_naming_the_folder(
    config_factory, folders, tmp_path
):
    import shutil

    folder = tmp_path / "no-answers"
    shutil.copytree(folders["qwen2"], folder)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[-1]['role'] == 'assistant' %}{{ raise_exception('no answers') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    path = write_lines(tmp_path / "chats.jsonl", chats(3))
    with pytest.raises(ConfigError, match="no-answers.*refuses a one-question conversation"):
        prepare(chat_config(config_factory, str(folder), path), InProcess())
