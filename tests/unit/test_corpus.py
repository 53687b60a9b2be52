"""The language-model data path without Ray: the text_files source, the byte-level BPE tokenizer,
packing, the prepared token dataset and its unigram baseline, the task dispatch."""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from app.data import text_files as corpus_source
from app.data.pieces import InProcess
from app.data.prepare import read_dataset_file, read_manifest, split_files
from app.data.text_files import (
    EOS,
    TOKENIZER_FILE,
    encode_documents,
    expand_path,
    listed,
    pack,
    train_tokenizer,
)
from app.errors import ConfigError, UserError
from app.pipeline.stages import prepare
from app.registry import check_metric, task_for_dataset
from app.tasks.lm.train import target_counts, token_rows, unigram_perplexity
from app.train.preprocessing import fit_preprocessor
from tests.unit.unit_helpers import REPO

pytestmark = pytest.mark.unit

LM_YAML = REPO / "configs" / "lm.yaml"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    write(root, "b.py", "import os\n")
    write(root, "a/z.py", "x = 1\n")
    write(root, "a/y.py", "y = 2\n")
    write(root, "a/test/t.py", "assert True\n")  # excluded folder
    write(root, "tests/u.py", "assert False\n")  # excluded folder
    write(root, "site-packages/pkg.py", "import pkg\n")  # excluded folder
    write(root, "empty.py", "  \n")  # no content: skipped
    write(root, "notes.txt", "not python\n")  # does not match the glob
    return root


def many_documents(root: Path, count: int) -> Path:
    for i in range(count):
        write(root, f"m{i:02d}.py", f"def f{i}(x):\n    return x * {i} + {i}\n" * 20)
    return root


def text_files_config(config_factory, root: Path, *overrides: str):
    return config_factory(
        f"data.path={root}/**/*.py",
        *overrides,
        path=LM_YAML,
    )


def test_text_files_are_sorted_documents_without_excluded_folders(corpus):
    documents, sizes = listed(f"{corpus}/**/*.py", ["site-packages", "test", "tests"])
    # empty.py holds only whitespace: listed, then left out by the task that reads it.
    assert documents.files == ("a/y.py", "a/z.py", "b.py", "empty.py")
    assert documents.root == str(corpus) and sizes == [6, 6, 10, 3]


def test_text_files_without_a_match_is_one_line(config_factory, tmp_path):
    config = config_factory(f"data.path={tmp_path}/*.md", path=LM_YAML)
    with pytest.raises(UserError, match=r"no files match"):
        prepare(config, InProcess())


def test_a_file_that_is_not_utf8_is_refused_by_name_or_skipped(config_factory, tmp_path):
    root = many_documents(tmp_path / "many", 20)
    (root / "m07.py").write_bytes(b"x = '\xff'\n")
    config = text_files_config(config_factory, root, "data.val_fraction=0.2")
    with pytest.raises(UserError, match=r"m07.py: not UTF-8 text \(byte 5"):
        prepare(config, InProcess())
    assert not Path(config.data_output).exists()  # nothing published
    skipping = text_files_config(
        config_factory, root, "data.val_fraction=0.2", "data.skip_bad_rows=true"
    )
    summary = prepare(skipping, InProcess())
    assert summary["skipped"] == 1 and "m07.py" in summary["skipped_examples"][0]


def test_stdlib_placeholder_names_this_pythons_standard_library():
    assert expand_path("{stdlib}/**/*.py") == os.path.join(
        sysconfig.get_paths()["stdlib"], "**", "*.py"
    )


def test_byte_level_bpe_round_trips_text_it_never_saw():
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=300)
    text = "class Ünïcode:\n\tname = '日本語 🙂'  # tabs,   spaces\r\n"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id(EOS) is not None


def test_documents_end_with_the_end_of_text_token():
    tokenizer = train_tokenizer(["ab ab ab", "cd"], vocab_size=280)
    eos = tokenizer.token_to_id(EOS)
    ids = encode_documents(tokenizer, ["ab", "cd"], eos)
    assert ids[-1] == eos and (ids == eos).sum() == 2


def test_a_pretrained_folders_corpus_ends_documents_with_its_own_end_of_text(
    config_factory, tmp_path
):
    """A Qwen folder's tokenizer has `<|endoftext|>` too, but its `eos_token` is `<|im_end|>`:
    that token separates the documents, and the dataset's preprocessor keeps every end id."""
    from tokenizers import Tokenizer

    from tools.make_tiny_pretrained import make_decoder

    folder = make_decoder(str(tmp_path / "qwen2"), "qwen2")
    root = many_documents(tmp_path / "docs", 6)
    config = config_factory(
        f"data.path={root}/**/*.py",
        f"model.pretrained={folder}",
        "data.val_fraction=0.3",
        "model.max_length=16",
        path=REPO / "configs" / "gpt2-finetune.yaml",
    )
    prepare(config, InProcess())
    manifest = read_manifest(config.data_output)
    tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    ids = np.concatenate(
        [b["input_ids"] for b in token_rows(split_files(config.data_output, manifest, "train"))]
    )
    assert (ids == im_end).any() and not (ids == endoftext).any()
    assert fit_preprocessor(config, manifest).end_ids == [im_end, endoftext]


