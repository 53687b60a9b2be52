"""A pretrained Hugging Face folder (`model.pretrained`): architecture, weights, preprocessing and
provenance, read without transformers.

The folder is what `save_pretrained` writes (or a hub cache snapshot, whose files are symlinks):
`config.json`, `model.safetensors` or shards listed in `model.safetensors.index.json`, and the
tokenizer (`tokenizer.json`, or a BERT `vocab.txt`) or image processor
(`preprocessor_config.json`). Its `model_type` picks a family (app/models/families.py: the plain
`torch.nn` module that takes the weights and the renaming of them). Nothing from the folder is
executed (no remote code) and nothing is unpickled: weights are safetensors only.

The run keeps a `record()` of the folder (URI, architecture, weights' sha256, license) inside its
preprocessor, so checkpoints and artifacts rebuild the model without the folder and name their base.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

from app import storage
from app.config import resolve_uri
from app.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
TOKENIZER, VOCAB = "tokenizer.json", "vocab.txt"
TOKENIZER_CONFIG, IMAGE_PROCESSOR = "tokenizer_config.json", "preprocessor_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
CACHE_ENV = "RAYTORCH_PRETRAINED_CACHE"  # where remote folders are downloaded (default ~/.cache)


class Pretrained:
    """An opened, checked folder. Opening reads only `config.json` and lists files."""

    def __init__(self, uri: str):
        self.uri = uri
        self.local = local_folder(uri)
        self.config = self._read_config()
        self.weight_files = self._weight_files()

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    def fail(self, what: str) -> ConfigError:
        return ConfigError(f"config error: model.pretrained: {self.uri}: {what}")

    def _path(self, name: str) -> str:
        return os.path.join(self.local, name)

    def _read(self, name: str) -> str:
        with open(self._path(name), encoding="utf-8") as f:
            return f.read()

    def has(self, name: str) -> bool:
        return os.path.isfile(self._path(name))  # follows a snapshot's symlinks

    def _read_config(self) -> dict[str, Any]:
        if not self.has(CONFIG):
            raise self.fail(f"missing {CONFIG} (expected a folder written by save_pretrained)")
        try:
            config = json.loads(self._read(CONFIG))
        except (OSError, ValueError) as e:
            raise self.fail(f"{CONFIG} unreadable ({e})") from None
        if not isinstance(config, dict):
            raise self.fail(f"{CONFIG} is not a JSON object")
        return config

    def _weight_files(self) -> list[str]:
        if self.has(WEIGHTS):
            return [WEIGHTS]
        if self.has(INDEX):
            try:
                index = json.loads(self._read(INDEX))
                files = sorted(set(index["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise self.fail(f"{INDEX} unreadable ({e})") from None
            missing = [f for f in files if not self.has(f)]
            if missing:
                raise self.fail(f"missing weight shard {missing[0]} listed in {INDEX}")
            return files
        pickled = [name for name in PICKLED if self.has(name)]
        if pickled:
            raise self.fail(
                f"holds only pickled weights ({pickled[0]}), which are never unpickled: save it as "
                "safetensors (model.save_pretrained(folder, safe_serialization=True))"
            )
        raise self.fail(f"missing {WEIGHTS} (or {INDEX} and its shards)")

    # --- what the run takes from the folder ------------------------------------------------

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the checkpoint computes exactly (None: images): its position
        table, or a shorter sliding attention window (which no family here implements)."""
        text = self.config.get("text_config") or {}  # CLIP's text tower
        value = self.config.get("max_position_embeddings", self.config.get("n_positions"))
        value = value or (text.get("max_position_embeddings") if isinstance(text, dict) else None)
        if not value:
            return None
        window = attention_window(self.config)
        return min(int(value), window) if window else int(value)

    def tokenizer_json(self) -> str:
        """The tokenizer as `tokenizers` serialises it: tokenizer.json as written, or a BERT
        WordPiece tokenizer built from vocab.txt the way transformers builds its fast one."""
        if self.has(TOKENIZER):
            return self._read(TOKENIZER)
        from tokenizers.implementations import BertWordPieceTokenizer

        lower = bool(self.tokenizer_config().get("do_lower_case", True))
        tokenizer = BertWordPieceTokenizer(self._path(VOCAB), lowercase=lower)
        return tokenizer._tokenizer.to_str()

    def tokenizer_config(self) -> dict[str, Any]:
        if not self.has(TOKENIZER_CONFIG):
            return {}
        try:
            config = json.loads(self._read(TOKENIZER_CONFIG))
        except (OSError, ValueError) as e:
            raise self.fail(
                f"{TOKENIZER_CONFIG} unreadable ({str(e).splitlines()[0][:80]})"
            ) from None
        if not isinstance(config, dict):
            raise self.fail(f"{TOKENIZER_CONFIG} is not a JSON object")
        return config

    def tokenizer_size(self) -> int:
        """Token ids the tokenizer can produce (its largest id + 1), read without building it
        from vocab.txt; a tokenizer.json that does not parse is one line naming it."""
        if not self.has(TOKENIZER):
            with open(self._path(VOCAB), encoding="utf-8") as f:
                return sum(1 for _ in f)
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_str(self._read(TOKENIZER))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own kinds; one line
            raise self.fail(f"{TOKENIZER} unreadable ({str(e).splitlines()[0][:80]})") from None
        return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def chat_template(self) -> str | None:
        """The tokenizer's chat template: `chat_template.jinja`, or tokenizer_config.json's
        `chat_template` (a string, or named templates of which "default" is used); compiled
        and rendered once here, so a broken one fails when the folder is read, not in serving."""
        from app.chat_template import TemplateRefused, check_template

        source = CHAT_TEMPLATE
        if self.has(CHAT_TEMPLATE):
            template: Any = self._read(CHAT_TEMPLATE)
        else:
            source = f"{TOKENIZER_CONFIG}'s chat_template"
            template = self.tokenizer_config().get("chat_template")
            if isinstance(template, list):
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
        if not (isinstance(template, str) and template):
            return None
        try:
            check_template(template, self.special_tokens())
        except TemplateRefused as e:
            raise self.fail(f"{source}: {e}") from None
        return template

    def special_tokens(self) -> dict[str, str]:
        """`bos_token` and `eos_token` as chat templates read them."""
        config = self.tokenizer_config()
        out = {}
        for name in ("bos_token", "eos_token"):
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                out[name] = token
        return out

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json ({} without one)."""
        if not self.has(GENERATION_CONFIG):
            return {}
        try:
            config = json.loads(self._read(GENERATION_CONFIG))
        except (OSError, ValueError) as e:
            raise self.fail(f"{GENERATION_CONFIG} unreadable ({e})") from None
        if not isinstance(config, dict):
            raise self.fail(f"{GENERATION_CONFIG} is not a JSON object")
        return config

    def end_ids(self) -> list[int]:
        """Every id that ends a generation: generation_config.json's `eos_token_id` (one or a
        list), config.json's, and the tokenizer's `eos_token`, in that order, each once."""
        ids: list[int] = []
        for value in (
            self.generation_config().get("eos_token_id"),
            self.config.get("eos_token_id"),
        ):
            values = value if isinstance(value, list) else [value]
            ids += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        eos = self.special_tokens().get("eos_token")
        token = self.token_id(eos) if eos else None
        if token is not None:
            ids.append(token)
        return list(dict.fromkeys(ids))

    def end_of_text(self) -> int | None:
        """The token that separates documents of a corpus: the tokenizer's `eos_token`, else the
        first end id (None: the folder names none)."""
        eos = self.special_tokens().get("eos_token")
        token = self.token_id(eos) if eos else None
        if token is not None:
            return token
        ends = self.end_ids()
        return ends[0] if ends else None

    def token_id(self, token: str) -> int | None:
        from tokenizers import Tokenizer

        if not self.has(TOKENIZER):
            return None
        return Tokenizer.from_str(self.tokenizer_json()).token_to_id(token)

    def pad_token(self) -> str:
        token = self.tokenizer_config().get("pad_token") or "[PAD]"
        return token["content"] if isinstance(token, dict) else str(token)

    def image_processor(self) -> dict[str, Any]:
        return json.loads(self._read(IMAGE_PROCESSOR))

    def weights(self) -> dict[str, Any]:
        """Every tensor of the folder, by its name there (torch tensors, never unpickled)."""
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for name in self.weight_files:
            state.update(load_file(self._path(name)))
        return state

    def stored(self) -> dict[str, Stored]:
        """Every tensor of the folder by its name there, unread (read a part with `Stored.read`)."""
        return {
            tensor: Stored(self._path(name), tensor)
            for name in self.weight_files
            for tensor in safetensors_shapes(self._path(name), self.fail)
        }

    def tensor_names(self) -> list[str]:
        return list(self.tensor_shapes())

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape from the safetensors headers alone (nothing loaded), each
        header checked against its file: a tensor's bytes must lie inside it and match its
        dtype and shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name in self.weight_files:
            shapes |= safetensors_shapes(self._path(name), self.fail)
        return shapes

    def weights_sha256(self) -> str:
        digest = hashlib.sha256()
        for name in self.weight_files:
            with open(self._path(name), "rb") as f:
                while chunk := f.read(storage.CHUNK):
                    digest.update(chunk)
        return digest.hexdigest()

    def license(self) -> str | None:
        """The model card's `license:` (README.md front matter), or config.json's, if any."""
        if self.config.get("license"):
            return str(self.config["license"])
        if not self.has("README.md"):
            return None
        match = re.search(r"^license:\s*(\S+)", self._read("README.md"), re.M)
        return match.group(1) if match else None

    def record(self) -> dict[str, Any]:
        """What checkpoints and artifacts keep of the folder (`load_record` rebuilds from it)."""
        return {
            "uri": self.uri,
            "model_type": self.model_type,
            "architecture": self.config,
            "weights_sha256": self.weights_sha256(),
            "license": self.license(),
            # The classifier head sits on the pooler when the folder has one (app/models/bert.py).
            "has_pooler": any(".pooler." in f".{n}" for n in self.tensor_names()),
        }


def attention_window(config: dict[str, Any]) -> int | None:
    """The sliding attention window a config.json turns on for some layers (None: every layer
    attends to every earlier token): Mistral's `sliding_window`; Qwen's, when
    `use_sliding_window` is set and a layer is of the sliding type (`layer_types`, or those from
    `max_window_layers` on)."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if "use_sliding_window" not in config:  # Mistral's spelling: the window is on when set
        return window if config.get("model_type") == "mistral" else None
    if not config.get("use_sliding_window"):
        return None
    layers = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)
    ]
    return window if "sliding_attention" in types else None


