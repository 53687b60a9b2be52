"""Write tiny random-weight Hugging Face folders, one per supported family, as `save_pretrained`
does: `python -m tools.make_tiny_pretrained OUT_DIR` -> OUT_DIR/{gpt2,bert,vit,clip,llama,
mistral,qwen2,qwen3}.

They stand in for downloaded checkpoints where the hub is out of reach (the test suite, CI):
same files, same tensor names, small sizes, and for the decoders a tokenizer of the family's
kind (byte-level BPE with Llama 3's or Qwen's special tokens, byte-fallback BPE as Mistral's),
its chat template and generation_config.json. Needs `transformers` (a dev dependency).
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import sysconfig
from collections.abc import Callable
from typing import Any

DECODERS = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = ("gpt2", "bert", "vit", "clip", *DECODERS)


def stdlib_files(n: int = 40) -> list[str]:
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:n]


def gpt2_tokenizer(vocab_size: int = 384):
    """Byte-level BPE with GPT-2's end-of-text token, trained on some standard-library files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    files = stdlib_files()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    return GPT2TokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def bert_tokenizer(vocab_size: int = 400):
    """Lower-cased WordPiece trained on the generated topic text that configs/bert-text.yaml uses."""
    from tokenizers.implementations import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    from app.config import DataConfig
    from app.data.sources import MAKERS

    cfg = DataConfig(source="synthetic_text", num_rows=600)
    texts = [t for rows, _ in MAKERS[cfg.source](cfg).rows(cfg) for t in rows["text"]]
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(iter(texts), vocab_size=vocab_size, show_progress=False)
    return BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=True)


TINY_GPT2 = {"n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 2}
# A chat template in the shape instruction-tuned models ship (roles marked, turns ended by the
# end-of-text token), so serving renders chat messages with the folder's own template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] | upper + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### ASSISTANT\n' }}{% endif %}"
)


def make_gpt2(folder: str, seed: int = 0, sizes: dict | None = None, vocab: int = 384) -> str:
    """`sizes`: GPT2Config keys (default tiny; `{}` is GPT-2 small: 124M parameters with the
    50257-row embedding, whatever the tokenizer's own `vocab`)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    tokenizer = gpt2_tokenizer(vocab)
    eos = tokenizer.eos_token_id
    sizes = TINY_GPT2 if sizes is None else sizes
    config = GPT2Config(
        **({"vocab_size": len(tokenizer)} if sizes is TINY_GPT2 else {}),
        **sizes,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def make_bert(folder: str, seed: int = 0, pooler: bool = True, width: int = 32) -> str:
    """`width`: hidden size (the feed-forward layer twice that)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    tokenizer = bert_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=128,
    )
    BertModel(config, add_pooling_layer=pooler).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_vit(folder: str, seed: int = 0, pooler: bool = True) -> str:
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    ViTModel(config, add_pooling_layer=pooler).save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def clip_tokenizer(vocab_size: int = 300):
    """Byte-level BPE with CLIP's start- and end-of-text tokens around every text, trained on the
    captions of the generated scenes (configs/retrieval.yaml)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import CLIPTokenizerFast

    from app.config import DataConfig
    from app.data.pictures import synthetic

    cfg = DataConfig(source="synthetic_image_text", num_rows=200, image_size=8)
    captions = [c for rows, _ in synthetic(cfg) for c in rows["caption"]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    start, end = "<|startoftext|>", "<|endoftext|>"
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[start, end],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(captions), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{start} $A {end}",
        special_tokens=[(start, tokenizer.token_to_id(start)), (end, tokenizer.token_to_id(end))],
    )
    return CLIPTokenizerFast(
        tokenizer_object=tokenizer, bos_token=start, eos_token=end, pad_token=end, unk_token=end
    )


def make_clip(folder: str, seed: int = 0) -> str:
    """A tiny CLIP: two 2-layer towers (width 32), 32x32 pictures in 8x8 patches, projections
    to 24; its processor resizes the shortest edge to 32 and crops the centre, as CLIP's."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(seed)
    tokenizer = clip_tokenizer()
    tower = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={
            **tower,
            "intermediate_size": 64,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 48,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**tower, "intermediate_size": 64, "image_size": 32, "patch_size": 8},
        projection_dim=24,
    )
    CLIPModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(folder)
    return folder


# --- Llama-style decoders ------------------------------------------------------------------------

