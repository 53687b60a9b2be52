"""Write tiny random-weight Hugging Face folders, one per supported family, as `save_pretrained`
does: `python -m tests.make_tiny_pretrained OUT_DIR` -> OUT_DIR/{gpt2,bert,vit,clip}.

They stand in for downloaded checkpoints where the hub is out of reach (the test suite, CI):
same files, same tensor names, small sizes. Needs `transformers` (a dev dependency).
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig

FAMILIES = ("gpt2", "bert", "vit", "clip")


def gpt2_tokenizer(vocab_size: int = 384):
    """Byte-level BPE with GPT-2's end-of-text token, trained on some standard-library files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
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
    wordpiece.train_from_iterator(list(texts), vocab_size=vocab_size, show_progress=False)
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


MAKERS = {"gpt2": make_gpt2, "bert": make_bert, "vit": make_vit, "clip": make_clip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    args = parser.parse_args()
    for name in args.families:
        print(MAKERS[name](os.path.join(args.out_dir, name)))


if __name__ == "__main__":
    main()
