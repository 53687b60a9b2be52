"""Pretrained Hugging Face folders (app/pretrained.py): the project's modules reproduce
transformers' outputs from the same weights, its tokenizers and image processor give
transformers' inputs, the ONNX export keeps them, LoRA merges exactly, and bad folders are
refused with one line (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers as hf

from app.config import ModelConfig, TrainConfig
from app.data import kinds
from app.data.preprocess import Preprocessor
from app.errors import ConfigError
from app.models import build_model, load_pretrained
from app.models.families import family_of
from app.models.lora import LoRALinear, apply_lora, merge_lora
from app.pretrained import Pretrained, open_pretrained
from app.runtime.kv import KVDecoder
from app.tasks.classify.export import export_onnx
from app.tasks.lm.export import export_kv_onnx
from app.train import finetune
from app.train.loop import Schedule
from tools.make_tiny_pretrained import make_bert, make_gpt2, make_vit

pytestmark = pytest.mark.unit
TEXTS = [
    "w12 topic0_3 w80 without topic1_2",
    "A much LONGER sentence, with many filler words w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 in it!",
    "unseen-word ünïcödé",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    out = {
        "gpt2": make_gpt2(str(root / "gpt2")),
        "bert": make_bert(str(root / "bert")),
        "bert_no_pooler": make_bert(str(root / "bert_no_pooler"), pooler=False),
        "vit": make_vit(str(root / "vit")),
        "vit_no_pooler": make_vit(str(root / "vit_no_pooler"), pooler=False),
    }
    # A BERT folder as older tools write it: vocab.txt and no tokenizer.json.
    vocab_only = root / "bert_vocab_only"
    shutil.copytree(out["bert"], vocab_only)
    vocab = json.loads((vocab_only / "tokenizer.json").read_text())["model"]["vocab"]
    (vocab_only / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
    (vocab_only / "tokenizer.json").unlink()
    out["bert_vocab_only"] = str(vocab_only)
    return out


def preprocessor(base: Pretrained, labels=("a", "b", "c"), max_length=16) -> Preprocessor:
    kind = family_of(base).takes.kind
    state = {
        "version": 1,
        "kind": kind,
        "feature_columns": ["x"],
        "label_column": "label",
        "labels": list(labels) if kind != "tokens" else [],
        "pretrained": base.record(),
    }
    if kind in ("text", "tokens"):
        state["tokenizer"] = base.tokenizer_json()
    if kind == "text":
        state |= {"max_length": max_length, "pad_token": base.pad_token()}
    if kind == "tokens":
        state["block_size"] = max_length
    if kind == "image":
        state |= {"image_shape": [3, 20, 24], "image_processor": base.image_processor()}
    return kinds.from_state(state)


def loaded(folder: str, **train) -> tuple[torch.nn.Module, Preprocessor]:
    pre = preprocessor(open_pretrained(folder))
    torch.manual_seed(0)
    model = finetune.adapt(build_model(ModelConfig(pretrained=folder), pre), TrainConfig(**train))
    load_pretrained(model, pre)
    return model.eval(), pre


def images(n=3, height=20, width=24, channels=3, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, channels), np.uint8)


def reference_head(model, pooled: torch.Tensor) -> torch.Tensor:
    return model.head(pooled)


# --- parity with transformers -------------------------------------------------------------------


@torch.no_grad()
def test_gpt2_logits_match_transformers(folders):
    model, _ = loaded(folders["gpt2"])
    reference = hf.GPT2LMHeadModel.from_pretrained(folders["gpt2"]).eval()
    ids = torch.randint(
        0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    assert torch.allclose(model(ids), reference(ids).logits, atol=1e-4)


@pytest.mark.parametrize("name", ["bert", "bert_no_pooler"])
@torch.no_grad()
def test_bert_states_and_classifier_input_match_transformers(folders, name):
    model, pre = loaded(folders[name])
    reference = hf.BertModel.from_pretrained(folders[name], add_pooling_layer=name == "bert").eval()
    inputs = pre.features(TEXTS)
    ids, mask = (torch.from_numpy(inputs[k]) for k in ("input_ids", "attention_mask"))
    assert mask.sum(1).min() < mask.shape[1]  # padding is in play
    hidden, pooled = model.encode(ids, mask)
    ref = reference(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    assert torch.allclose(hidden[real], ref.last_hidden_state[real], atol=1e-4)
    if name == "bert":  # the head sits on the pooler ...
        expected = ref.pooler_output
    else:  # ... or on the mean of the real tokens' states
        m = mask[..., None].float()
        expected = (ref.last_hidden_state * m).sum(1) / m.sum(1)
    assert torch.allclose(pooled, expected, atol=1e-4)
    assert torch.allclose(model(ids, mask), model.head(expected), atol=1e-4)


@pytest.mark.parametrize("name", ["vit", "vit_no_pooler"])
@torch.no_grad()
def test_vit_states_and_classifier_input_match_transformers(folders, name):
    model, _ = loaded(folders[name])
    reference = hf.ViTModel.from_pretrained(folders[name], add_pooling_layer=name == "vit").eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    hidden, pooled = model.encode(pixels)
    ref = reference(pixel_values=pixels)
    assert torch.allclose(hidden, ref.last_hidden_state, atol=1e-4)
    expected = ref.pooler_output if name == "vit" else ref.last_hidden_state.mean(1)
    assert torch.allclose(pooled, expected, atol=1e-4)


@pytest.mark.parametrize("name", ["bert", "bert_vocab_only"])
def test_bert_tokenizer_gives_transformers_ids_exactly(folders, name):
    pre = preprocessor(open_pretrained(folders[name]), max_length=16)
    reference = hf.AutoTokenizer.from_pretrained(folders[name])
    expected = reference(TEXTS, truncation=True, max_length=16, padding="max_length")
    ours = pre.features(TEXTS)
    assert ours["input_ids"].tolist() == expected["input_ids"]
    assert ours["attention_mask"].tolist() == expected["attention_mask"]


def test_gpt2_tokenizer_gives_transformers_ids_exactly(folders):
    pre = preprocessor(open_pretrained(folders["gpt2"]))
    reference = hf.AutoTokenizer.from_pretrained(folders["gpt2"])
    for text in [*TEXTS, "def f(x):\n    return x ** 2  # <|endoftext|>"]:
        assert pre.tokenizer.encode(text).ids == reference(text)["input_ids"]


@pytest.mark.parametrize("channels", [3, 1])
def test_image_processor_gives_transformers_pixels_within_1_255(folders, channels):
    state = preprocessor(open_pretrained(folders["vit"])).state
    pre = kinds.from_state({**state, "image_shape": [channels, 20, 24]})
    raw = images(channels=channels)
    reference = hf.ViTImageProcessor.from_pretrained(folders["vit"])
    rgb = np.repeat(raw, 3, axis=-1) if channels == 1 else raw
    expected = reference(list(rgb), return_tensors="np")["pixel_values"]
    ours = pre.features(raw.transpose(0, 3, 1, 2).reshape(len(raw), -1).astype(np.float32))["x"]
    assert ours.shape == expected.shape == (3, 3, 32, 32)
    std = np.asarray(reference.image_std, np.float32)[:, None, None]
    assert np.abs((ours - expected) * std).max() <= 1 / 255  # in 0..1 pixel units


# --- the ONNX export keeps transformers' outputs --------------------------------------------------


@pytest.mark.parametrize("name", ["bert", "vit"])
@torch.no_grad()
def test_classifier_onnx_export_matches_transformers_within_1e3(folders, name, tmp_path):
    model, pre = loaded(folders[name])
    raw = TEXTS if name == "bert" else images().transpose(0, 3, 1, 2).reshape(3, -1)
    inputs = pre.features(raw)
    if name == "bert":
        reference = hf.BertModel.from_pretrained(folders[name]).eval()
        pooled = reference(**{k: torch.from_numpy(v) for k, v in inputs.items()}).pooler_output
    else:
        reference = hf.ViTModel.from_pretrained(folders[name]).eval()
        pooled = reference(pixel_values=torch.from_numpy(inputs["x"])).pooler_output
    path = str(tmp_path / "model.onnx")
    export_onnx(model, pre, inputs, path, opset=17)
    logits = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    assert np.abs(logits - model.head(pooled).numpy()).max() < 1e-3


@torch.no_grad()
def test_gpt2_kv_cache_onnx_export_matches_transformers_within_1e3(folders, tmp_path):
    model, _ = loaded(folders["gpt2"])
    reference = hf.GPT2LMHeadModel.from_pretrained(folders["gpt2"]).eval()
    ids = np.random.default_rng(0).integers(0, reference.config.vocab_size, (1, 12))
    path = str(tmp_path / "lm.onnx")
    export_kv_onnx(model, path, opset=17)
    decoder = KVDecoder(ort.InferenceSession(path, providers=["CPUExecutionProvider"]))
    # The prompt at once, then one token at a time through the cache: both match.
    logits, cache = decoder.step(ids[:, :8], decoder.empty_cache())
    steps = [logits]
    for i in range(8, 12):
        logits, cache = decoder.step(ids[:, i : i + 1], cache)
        steps.append(logits)
    expected = reference(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(np.concatenate(steps, axis=1) - expected).max() < 1e-3


# --- fine-tuning controls -------------------------------------------------------------------------


@torch.no_grad()
def test_lora_merged_output_equals_base_plus_adapter_output(folders):
    model, pre = loaded(folders["bert"], lora_rank=4, lora_targets=["query", "value"])
    wrapped = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 4  # query and value of two layers
    for layer in wrapped:  # as if trained: B is no longer zero
        layer.lora_b.normal_(std=0.1)
    x = torch.randn(5, 32)
    layer = wrapped[0]
    base = torch.nn.functional.linear(x, layer.weight, layer.bias)
    adapter = x @ layer.lora_a.T @ layer.lora_b.T * layer.scale
    assert torch.allclose(layer.merged()(x), base + adapter, atol=1e-5)
    inputs = {k: torch.from_numpy(v) for k, v in pre.features(TEXTS).items()}
    before = model(**inputs)
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert torch.allclose(model(**inputs), before, atol=1e-5)


def test_lora_and_freeze_leave_only_what_they_train(folders):
    model, _ = loaded(folders["bert"], lora_rank=2)
    finetune.freeze(model, TrainConfig(lora_rank=2))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or n.startswith("head.") for n in trained)
    model, _ = loaded(folders["bert"])
    finetune.freeze(model, TrainConfig(freeze="backbone"))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "head.weight",
        "head.bias",
    }
    finetune.freeze(model, TrainConfig(freeze="embeddings"))
    assert all(p.requires_grad is False for p in model.embeddings.parameters())
    gpt, _ = loaded(folders["gpt2"])
    with pytest.raises(ConfigError, match="nothing to train"):
        finetune.freeze(gpt, TrainConfig(freeze="backbone"))
    with pytest.raises(ConfigError, match="lora_targets"):
        apply_lora(gpt, 2, 16.0, ["no_such_layer"])


def test_weight_decay_skips_biases_and_norms(folders):
    model, _ = loaded(folders["bert"])
    decay, no_decay = finetune.param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and p.ndim == 2 for p in decay["params"])
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])


def test_learning_rate_schedules_warm_up_then_decay():
    for kind, end in (("constant", 1.0), ("linear", 0.0), ("cosine", 0.1)):
        schedule = Schedule(kind, warmup=10, total=100)
        assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
        assert schedule(100) == pytest.approx(end)
        assert schedule(55) == pytest.approx(1.0 if kind == "constant" else (1 + end) / 2)


def test_memory_estimate_refuses_a_model_that_cannot_fit(folders):
    model, _ = loaded(folders["bert"])
    t = TrainConfig(num_workers=2)
    estimate = finetune.memory_per_worker(model, t)
    params = sum(p.numel() for p in model.parameters())
    assert estimate == {"weights": 4 * params, "gradients": 4 * params, "optimizer": 8 * params}
    sharded = finetune.memory_per_worker(model, TrainConfig(num_workers=2, strategy="fsdp"))
    assert sum(sharded.values()) == pytest.approx(sum(estimate.values()) / 2, abs=4)
    finetune.check_fits(estimate, t, available=16 * params)
    with pytest.raises(ConfigError, match=r"each worker needs about .* GiB .*train.strategy=fsdp"):
        finetune.check_fits(estimate, t, available=15 * params)


def test_model_name_and_pretrained_together_are_refused():
    with pytest.raises(Exception, match="leave it out with model.pretrained"):
        ModelConfig(pretrained="models/bert", name="transformer")


# --- refused folders: one line, exit 2 -----------------------------------------------------------


def damaged(folders, tmp_path, how: str) -> str:
    folder = tmp_path / how
    shutil.copytree(folders["bert"], folder)
    config = json.loads((folder / "config.json").read_text())
    if how == "pickled":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    elif how == "unknown":
        config["model_type"] = "mamba"
    elif how == "remote_code":
        config |= {"model_type": "my_arch", "auto_map": {"AutoModel": "modeling_my.MyModel"}}
    elif how == "no_tokenizer":
        (folder / "tokenizer.json").unlink()
    elif how == "more_layers":  # 300 layers claimed over the folder's 2
        config["num_hidden_layers"] = 300
    elif how == "string_size":
        config["hidden_size"] = "32"
    elif how == "big_tokenizer":  # token ids beyond the embedding rows
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        extra = config["vocab_size"] - tokenizer.get_vocab_size() + 1
        tokenizer.add_special_tokens([f"<extra_{i}>" for i in range(max(extra, 1))])
        tokenizer.save(str(folder / "tokenizer.json"))
    elif how == "tokenizer_config":
        (folder / "tokenizer_config.json").write_text("{not json")
    elif how == "lying_header":  # a tensor whose bytes run past the end of the file
        lie(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def lie(path) -> None:
    """Rewrites the first tensor's byte range in a safetensors header to end past the file."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] = len(raw) * 2
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("pickled", "pickled weights (pytorch_model.bin)"),
        (
            "unknown",
            "unknown model_type 'mamba' (supported: bert, clip, gpt2, llama, mistral, qwen2, qwen3, vit)",
        ),
        ("remote_code", "needs the folder's own code (auto_map), which is never run"),
        ("no_tokenizer", "missing tokenizer.json or vocab.txt"),
        ("more_layers", "implies tensor blocks.2."),
        ("string_size", 'config.json hidden_size: "32" is not a size'),
        ("big_tokenizer", "more than config.json's vocab_size"),
        ("tokenizer_config", "tokenizer_config.json unreadable"),
        ("lying_header", "bytes lie outside the file"),
    ],
)
def test_bad_folders_exit_2_with_one_line(folders, tmp_path, capsys, how, says):
    from jobs import prepare

    folder = damaged(folders, tmp_path, how)
    open_pretrained.cache_clear()
    overrides = [
        f"model.pretrained={folder}",
        f"data.output={tmp_path}/data",
        "data.source=synthetic_text",
    ]
    with pytest.raises(SystemExit) as exit_info:
        prepare.main(["--config", "configs/bert-text.yaml", *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and folder in err[0], err
    assert not os.path.exists(f"{tmp_path}/data")  # refused before any data was written


def test_a_folder_claiming_300_layers_is_refused_before_any_model_is_built(tmp_path):
    """Two layers of width 512 whose config.json claims 300: the claim is checked against the
    weights' headers on the meta device, so refusing it costs no memory (the claimed model
    would take about 3 GiB)."""
    import psutil

    from app.config import ModelConfig
    from app.models.families import base_for

    folder = make_bert(str(tmp_path / "wide"), width=512)
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    (tmp_path / "wide" / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 300}))
    open_pretrained.cache_clear()
    before = psutil.Process().memory_info().rss
    with pytest.raises(ConfigError, match="implies tensor blocks.2"):
        base_for(ModelConfig(pretrained=folder))
    assert psutil.Process().memory_info().rss - before < 100 * 2**20


