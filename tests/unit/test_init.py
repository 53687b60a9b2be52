"""Initial weights drawn module by module (app/models/init.py): a model built on the meta device
and materialised part by part starts from the same weights as one built whole, for every model
family; a tensor nothing draws is refused before a sharded run starts; a pretrained tensor's
part is read as a slice of its file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from app.config import ConfigError, ModelConfig, TrainConfig
from app.models.bert import BertClassifier
from app.models.cnn import ResNetCNN
from app.models.dual_encoder import from_scratch
from app.models.gpt import GPT
from app.models.init import initialise, tied_names, uncovered
from app.models.lora import apply_lora
from app.models.mlp import MLP
from app.models.transformer import TransformerClassifier
from app.models.vit import ViTClassifier
from app.pretrained import Stored
from app.train.finetune import check_initialisable
from app.train.materialise import materialise_held

pytestmark = pytest.mark.unit


def _gpt_lora() -> nn.Module:
    model = GPT(50, 16, 32, 2, 4)
    apply_lora(model, 2, 4.0, ["qkv"])
    return model


FAMILIES = {
    "gpt": lambda: GPT(50, 16, 32, 2, 4),
    "gpt+lora": _gpt_lora,
    "transformer": lambda: TransformerClassifier(50, 3),
    "cnn": lambda: ResNetCNN(3, 4, widths=[8, 16]),
    "mlp": lambda: MLP(5, 3, hidden=[8]),
    "vit": lambda: ViTClassifier(3, 32, 8, 3, 32, 2, 4, 64),
    "bert": lambda: BertClassifier(50, 3, 32, 2, 4, 64, 16),
    "dual_encoder": lambda: from_scratch(ModelConfig(), 50, 32, 16),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_meta_build_materialised_part_by_part_equals_the_whole_build(family):
    build = FAMILIES[family]
    whole = build()
    assert uncovered(whole) == []
    initialise(whole, seed=3)
    with torch.device("meta"):
        meta = build()
    names = set(meta.state_dict(keep_vars=True))
    half = set(sorted(names)[: len(names) // 2])
    materialise_held(meta, half, torch.device("cpu"), seed=3)  # one rank's part
    for name, value in meta.state_dict(keep_vars=True).items():
        assert value.is_meta == (name not in half and not _tied_to(meta, name, half)), name
    materialise_held(meta, names - half, torch.device("cpu"), seed=3)  # the rest
    got, expected = meta.state_dict(), whole.state_dict()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{family}: {name}"


def _tied_to(model: nn.Module, name: str, names: set[str]) -> bool:
    return any(name in group and names & set(group) for group in tied_names(model))


def test_another_seed_draws_other_weights_and_gpt2s_scheme_holds():
    a, b = GPT(50, 16, 32, 4, 4), GPT(50, 16, 32, 4, 4)
    initialise(a, seed=0)
    initialise(b, seed=1)
    assert not torch.equal(a.tokens.weight, b.tokens.weight)
    assert a.head.weight is a.tokens.weight  # still tied
    big = GPT(50, 16, 256, 4, 4)
    initialise(big, seed=0)
    # N(0, 0.02), and the residual projections scaled by 1/sqrt(2 * layers)
    assert abs(big.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.001
    assert abs(big.blocks[0].attn.proj.weight.std().item() - 0.02 / 8**0.5) < 0.001
    assert big.blocks[0].attn.qkv.bias.abs().max().item() == 0


class BareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.layer = nn.Linear(3, 3)


def test_a_sharded_run_refuses_a_tensor_nothing_draws_naming_it():
    with pytest.raises(ConfigError, match=r"nothing draws \['scale'\].*reset_parameters"):
        check_initialisable(BareParameter(), TrainConfig(strategy="fsdp"))
    check_initialisable(BareParameter(), TrainConfig(strategy="ddp"))  # built whole: fine


class UndrawnBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

    def reset_parameters(self) -> None:  # draws nothing of its own: the mask is left
        pass


def test_a_tensor_no_rule_writes_keeps_its_value_and_a_rank_building_its_part_refuses_it():
    whole = UndrawnBuffer()
    drawn = initialise(whole, seed=0)
    assert drawn.undrawn == ["mask"]
    assert torch.equal(whole.mask, torch.tril(torch.ones(3, 3)))  # the constructor's
    with torch.device("meta"):
        meta = UndrawnBuffer()
    with pytest.raises(ConfigError, match=r"nothing draws \['mask'\]"):
        materialise_held(meta, {"mask", "layer.weight", "layer.bias"}, torch.device("cpu"), 0)


def test_a_stored_tensor_reads_a_part_of_its_rows_transposed_or_not(tmp_path):
    path = str(tmp_path / "model.safetensors")
    weight = torch.arange(24.0).reshape(4, 6)
    save_file({"w": weight, "scale": torch.tensor(2.5)}, path)
    stored = Stored(path, "w")
    assert Stored(path, "scale").read().item() == 2.5  # a 0-dim tensor whole
    assert torch.equal(stored.read(range(1, 3)), weight[1:3])
    assert torch.equal(stored.read(), weight)
    # A GPT-2 Conv1D weight is stored [in, out]: the module's rows are the file's columns.
    assert torch.equal(stored.t().read(range(2, 5)), weight.t()[2:5])
