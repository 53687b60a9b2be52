"""The language-model data path without Ray: the text_files source, the byte-level BPE tokenizer,
packing, the prepared token dataset and its unigram baseline, the task dispatch."""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from app.data.corpus import EOS, TOKENIZER_FILE, encode_documents, pack, train_tokenizer
from app.data.ingest import fit_preprocessor
from app.data.prepare import prepare, read_dataset_file, read_manifest, split_files
from app.data.sources import expand_path, load_source
from app.errors import ConfigError, UserError
from app.tasks.lm import target_counts, token_rows, unigram_perplexity
from app.tasks.registry import check_metric, task_for_dataset
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


def text_files_config(config_factory, root: Path, *overrides: str):
    return config_factory(
        f"data.path={root}/**/*.py",
        *overrides,
        path=LM_YAML,
    )


def test_text_files_are_sorted_documents_without_excluded_folders(config_factory, corpus):
    data = load_source(text_files_config(config_factory, corpus).data)
    assert data.kind == "documents"
    assert data.frame["path"].tolist() == ["a/y.py", "a/z.py", "b.py"]
    assert data.frame["text"].tolist() == ["y = 2\n", "x = 1\n", "import os\n"]
    assert data.description["documents"] == 3


def test_text_files_without_a_match_is_one_line(config_factory, tmp_path):
    config = config_factory(f"data.path={tmp_path}/*.md", path=LM_YAML)
    with pytest.raises(UserError, match=r"no files match"):
        load_source(config.data)


def test_text_files_refuses_a_file_that_is_not_utf8(config_factory, corpus):
    (corpus / "bad.py").write_bytes(b"x = '\xff'\n")
    with pytest.raises(UserError, match=r"bad.py: not UTF-8 text"):
        load_source(text_files_config(config_factory, corpus).data)


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
    ids = encode_documents(tokenizer, ["ab", "cd"])
    assert ids[-1] == eos and (ids == eos).sum() == 2


def test_packing_makes_every_token_but_the_first_a_target_once():
    rows = pack(np.arange(11, dtype=np.int32), block_size=3)
    assert rows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert sorted(rows[:, 1:].ravel().tolist()) == list(range(1, 10))
    assert pack(np.arange(3), block_size=3).shape == (0, 4)  # too short for one row


def test_prepare_writes_token_rows_and_a_hashed_tokenizer(config_factory, tmp_path):
    root = tmp_path / "many"
    for i in range(20):
        write(root, f"m{i:02d}.py", f"def f{i}(x):\n    return x * {i} + {i}\n" * 20)
    config = text_files_config(config_factory, root, "data.val_fraction=0.2", "model.max_length=16")
    prepare(config)
    manifest = read_manifest(config.data_output)
    assert manifest.kind == "tokens" and manifest.block_size == 16
    assert manifest.source["documents_per_split"] == {"train": 16, "val": 4}  # split by document
    rows = np.concatenate(list(token_rows(split_files(config.data_output, manifest, "val"))))
    assert rows.shape == (manifest.rows["val"], 17)
    pre = fit_preprocessor(config, manifest)
    assert pre.kind == "tokens" and pre.block_size == 16
    assert pre.tokenizer.decode(rows[0].tolist())  # ids of the dataset's own tokenizer
    # The tokenizer is checked against the manifest like a shard.
    path = Path(config.data_output) / manifest.files[TOKENIZER_FILE].file
    path.write_text(path.read_text() + " ")
    with pytest.raises(UserError, match=r"tokenizer.json: sha256 differs"):
        read_dataset_file(config.data_output, manifest, TOKENIZER_FILE)


def test_unigram_perplexity_is_the_vocabulary_size_for_uniform_counts():
    uniform = np.full(50, 7)
    assert unigram_perplexity(uniform, np.arange(50)) == pytest.approx(50)
    skewed = np.array([90, 10])  # add-one: p = (91/102, 11/102)
    held_out = np.array([1, 1])
    expected = math.exp(-(math.log(91 / 102) + math.log(11 / 102)) / 2)
    assert unigram_perplexity(skewed, held_out) == pytest.approx(expected)


def test_target_counts_skip_each_rows_first_token():
    rows = np.array([[5, 1, 1], [1, 2, 0]])
    assert target_counts([rows], 6).tolist() == [1, 2, 1, 0, 0, 0]


def test_a_language_model_is_ranked_by_a_metric_it_reports(config_factory):
    lm = task_for_dataset("tokens")
    check_metric(config_factory(path=LM_YAML), lm)  # val_loss
    with pytest.raises(ConfigError, match=r"train.checkpoint_metric: 'val_accuracy' is not"):
        check_metric(config_factory("train.checkpoint_metric=val_accuracy", path=LM_YAML), lm)
    assert task_for_dataset("image").name == "classify"