def test_a_hub_cache_snapshot_of_symlinks_loads_like_the_folder(folders, tmp_path):
    """The hub's cache layout: files are content-addressed blobs, the snapshot holds symlinks."""
    repo = tmp_path / "models--org--tiny-bert"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(folders["bert"]))):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(os.path.join(folders["bert"], name), blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    model, pre = loaded(str(snapshot))
    reference, _ = loaded(folders["bert"])
    assert (
        pre.state["pretrained"]["weights_sha256"]
        == open_pretrained(folders["bert"]).weights_sha256()
    )
    inputs = {k: torch.from_numpy(v) for k, v in pre.features(TEXTS).items()}
    with torch.no_grad():
        assert torch.equal(model(**inputs), reference(**inputs))


def test_sharded_safetensors_load_and_hash_every_shard(folders, tmp_path):
    reference = hf.GPT2LMHeadModel.from_pretrained(folders["gpt2"])
    sharded = tmp_path / "gpt2-sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(folders["gpt2"], name), sharded / name)
    base = open_pretrained(str(sharded))
    assert len(base.weight_files) > 1 and "model.safetensors.index.json" in os.listdir(sharded)
    model, _ = loaded(str(sharded))
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        assert torch.allclose(model(ids), reference.eval()(ids).logits, atol=1e-4)


def test_a_folder_on_s3_is_downloaded_once_per_upload_and_loads_like_the_local_one(
    folders, tmp_path, monkeypatch
):
    from concurrent.futures import ThreadPoolExecutor

    from app import storage
    from app.pretrained import local_folder
    from tests.s3_server import moto_s3

    monkeypatch.setenv("RAYTORCH_PRETRAINED_CACHE", str(tmp_path / "cache"))
    with moto_s3() as bucket:
        uri = f"{bucket}/models/bert"
        for name in os.listdir(folders["bert"]):
            storage.upload_file(os.path.join(folders["bert"], name), f"{uri}/{name}")
        storage.upload_file(
            os.path.join(folders["bert"], "config.json"), f"{uri}/flax_model.msgpack"
        )
        storage.upload_file(os.path.join(folders["bert"], "config.json"), f"{uri}/notes/x.txt")
        open_pretrained.cache_clear()
        model, pre = loaded(uri)
        assert pre.state["pretrained"]["uri"] == uri
        copies = [n for n in os.listdir(tmp_path / "cache") if not n.startswith(".")]
        assert len(copies) == 1  # one download, under a stable name
        # Only what the project reads comes down (a pickle is an empty stand-in).
        assert "notes" not in os.listdir(tmp_path / "cache" / copies[0])
        assert os.path.getsize(tmp_path / "cache" / copies[0] / "flax_model.msgpack") == 0
        open_pretrained.cache_clear()
        assert open_pretrained(uri + "/").local == open_pretrained.__wrapped__(uri).local
        # Uploaded again at the same URI: a new copy, never the old weights.
        time.sleep(1.1)  # S3 modification times are in seconds
        storage.upload_file(os.path.join(folders["bert"], "config.json"), f"{uri}/config.json")
        assert open_pretrained.__wrapped__(uri).local != str(tmp_path / "cache" / copies[0])
        # Processes that miss together download once; nothing half-written stays.
        storage.upload_file(os.path.join(folders["bert"], "config.json"), f"{uri}/README.md")
        with ThreadPoolExecutor(4) as pool:
            paths = set(pool.map(lambda _: local_folder(uri), range(4)))
        assert len(paths) == 1
        assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".download-")]
    reference, _ = loaded(folders["bert"])
    inputs = {k: torch.from_numpy(v) for k, v in pre.features(TEXTS).items()}
    with torch.no_grad():
        assert torch.equal(model(**inputs), reference(**inputs))


def test_a_lora_checkpoint_loads_merged_for_evaluation_and_export(folders, tmp_path):
    """`LoadedCheckpoint` rebuilds the model from the checkpoint alone (the folder's record),
    adds the adapters so their tensors load, and merges them: plain Linear layers, same output."""
    from app.config import validate
    from app.train import checkpoint

    config = validate(
        {
            "model": {"pretrained": folders["bert"]},
            "train": {"lora_rank": 4, "lora_targets": ["query"]},
        }
    )
    model, pre = loaded(folders["bert"], lora_rank=4, lora_targets=["query"])
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            torch.nn.init.normal_(layer.lora_b, std=0.1)
    meta = {"config": config.model_dump(mode="json"), "epoch": 1, "step": 1, "metrics": {}}
    checkpoint.save(str(tmp_path), model, {}, meta | {"preprocessor": pre.to_json()})
    restored = checkpoint.LoadedCheckpoint(str(tmp_path))
    assert not any(isinstance(m, LoRALinear) for m in restored.model.modules())
    inputs = {k: torch.from_numpy(v) for k, v in pre.features(TEXTS).items()}
    with torch.no_grad():
        assert torch.allclose(restored.model(**inputs), model(**inputs), atol=1e-5)