@dataclasses.dataclass(frozen=True)
class Stored:
    """A tensor of a safetensors file, not read: the file, its name there, and whether the
    module takes it transposed (`t()` and `contiguous()` let a family's renaming, written for
    tensors, map these too)."""

    path: str
    name: str
    transposed: bool = False

    def t(self) -> Stored:
        return dataclasses.replace(self, transposed=not self.transposed)

    def contiguous(self) -> Stored:
        return self

    def read(self, rows: range | None = None) -> Any:
        """The tensor as the module takes it, or only its `rows` (dimension 0 of the module's
        tensor): a slice of the file (`get_slice`), never the whole file."""
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            part = f.get_slice(self.name)
            if rows is None:
                tensor = part[...]  # `[:]` cannot take a 0-dim tensor (a temperature)
            elif self.transposed:
                tensor = part[:, rows.start : rows.stop]
            else:
                tensor = part[rows.start : rows.stop]
        return tensor.t().contiguous() if self.transposed else tensor


@functools.lru_cache(maxsize=4)
def open_pretrained(uri: str) -> Pretrained:
    return Pretrained(resolve_uri(uri))


def local_folder(uri: str) -> str:
    """A local folder holding the files: the folder itself, or a download of a remote one."""
    if storage.is_local(uri):
        path = uri.removeprefix("file://")
        if not os.path.isdir(path):
            raise ConfigError(f"config error: model.pretrained: {uri}: no such folder")
        return path
    return download_folder(uri.rstrip("/"))


