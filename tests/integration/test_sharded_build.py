"""No sharded rank holds the whole model (plain torch.distributed on 2 gloo ranks, the functions a
Ray Train worker runs): under FSDP and pipeline stages the model is built on the meta device and
each rank allocates only its part (the bytes its tensors hold are counted against its rows of
each tensor, or its stages), no allocation during the build is larger than the largest single
module, and the weights gathered tensor by tensor equal a single-process build of the same
seed, the tied embedding included. From a GPT-2 folder and a Llama-style one (Qwen2: grouped
keys and values, rotary buffers, a tied head) each rank reads only its part of each tensor (the
bytes read are counted), from one file or a sharded folder's several, and ends with the
folder's weights. A sharded rank gives the buffers it frees back to the OS."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file, save_model
from torch.utils._python_dispatch import TorchDispatchMode

from app.config import ModelConfig, TrainConfig
from app.models import load_folder
from app.models.families import family_of
from app.models.gpt import GPT
from app.models.init import initialise, tied_names
from app.models.llama import DecoderArgs, LlamaLM
from app.models.vit import ViTClassifier
from app.pretrained import open_pretrained
from app.tasks.lm.train import token_loss
from app.train import parallel
from app.train.consolidate import write_consolidated
from app.train.materialise import held_bytes, load_parts
from app.train.pipelining import Scoring
from tests.gloo_ranks import leave_together
from tools.make_tiny_pretrained import make_decoder, make_gpt2

pytestmark = pytest.mark.integration
SEED, WORLD = 7, 2
LLAMA = DecoderArgs(
    vocab_size=61, dim=32, layers=4, heads=4, kv_heads=2, head_dim=8, ff_dim=48,
    max_positions=16, qk_norm=True, tied=True,
)  # fmt: skip
FAMILIES = {
    "gpt": lambda: GPT(vocab_size=61, block_size=16, dim=32, layers=4, heads=2),
    "llama": lambda: LlamaLM(LLAMA),
    "vit": lambda: ViTClassifier(
        3, image_size=8, patch_size=4, channels=3, dim=32, layers=4, heads=2, ff_dim=64
    ),  # fmt: skip
}
STRATEGIES = {
    "fsdp": {"strategy": "fsdp", "seed": SEED},
    "pipeline": {"strategy": "pipeline", "seed": SEED, "num_workers": WORLD,
                 "pipeline": {"stages": WORLD, "schedule": "1f1b", "microbatches": 2}},
}  # fmt: skip
SCORING = Scoring(lambda batch: (batch, batch["input_ids"]), token_loss)  # not run here


class Allocations(TorchDispatchMode):
    """The bytes of every tensor allocated off the meta device, one entry an allocation."""

    FACTORIES = {"empty", "empty_strided", "empty_like", "zeros", "ones", "full", "new_empty",
                 "new_empty_strided", "new_zeros", "clone", "_to_copy", "cat"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ in self.FACTORIES and isinstance(out, torch.Tensor):
            local = out.to_local() if hasattr(out, "to_local") else out
            if not local.is_meta:
                self.sizes.append(local.numel() * local.element_size())
        return out


def whole_bytes(model: torch.nn.Module) -> int:
    """Parameters (a tied one once) and buffers (rotary frequencies: FSDP keeps them whole)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def buffer_bytes(model: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


def held_buffer_bytes(model: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers() if not b.is_meta)


def largest_module_bytes(model: torch.nn.Module) -> int:
    return max(
        sum(t.numel() * t.element_size() for t in m.parameters(recurse=False))
        for m in model.modules()
    )


def shard_bytes(model: torch.nn.Module, rank: int) -> int:
    """This rank's rows of every tensor, split as torch.chunk splits them (FSDP2's shards)."""
    total = 0
    for p in model.parameters():
        rows = p.shape[0]
        size = -(-rows // WORLD)
        mine = max(0, min(size, rows - rank * size))
        total += mine * (p.numel() // rows) * p.element_size()
    return total


def sharded(build, strategy: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = build()
    t = TrainConfig(**STRATEGIES[strategy])
    return parallel.parallelize(model, t, torch.device("cpu"), SCORING)


def check_build(family: str, strategy: str, rank: int, folder: str) -> None:
    case = f"{family} {strategy} rank {rank}"
    whole = FAMILIES[family]()
    with Allocations() as allocations:
        model = sharded(FAMILIES[family], strategy)
    held = held_bytes(model)
    if strategy == "fsdp":  # its rows of each parameter, every (small, derived) buffer whole
        assert held == shard_bytes(whole, rank) + buffer_bytes(whole), case
    else:  # each rank its stages; a tied tensor on both ends of the pipeline
        tied = sum(t.numel() * t.element_size() for t in _tied(whole))
        total = torch.tensor([held])
        dist.all_reduce(total)
        assert held < whole_bytes(whole) and total.item() == whole_bytes(whole) + tied, case
    assert max(allocations.sizes) <= largest_module_bytes(whole), case
    path = os.path.join(folder, f"{family}-{strategy}.safetensors")
    write_consolidated(path if rank == 0 else None, model)
    if rank == 0:
        expected = load_file(os.path.join(folder, f"{family}.safetensors"))
        got = load_file(path)
        assert got.keys() == expected.keys(), case
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{case}: {name}"


def _tied(model: torch.nn.Module) -> list[torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    return [named[group[0]] for group in tied_names(model) if len(group) > 1]


def folder_model(base) -> torch.nn.Module:
    """The module of a folder's family, built as a run builds it (its weights not loaded)."""
    pre = types.SimpleNamespace(state={"pretrained": base.record()})
    return family_of(base).build(base.config, pre, ModelConfig())


def check_pretrained(strategy: str, name: str, rank: int, folder: str) -> None:
    case = f"{name} folder {strategy} rank {rank}"
    base = open_pretrained(os.path.join(folder, name))
    pre = types.SimpleNamespace(state={"pretrained": base.record()})

    def build() -> torch.nn.Module:
        return folder_model(base)

    with torch.device("meta"):
        ties = tied_names(build())
    model = sharded(build, strategy)
    read = load_parts(model, pre, ties)
    # Every tensor comes from the folder (but the rotary frequencies, which its module draws): a
    # rank reads exactly what it holds, a part of it.
    held = held_bytes(model)
    assert read + held_buffer_bytes(model) == held < whole_bytes(build()), (case, read)
    path = os.path.join(folder, f"{name}-{strategy}.safetensors")
    write_consolidated(path if rank == 0 else None, model)
    if rank == 0:
        expected = load_file(os.path.join(folder, f"{name.split('-')[0]}-whole.safetensors"))
        got = load_file(path)
        assert got.keys() == expected.keys(), case
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{case}: {name}"


def split_weights(folder, to) -> None:
    """The folder again with its weights in two files and their index, as `save_pretrained`
    writes a checkpoint over its `max_shard_size`."""
    shutil.copytree(folder, to, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    files = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in files.items():
        save_file({n: state[n] for n in part}, str(to / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in files.items() for n in part}
    (to / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def rank_main(rank: int, init: str, folder: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    for family in FAMILIES:
        for strategy in STRATEGIES:
            check_build(family, strategy, rank, folder)
            dist.barrier()
    for strategy in STRATEGIES:
        for name in ("gpt2", "qwen2"):
            check_pretrained(strategy, name, rank, folder)
            dist.barrier()
    check_pretrained("fsdp", "gpt2-sharded", rank, folder)
    dist.barrier()
    leave_together()


def test_sharded_ranks_materialise_and_read_only_their_part(tmp_path):
    """The single-process references are written first: each family built whole with the same
    seed, and the GPT-2 folder loaded whole."""
    for family, build in FAMILIES.items():
        model = build()
        initialise(model, SEED)
        save_model(model, str(tmp_path / f"{family}.safetensors"))
    made = {"gpt2": make_gpt2(str(tmp_path / "gpt2"))}
    made["qwen2"] = make_decoder(str(tmp_path / "qwen2"), "qwen2")
    for name, made_folder in made.items():
        base = open_pretrained(made_folder)
        whole = folder_model(base)
        load_folder(whole, base.record(), "")
        save_model(whole, str(tmp_path / f"{name}-whole.safetensors"))
    split_weights(tmp_path / "gpt2", tmp_path / "gpt2-sharded")
    os.environ.pop("MASTER_ADDR", None)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(rank_main, args=(init, str(tmp_path)), nprocs=WORLD, join=True)


HOLES = """
import sys, torch
from app.train.materialise import return_freed_buffers
if sys.argv[1] == "fixed":
    assert return_freed_buffers()
def rss():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS"))
    return int(line.split()[1]) * 1024
big = torch.ones(24 * 2**20 // 4)
del big  # a large buffer freed: glibc raises its mmap threshold past 8 MiB
chunks = [torch.ones(8 * 2**20 // 4) for _ in range(32)]
before = rss()
del chunks[::2]  # 128 MiB freed between buffers still held: holes the heap cannot trim
print(before - rss())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_sharded_rank_gives_freed_buffers_back_to_the_os():
    def returned(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", HOLES, mode], capture_output=True, text=True, check=True
        )
        return int(run.stdout.strip())

    assert returned("dynamic") < 32 * 2**20  # glibc's default: the holes stay in the process
    assert returned("fixed") >= 120 * 2**20  # return_freed_buffers: each goes back when freed