def test_packing_makes_every_token_but_the_first_a_target_once():
    rows = pack(np.arange(11, dtype=np.int32), block_size=3)
    assert rows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert sorted(rows[:, 1:].ravel().tolist()) == list(range(1, 10))
    assert pack(np.arange(3), block_size=3).shape == (0, 4)  # too short for one row


def val_text(config, manifest) -> str:
    """The val split's rows decoded back into text (consecutive rows overlap by one token)."""
    files = split_files(config.data_output, manifest, "val")
    rows = np.concatenate([b["input_ids"] for b in token_rows(files)])
    ids = [*rows[0].tolist(), *rows[1:, 1:].ravel().tolist()]
    return fit_preprocessor(config, manifest).tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("piece_bytes", [1 << 20, 700])  # one piece; a piece of about 2 files
def test_prepare_splits_by_document_into_token_rows_and_a_hashed_tokenizer(
    config_factory, tmp_path, monkeypatch, piece_bytes
):
    monkeypatch.setattr(corpus_source, "DOCUMENT_BYTES_PER_PIECE", piece_bytes)
    root = many_documents(tmp_path / "many", 20)
    config = text_files_config(config_factory, root, "data.val_fraction=0.2", "model.max_length=16")
    prepare(config, InProcess())
    manifest = read_manifest(config.data_output)
    assert manifest.kind == "tokens" and manifest.block_size == 16
    per_split = manifest.source["documents_per_split"]
    assert per_split["train"] + per_split["val"] == 20 and per_split["val"] >= 1
    assert manifest.columns == {"input_ids": "fixed_size_list<item: int32>[17]"}
    # Split by document: the val rows decode into whole val documents, in source order.
    text = val_text(config, manifest)
    documents = [(root / f"m{i:02d}.py").read_text() for i in range(20)]
    ours = [d for d in documents if d.splitlines()[0] in text]
    assert len(ours) == per_split["val"]
    if piece_bytes > 1 << 19:  # one piece: the split's documents packed as one stream
        assert (EOS.join(ours) + EOS).startswith(text)
    # The tokenizer is checked against the manifest like a shard.
    path = Path(config.data_output) / manifest.files[TOKENIZER_FILE].file
    path.write_text(path.read_text() + " ")
    with pytest.raises(UserError, match=r"tokenizer.json: sha256 differs"):
        read_dataset_file(config.data_output, manifest, TOKENIZER_FILE)


def test_a_split_too_short_for_one_sequence_is_one_line(config_factory, tmp_path):
    root = many_documents(tmp_path / "many", 20)
    config = text_files_config(
        config_factory, root, "data.val_fraction=0.2", "model.max_length=4096"
    )
    with pytest.raises(
        UserError, match=r"the val split holds fewer tokens than one sequence of 4097"
    ):
        prepare(config, InProcess())


def test_a_corpus_without_a_val_document_says_so(config_factory, corpus):
    config = text_files_config(config_factory, corpus, "data.val_fraction=0.01")
    with pytest.raises(UserError, match=r"none of its 4 documents falls in the val split"):
        prepare(config, InProcess())


def test_unigram_perplexity_is_the_vocabulary_size_for_uniform_counts():
    uniform = np.full(50, 7)
    assert unigram_perplexity(uniform, np.arange(50)) == pytest.approx(50)
    skewed = np.array([90, 10])  # add-one: p = (91/102, 11/102)
    held_out = np.array([1, 1])
    expected = math.exp(-(math.log(91 / 102) + math.log(11 / 102)) / 2)
    assert unigram_perplexity(skewed, held_out) == pytest.approx(expected)


def test_target_counts_skip_each_rows_first_token():
    rows = np.array([[5, 1, 1], [1, 2, 0]])
    assert target_counts([{"input_ids": rows}], 6).tolist() == [1, 2, 1, 0, 0, 0]
    trained = np.array([[0, 1, 0], [0, 0, 1]])  # a chat row counts its trained targets only
    assert target_counts([{"input_ids": rows, "trained": trained}], 6).tolist() == [
        1,
        1,
        0,
        0,
        0,
        0,
    ]


def test_a_language_model_is_ranked_by_a_metric_it_reports(config_factory):
    lm = task_for_dataset("tokens")
    check_metric(config_factory(path=LM_YAML), lm)  # val_loss
    with pytest.raises(ConfigError, match=r"train.checkpoint_metric: 'val_accuracy' is not"):
        check_metric(config_factory("train.checkpoint_metric=val_accuracy", path=LM_YAML), lm)
    assert task_for_dataset("image").name == "classify"