def read_by_project(name: str) -> bool:
    """The files of a folder this module reads (weights, configs, tokenizer, card)."""
    return name in READ or name.endswith(".safetensors")


READ = {
    CONFIG, INDEX, TOKENIZER, VOCAB, TOKENIZER_CONFIG, IMAGE_PROCESSOR, CHAT_TEMPLATE,
    GENERATION_CONFIG, "README.md",
}  # fmt: skip


def download_folder(uri: str) -> str:
    """The files of a remote folder the project reads, downloaded once per machine.

    Cached under a key of the URI and the remote listing (names, sizes, modification times),
    so a folder uploaded again at the same URI is fetched again; processes that miss together
    take one lock per key and all but the first find the copy done. A copy is filled under a
    temporary name and renamed whole; a failed one is removed (and one a killed process left
    is removed by the next that takes the lock)."""
    import fcntl

    listing = storage.list_files(uri)
    if not any(name == CONFIG for name, _, _ in listing):
        raise ConfigError(f"config error: model.pretrained: {uri}: missing {CONFIG}")
    wanted = [entry for entry in listing if read_by_project(entry[0])]
    key = hashlib.sha256(json.dumps([uri, wanted]).encode()).hexdigest()[:16]
    root = os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/raytorch/pretrained")
    dest = os.path.join(root, key)
    os.makedirs(os.path.join(root, ".locks"), exist_ok=True)
    with open(os.path.join(root, ".locks", key), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(dest):
            return dest
        for stale in os.listdir(root):
            if stale.startswith(f".download-{key}-"):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=f".download-{key}-")
        try:
            fetch(uri, [name for name, _, _ in wanted], tmp)
            # Pickled weights are never read, only named in the refusal: an empty stand-in.
            for name, _, _ in listing:
                if name in PICKLED:
                    open(os.path.join(tmp, name), "w").close()
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("model.pretrained: %s downloaded to %s (%d files)", uri, dest, len(wanted))
    return dest


