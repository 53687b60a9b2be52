"""The Llama-style decoders (app/models/llama.py: llama, mistral, qwen2, qwen3) against
transformers' own modeling code, one tiny random folder per model_type and per feature (llama3
rotary scaling in both spellings, biases, grouped-query attention, a tied head, Qwen3's q/k
norms with a head_dim apart): logits on a padded batch, KV-cached decode against a full
forward, the exported ONNX graph, and every setting the module does not implement refused by
its key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import ModelConfig
from app.errors import ConfigError
from app.models.causal import empty_cache
from app.models.families import base_for, family_of
from app.pretrained import open_pretrained
from tools.make_tiny_pretrained import make_decoder

pytestmark = pytest.mark.unit

# name -> (model_type, make_decoder's keyword arguments)
FOLDERS = {
    "llama": ("llama", {}),
    "llama-legacy-rope": ("llama", {"legacy_rope": True}),
    "llama-biases-linear-rope": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "mistral": ("mistral", {}),
    "qwen2-tied": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("decoders")
    return {
        name: make_decoder(str(root / name), model_type, **kwargs)
        for name, (model_type, kwargs) in FOLDERS.items()
    }


def ours(folder: str, **model: object):
    """The project's module with the folder's weights, as a run builds it."""
    open_pretrained.cache_clear()
    base = base_for(ModelConfig(pretrained=folder, **model))  # type: ignore[arg-type]
    found = family_of(base)
    module = found.build(base.config, None, ModelConfig(pretrained=folder, **model))  # type: ignore[arg-type]
    result = module.load_state_dict(found.rename(base.weights(), base.config), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return module.eval(), base


def theirs(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def padded_batch(vocab: int, lengths=(20, 13, 6)) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(
        0, vocab, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0)
    )
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("name", list(FOLDERS))
def test_logits_on_a_padded_batch_equal_transformers(folders, name):
    model, _ = ours(folders[name])
    reference = theirs(folders[name])
    ids, mask = padded_batch(reference.config.vocab_size)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, positions, mask)
    real = mask.bool()
    assert (got - expected)[real].abs().max() < 1e-4
    assert torch.equal(got[real].argmax(-1), expected[real].argmax(-1))


@pytest.mark.parametrize("name", list(FOLDERS))
def test_kv_cached_decode_equals_a_full_forward(folders, name):
    model, _ = ours(folders[name])
    ids = torch.randint(
        0, model.head_weight().shape[0], (1, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        full = model(ids)
        past, steps = empty_cache(model), []
        for start, end in [(0, 10), *((t, t + 1) for t in range(10, 16))]:
            hidden, past = model.step(
                ids[:, start:end], torch.arange(start, end)[None], torch.ones(1, end).long(), past
            )
            steps.append(model.logits(hidden))
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5
    assert past[0].shape[1] == model.kv_heads  # the cache holds the key/value heads only


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2-tied", "qwen3"])
def test_the_exported_graph_equals_transformers(folders, name, tmp_path):
    """The KV-cache ONNX graph: a prompt's logits and cached steps against transformers' logits
    on the whole sequence; a tied head is one initializer in the graph."""
    import onnx

    from app.runtime.artifact import create_session, local_graph
    from app.runtime.kv import KVDecoder
    from app.tasks.lm.export import export_kv_onnx

    model, _ = ours(folders[name])
    reference = theirs(folders[name])
    path = str(tmp_path / "model.onnx")
    export_kv_onnx(model, path, 17)
    decoder = KVDecoder(create_session(local_graph(path)))
    ids = torch.randint(
        0, reference.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0].numpy()
    logits, cache = decoder.step(ids[:, :8].numpy(), decoder.empty_cache())
    got = [logits[0]]
    for t in range(8, 12):
        logits, cache = decoder.step(ids[:, t : t + 1].numpy(), cache)
        got.append(logits[0])
    got_all = np.concatenate(got)
    assert np.abs(got_all - expected).max() < 1e-4
    assert (got_all.argmax(-1) == expected.argmax(-1)).all()
    vocab = reference.config.vocab_size
    tables = [i for i in onnx.load(path).graph.initializer if vocab in i.dims and len(i.dims) == 2]
    assert len(tables) == (1 if name == "qwen2-tied" else 2)


def test_a_tied_head_is_one_parameter_and_the_weights_settle_the_tie(folders, tmp_path):
    """transformers 5's rule: both tensors present and equal, or one present: tied (one shared
    Parameter); present and different: two."""
    from safetensors.torch import load_file, save_file

    tied, _ = ours(folders["qwen2-tied"])
    assert tied.lm_head.weight is tied.tokens.weight
    assert sum(p.numel() for p in tied.parameters()) < sum(
        p.numel() for _, p in tied.named_parameters(remove_duplicate=False)
    )
    source = Path(folders["qwen2-tied"])
    weights = load_file(source / "model.safetensors")
    cases = {
        "equal": weights["model.embed_tokens.weight"].clone(),
        "different": weights["model.embed_tokens.weight"] + 1.0,
    }
    for case, head in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        for f in source.iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        config = json.loads((folder / "config.json").read_text()) | {"tie_word_embeddings": False}
        (folder / "config.json").write_text(json.dumps(config))
        save_file({**weights, "lm_head.weight": head}, str(folder / "model.safetensors"))
        model, _ = ours(str(folder))
        assert (model.lm_head.weight is model.tokens.weight) == (case == "equal"), case
        assert torch.equal(model.lm_head.weight, head)


def test_the_llama_scaling_in_either_spelling_is_the_same_model(folders):
    new, _ = ours(folders["llama"])
    old, _ = ours(folders["llama-legacy-rope"])
    assert "rope_scaling" in json.loads(
        Path(folders["llama-legacy-rope"], "config.json").read_text()
    )
    assert torch.equal(new.rotary.inv_freq, old.rotary.inv_freq)
    assert new.rotary.rope.scaling == "llama3"


def refused(folder: str, change: dict, **model: object) -> str:
    path = Path(folder, "config.json")
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **change}))
    try:
        with pytest.raises(ConfigError) as info:
            ours(folder, **model)
        assert "\n" not in str(info.value)
        return str(info.value)
    finally:
        path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "name, change, model, key",
    [
        ("mistral", {"sliding_window": 8}, {"max_length": 16}, "config.json sliding_window"),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            {"max_length": 16},
            "config.json use_sliding_window",
        ),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, {}, "rope_scaling"),
        ("llama", {"hidden_act": "gelu"}, {}, "config.json hidden_act"),
        ("llama", {"rope_parameters": {"partial_rotary_factor": 0.5}}, {}, "partial_rotary_factor"),
        ("llama", {"model_type": "gemma"}, {}, "unknown model_type 'gemma'"),
        ("llama", {"model_type": "phi3"}, {}, "unknown model_type 'phi3'"),
    ],
)
def test_what_the_module_does_not_implement_is_refused_by_its_key(
    folders, name, change, model, key
):
    assert key in refused(folders[name], change, **model)


def test_a_sliding_window_no_shorter_than_the_sequences_is_taken(folders):
    """Mistral's window of 64 positions over sequences of 32: attention never reaches past it,
    so the module computes exactly what transformers does; the served window stops at 64."""
    model, base = ours(folders["mistral"], max_length=32)
    assert model.block_size == 256  # no window in this folder
    path = Path(folders["mistral"], "config.json")
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "sliding_window": 64}))
    try:
        windowed, base = ours(folders["mistral"], max_length=32)
        assert windowed.block_size == base.max_positions == 64
    finally:
        path.write_text(json.dumps(config))


def test_pipeline_stages_of_the_decoder_chain_to_its_forward(folders):
    """Cut into two stages (app/train/splits.py): the first embeds and rotates, the state that
    crosses carries the rotation, the last norms and applies the (tied) head."""
    from app.train.pipelining import Stage
    from app.train.splits import split_of

    model, _ = ours(folders["qwen2-tied"])
    split = split_of(model)
    first = Stage(model, split, "blocks", range(0, 1), first=True, last=False)
    last = Stage(model, split, "blocks", range(1, 2), first=False, last=True)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        staged = last(*first(input_ids=ids))
        assert torch.allclose(staged, model(ids), atol=1e-6)
    assert last.lm_head.weight is first.tokens.weight  # the tied table on both ends


def test_lora_takes_every_projection_by_default_and_merges_back(folders):
    """train.lora_targets unset: the decoder's attention and MLP projections, not its LM head;
    merged, the adapted model is a plain module computing the same."""
    from app.config import TrainConfig
    from app.models.lora import LoRALinear, merge_lora
    from app.train.finetune import adapt, freeze

    model, _ = ours(folders["qwen3"])
    t = TrainConfig(lora_rank=2)
    adapt(model, t)
    freeze(model, t)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert wrapped == set(model.LORA_TARGETS)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # lm_head and the rest frozen
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.02)
        ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(4))
        adapted = model(ids)
        merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        assert torch.allclose(model(ids), adapted, atol=1e-5)
