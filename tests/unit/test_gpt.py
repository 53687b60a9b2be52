"""app/models/gpt.py: shapes, causality, the KV-cache path, tied head, GPT-2 small's size."""

from __future__ import annotations

import pytest
import torch

from app.config import ModelConfig
from app.data.kinds.tokens import Tokens
from app.data.preprocess import Preprocessor
from app.data.text_files import train_tokenizer
from app.errors import ConfigError
from app.models import build_model
from app.models.gpt import GPT

pytestmark = pytest.mark.unit

VOCAB, BLOCK = 97, 16


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, block_size=BLOCK, dim=32, layers=2, heads=4, dropout=0.0).eval()


def ids(batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def test_logits_for_every_position(model):
    assert model(ids(3, 10)).shape == (3, 10, VOCAB)


@torch.no_grad()
def test_a_future_token_never_changes_earlier_logits(model):
    before = ids(2, 12)
    after = before.clone()
    after[:, 7] = (after[:, 7] + 1) % VOCAB
    a, b = model(before), model(after)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])  # the changed token and later do see it


@torch.no_grad()
def test_decoding_with_the_cache_matches_the_full_forward(model):
    tokens = ids(2, 9)
    full = model(tokens)
    # A 4-token prompt, then one token at a time, then a 2-token chunk on a cache.
    logits, past = model.decode(tokens[:, :4])
    steps = [logits]
    for t in range(4, 7):
        logits, past = model.decode(tokens[:, t : t + 1], past)
        steps.append(logits)
    logits, past = model.decode(tokens[:, 7:9], past)
    steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert past[0][0].shape == (2, 4, 9, 8)  # [batch, heads, cached tokens, head_dim]


def test_longer_than_the_block_size_is_refused(model):
    with pytest.raises(ValueError, match="exceeds the block size 16"):
        model(ids(1, BLOCK + 1))


def test_head_is_tied_and_blocks_are_one_module_list(model):
    assert model.head.weight is model.tokens.weight
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


def test_gpt2_small_builds_with_124m_parameters():
    # The same code at GPT-2 small's sizes, on the meta device (no memory): 124,439,808
    # parameters, the tied head counted once (GPT-2's published 124M).
    with torch.device("meta"):
        gpt2 = GPT(50257, block_size=1024, dim=768, layers=12, heads=12, dropout=0.1)
    assert sum(p.numel() for p in gpt2.parameters()) == 124_439_808


def token_pre(block_size: int) -> Preprocessor:
    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 3, vocab_size=300)
    manifest = {"feature_columns": ["input_ids"], "label_column": "", "block_size": block_size}
    return Tokens.adopt(manifest, tokenizer.to_str())


def test_registry_builds_gpt_from_config_and_the_datasets_tokenizer():
    pre = token_pre(block_size=16)
    cfg = ModelConfig(name="gpt", dim=32, layers=1, heads=2, ff_dim=64, max_length=16)
    model = build_model(cfg, pre)
    assert isinstance(model, GPT)
    assert model.tokens.num_embeddings == pre.vocab_size  # the tokenizer's, not model.vocab_size


def test_sequences_longer_than_the_position_table_are_refused():
    cfg = ModelConfig(name="gpt", dim=32, layers=1, heads=2, ff_dim=64, max_length=8)
    with pytest.raises(ConfigError, match="model.max_length: 8 is shorter"):
        build_model(cfg, token_pre(block_size=16))