def fetch(uri: str, names: list[str], local: str) -> None:
    for name in names:
        target = os.path.join(local, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        storage.download_file(storage.join(uri, name), target)


SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit


def safetensors_shapes(path: str, fail: Any) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of one safetensors file, from its header (8 bytes of length, then
    JSON); `fail(what)` makes the error for a header that lies about the file."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise fail(f"{name}: not a safetensors file (its header length does not fit it)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise fail(f"{name}: its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise fail(f"{name}: its safetensors header is not a JSON object")
    data = size - 8 - length
    return {
        tensor: _tensor_shape(tensor, entry, data, lambda what: fail(f"{name}: {what}"))
        for tensor, entry in header.items()
        if tensor != "__metadata__"
    }


def _tensor_shape(tensor: str, entry: Any, data: int, fail: Any) -> tuple[int, ...]:
    """A header entry's shape, once its dtype, shape and byte range agree with the file."""
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise fail(f"tensor {tensor!r}: no known dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
    ):
        raise fail(f"tensor {tensor!r}: shape {str(shape)[:40]} is not a list of sizes")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data
    ):
        raise fail(f"tensor {tensor!r}: its bytes lie outside the file")
    count = 1
    for d in shape:
        count *= d
    if offsets[1] - offsets[0] != count * SAFETENSORS_DTYPES[entry["dtype"]]:
        raise fail(f"tensor {tensor!r}: {offsets[1] - offsets[0]} bytes do not hold shape {shape}")
    return tuple(shape)