TINY_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 256,
}
# Chat templates in the shapes these families ship (simplified, same roles and turn markers).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer(
    specials: list[str],
    vocab_size: int = 384,
    bos: str | None = None,
    texts: list[str] | None = None,
):
    """Byte-level BPE (Llama 3's and Qwen's kind) with these special tokens, trained on `texts`
    (default: some standard-library files); `bos` is put before every text it encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        tokenizer.train(stdlib_files(), trainer)
    else:
        tokenizer.train_from_iterator(texts, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer


def byte_fallback_tokenizer(vocab_size: int = 384):
    """BPE over sentencepiece-style pieces (`▁` a space) with byte fallback, Mistral's and Llama
    2's kind: a character outside the vocabulary is its UTF-8 bytes as `<0xNN>` tokens. `<s>`
    before every text."""
    import json

    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials)
    trainer.show_progress = False
    trained.train(stdlib_files(), trainer)
    # The vocabulary as Llama 2's: the specials, the 256 byte tokens, then the learned pieces.
    vocab = {t: i for i, t in enumerate(specials)}
    vocab |= {f"<0x{b:02X}>": len(specials) + b for b in range(256)}
    for token, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = [
        (m.split(" ")[0], m.split(" ")[1]) if isinstance(m, str) else (m[0], m[1])
        for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return tokenizer


# model_type -> (tokenizer, bos, eos, end ids for generation_config.json, chat template, config)
def decoder_recipe(
    model_type: str, vocab: int, texts: list[str] | None = None
) -> tuple[Any, str | None, str, list[str], str, dict]:
    if model_type == "llama":
        tokenizer = byte_level_tokenizer(LLAMA3_SPECIALS, vocab, "<|begin_of_text|>", texts)
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope["original_max_position_embeddings"] = 64
        ends = ["<|end_of_text|>", "<|eot_id|>"]
        return (
            tokenizer,
            "<|begin_of_text|>",
            "<|eot_id|>",
            ends,
            LLAMA3_TEMPLATE,
            {"rope_parameters": rope},
        )
    if model_type == "mistral":
        tokenizer = byte_fallback_tokenizer(vocab)
        return tokenizer, "<s>", "</s>", ["</s>"], MISTRAL_TEMPLATE, {"sliding_window": None}
    tokenizer = byte_level_tokenizer(QWEN_SPECIALS, vocab, texts=texts)
    ends = ["<|im_end|>", "<|endoftext|>"]
    if model_type == "qwen2":  # Qwen2.5's small models tie their head to the embedding
        extra: dict = {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6}}
    else:  # Qwen3: per-head q/k norms, a head_dim apart from hidden / heads
        extra = {"head_dim": 16, "rope_parameters": {"rope_theta": 1e6}}
    return tokenizer, None, "<|im_end|>", ends, CHATML_TEMPLATE, extra


def make_decoder(
    folder: str,
    model_type: str,
    seed: int = 0,
    sizes: dict | None = None,
    vocab: int = 384,
    legacy_rope: bool = False,
    texts: list[str] | None = None,
    **config: Any,
) -> str:
    """A Llama-style decoder's folder (`model_type` llama, mistral, qwen2 or qwen3), its norms'
    weights drawn around 1 (transformers starts them at exactly 1, which would hide a norm
    applied twice or not at all). `sizes` and `config`: config.json keys over the tiny
    defaults; `texts`: what a byte-level tokenizer is trained on (default: some standard-library
    files); `legacy_rope`: config.json rewritten in the spelling most downloaded folders
    carry (`rope_theta` and `rope_scaling` instead of transformers 5's `rope_parameters`)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationConfig,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(seed)
    tok, bos, eos, ends, template, extra = decoder_recipe(model_type, vocab, texts)
    unk = "<unk>" if model_type == "mistral" else None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=unk
    )
    settings = {**TINY_DECODER, **(sizes or {}), **extra, **config}
    ids = {"bos_token_id": tok.token_to_id(bos)} if bos else {}
    ends_ids = {"eos_token_id": tok.token_to_id(eos)}
    settings.setdefault("vocab_size", tok.get_vocab_size())  # more rows than tokens: allowed
    arch = AutoConfig.for_model(model_type, **settings, **ids, **ends_ids)
    model = AutoModelForCausalLM.from_config(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    GenerationConfig(eos_token_id=[tok.token_to_id(t) for t in ends], **ids).save_pretrained(folder)
    if legacy_rope:
        rewrite_rope_legacy(folder)
    return folder


def rewrite_rope_legacy(folder: str) -> None:
    """config.json's rotary settings as transformers 4 wrote them: `rope_theta`, and the scaling
    (when not the default) in `rope_scaling`."""
    import json

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


MAKERS: dict[str, Callable[..., str]] = {
    "gpt2": make_gpt2,
    "bert": make_bert,
    "vit": make_vit,
    "clip": make_clip,
    **{t: functools.partial(make_decoder, model_type=t) for t in DECODERS},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    args = parser.parse_args()
    for name in args.families:
        print(MAKERS[name](os.path.join(args.out_dir, name)))


if __name__ == "__main__":
    main()
