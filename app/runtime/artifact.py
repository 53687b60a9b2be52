"""The artifact: what export writes and the only thing serving loads.

    <artifact>/manifest.json      name, version, sha256 of every other file, versions, lineage
    <artifact>/model.onnx         fp32 (a graph over export.external_data_bytes: its weights in
                                  model.onnx.data beside it)
    <artifact>/model.int8.onnx    int8 (onnxruntime quantization)
    <artifact>/model.pt2 ...      programs compiled ahead of time, when `export.formats` asks
                                  (app/runtime/programs.py)
    <artifact>/preprocessor.json  the fitted preprocessor
    <artifact>/schema.json        input/output tensors and label names
    <artifact>/report.json        parity, accuracy, size and latency of each variant
    <artifact>/quantization.png   the same comparison as a picture (for people; serving ignores it)

Opening an artifact verifies every sha256 before anything is parsed, refuses missing, altered or
truncated files by name, never unpickles, and refuses an ONNX external-data reference to any file
but a verified one of the artifact: a graph's external weights come from memory, never from a
path ONNX Runtime would open.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from app import storage
from app.data import kinds
from app.data.preprocess import Preprocessor
from app.errors import ArtifactError
from app.runtime import programs as prg

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
VARIANTS = {"fp32": ".onnx", "int8": ".int8.onnx"}  # variant -> file suffix of each graph
MODEL = "model"  # the graph of a single-graph artifact; schema.json's `graphs` names others


def graph_file(graph: str, variant: str) -> str:
    return f"{graph}{VARIANTS[variant]}"


MODEL_FILES = {v: graph_file(MODEL, v) for v in VARIANTS}
REQUIRED_FILES = ("preprocessor.json", "schema.json", "report.json")
QUANTIZATION_PNG = "quantization.png"  # hashed in the manifest like every file, not required
LATEST = "latest"  # a pointer file in <registry>/<name>/ holding the latest good version


# --- the artifact manifest: written by export (write_metadata, publish), read by serving -------
# It lives here, not in app/export/exporter.py, so that serving reads it without importing torch.


class ArtifactFile(storage.Contract):
    sha256: str
    size: int = Field(ge=0)


class ArtifactManifest(storage.Contract):
    """`<artifact>/manifest.json`: the artifact's identity, lineage and the hash of every file."""

    error = ArtifactError
    name: str
    version: str | None = None  # None until publish claims a number
    files: dict[str, ArtifactFile]  # relative path -> sha256 and size, every file but this one
    # Lineage, for people and /v1/models; serving needs none of it.
    created: str | None = None
    source_checkpoint: str | None = None
    # The pretrained folder fine-tuned (model.pretrained): uri, model_type, weights_sha256, license.
    base_model: dict[str, Any] | None = None
    run_name: str | None = None
    train_metrics: dict[str, float | int] = {}
    workload: str | None = None
    quantization: dict[str, Any] = {}  # method, weight type, nodes kept in fp32
    opset: int | None = None
    versions: dict[str, str] = {}  # library -> version that built the artifact
    programs: dict[str, prg.ProgramInfo] = {}  # file -> what built it, for what machine


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def resolve(uri: str) -> str:
    """An artifact version folder, or `<registry>/<name>/latest` -> the version it points at."""
    uri = uri.rstrip("/")
    if storage.exists(storage.join(uri, MANIFEST)):
        return uri
    if os.path.basename(uri) == LATEST and storage.is_file(uri):
        version = storage.read_bytes(uri).decode(errors="replace").strip()
        if not version.isdigit():  # never a path: the pointer names a version folder
            raise ArtifactError(f"{uri}: holds {version[:40]!r}, not a version number")
        return storage.join(uri.rsplit("/", 1)[0], version)
    if not storage.exists(uri):
        raise ArtifactError(f"{uri}: no such artifact")
    raise ArtifactError(f"{uri}: {MANIFEST} is missing")


def versions(folder: str) -> list[int]:
    """Version numbers under `<registry>/<name>/`, claimed or complete, ascending."""
    return sorted(int(v) for v in storage.list_dir(folder) if v.isdigit())


def newest_complete_version(folder: str) -> int:
    """The highest version of `<registry>/<name>/` that has its manifest (0 when none): a version
    counts only once its manifest, written last, is there."""
    for version in reversed(versions(folder)):
        if storage.exists(storage.join(folder, str(version), MANIFEST)):
            return version
    return 0


def verify_files(folder: str, manifest: ArtifactManifest) -> dict[str, bytes]:
    """Read every listed file once, check its sha256 and size; return the verified bytes."""
    verified: dict[str, bytes] = {}
    for rel, expected in sorted(manifest.files.items()):
        path = os.path.normpath(os.path.join(folder, rel))
        if os.path.dirname(os.path.relpath(path, folder)).startswith(".."):
            raise ArtifactError(f"{rel}: path leaves the artifact folder")
        if not os.path.isfile(path):
            raise ArtifactError(f"{rel}: missing from {folder}")
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != expected.size:
            raise ArtifactError(
                f"{rel}: size {len(data)} != {expected.size} in the manifest (truncated or altered)"
            )
        if sha256_bytes(data) != expected.sha256:
            raise ArtifactError(f"{rel}: sha256 mismatch (altered)")
        verified[rel] = data
    return verified


@dataclass(frozen=True)
class Graph:
    """A verified ONNX graph: its bytes, and the tensors it keeps in external data, each as
    (verified file, offset, length)."""

    model: bytes
    external: dict[str, tuple[bytes, int, int]]

    def external_values(self) -> tuple[list[str], list[np.ndarray]]:
        """The external tensors as arrays over the verified bytes (no copy)."""
        import onnx

        names, values = [], []
        proto = onnx.load_model_from_string(self.model)
        for tensor in all_tensors(proto):
            if tensor.name in self.external:
                data, offset, length = self.external[tensor.name]
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
                flat = np.frombuffer(data, dtype, length // dtype.itemsize, offset)
                names.append(tensor.name)
                values.append(flat.reshape(tuple(tensor.dims)))
        return names, values


def local_graph(path: str) -> Graph:
    """A graph file on local disk (export's work folder) with its external data, if any."""
    folder, name = os.path.split(path)
    files = {}
    for f in (name, name + ".data"):
        if os.path.isfile(os.path.join(folder, f)):
            with open(os.path.join(folder, f), "rb") as opened:
                files[f] = opened.read()
    return graph_of(name, files)


def graph_of(name: str, files: dict[str, bytes]) -> Graph:
    """A graph and its external tensors, each of which must lie in a verified file of the
    artifact: initializers, sparse initializers and tensor attributes (Constant), in the main
    graph, in every subgraph (If/Loop/Scan bodies, nested to any depth) and in model functions.
    A tensor pointing anywhere else is refused."""
    import onnx

    model = onnx.load_model_from_string(files[name])
    external: dict[str, tuple[bytes, int, int]] = {}
    for tensor in all_tensors(model):
        if not (tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.external_data)):
            continue
        where = {e.key: e.value for e in tensor.external_data}
        location = os.path.normpath(where.get("location", ""))
        if location not in files or location in REQUIRED_FILES or location == name:
            raise ArtifactError(
                f"{name}: tensor {tensor.name!r} refers to external data "
                f"{where.get('location', '')!r}, which is not a verified file of the artifact"
            )
        offset, length = int(where.get("offset", 0)), int(where.get("length", -1))
        if length < 0 or offset + length > len(files[location]):
            raise ArtifactError(f"{name}: tensor {tensor.name!r} lies outside {location}")
        external[tensor.name] = (files[location], offset, length)
    return Graph(files[name], external)


def all_tensors(model) -> Iterator[Any]:
    """Every TensorProto a model holds, wherever it sits."""
    training = [g for info in model.training_info for g in (info.initialization, info.algorithm)]
    for graph in [model.graph, *training]:
        yield from _graph_tensors(graph)
    for function in model.functions:
        yield from _nodes_tensors(function.node)


def _graph_tensors(graph) -> Iterator[Any]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _nodes_tensors(graph.node)


def _nodes_tensors(nodes) -> Iterator[Any]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            sparse = list(attr.sparse_tensors)
            if attr.HasField("sparse_tensor"):
                sparse.append(attr.sparse_tensor)
            for s in sparse:
                yield from (s.values, s.indices)
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for graph in attr.graphs:
                yield from _graph_tensors(graph)


def read_manifest(folder: str, origin: str | None = None) -> ArtifactManifest:
    """The manifest of the local artifact folder `folder` (a copy of `origin`, when given)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise ArtifactError(f"{MANIFEST}: missing from {origin or folder}")
    with open(path, "rb") as f:
        raw = f.read()
    return ArtifactManifest.parse_json(raw, storage.join(origin or folder, MANIFEST))


@dataclass
class Artifact:
    uri: str
    manifest: ArtifactManifest
    schema: dict[str, Any]
    report: dict[str, Any]
    preprocessor: Preprocessor
    graphs: dict[str, dict[str, Graph]]  # graph -> variant -> verified ONNX graph
    programs: dict[str, bytes]  # file -> verified bytes of each compiled program

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return str(self.manifest.version)

    @property
    def models(self) -> dict[str, Graph]:
        """The variants of a single-graph artifact (every graph has the same variants)."""
        return self.graphs.get(MODEL) or next(iter(self.graphs.values()))

    def servable(self) -> list[str]:
        """The variants a replica or predict actor can run from this artifact."""
        compiled = all(prg.program_file(g, "aoti") in self.programs for g in self.graphs)
        return [*self.models, *(["aoti"] if compiled else [])]

    def choose_variant(self, requested: str) -> str:
        """`serve.variant` for this artifact in this process. `auto`: of the servable variants
        this process can run, the one export measured fastest at its `serve.batching.
        max_batch_size` rows (report `serving`); int8 where export measured none (language
        models, retrieval encoders)."""
        servable = self.servable()
        if requested == "auto":
            measured = self.report.get("serving", {}).get("rows_per_s", {})
            runnable = [v for v in measured if v in servable and self.refusal(v) is None]
            return max(runnable, key=measured.__getitem__) if runnable else "int8"
        if requested not in servable:
            raise ArtifactError(
                f"variant {requested!r} (serve.variant / predict.variant): {self.uri} has "
                f"{servable}; a classifier or retrieval model exported with "
                "export.formats=[onnx,aoti] has aoti"
            )
        if why := self.refusal(requested):
            raise ArtifactError(f"variant {requested!r}: {why}; re-export on this machine")
        return requested

    def refusal(self, variant: str) -> str | None:
        """Why this process cannot run `variant` (native code built for another machine)."""
        if variant in VARIANTS:
            return None
        names = [prg.program_file(g, variant) for g in self.graphs]
        return next((w for n in names if (w := prg.refusal(n, self.manifest.programs[n]))), None)

    def session(self, variant: str, threads: int = 1, graph: str = MODEL):
        variant = self.choose_variant(variant)  # refuses what this process cannot run
        if variant in VARIANTS:
            return create_session(self.graphs[graph][variant], threads)
        program = self.programs[prg.program_file(graph, variant)]
        return prg.aoti_session(program, self.inputs(graph), threads)

    def inputs(self, graph: str = MODEL) -> list[prg.InputInfo]:
        """A graph's inputs as ONNX Runtime names them (text: a free sequence axis)."""
        if graph != MODEL:  # an encoder: its inputs in schema.json
            return [prg.InputInfo(n, ["batch", -1]) for n in self.schema["graphs"][graph]["inputs"]]
        shape = ["batch", "sequence" if self.preprocessor.variable_length else -1]
        return [prg.InputInfo(name, shape) for name in self.preprocessor.input_names()]


def open_verified(uri: str) -> tuple[str, ArtifactManifest, dict[str, bytes]]:
    """A published version (a folder or a `latest` pointer): its URI, manifest and files, every
    file's sha256 checked. Models and vector indexes alike."""
    uri = resolve(uri)
    with tempfile.TemporaryDirectory() as tmp:
        folder = storage.download_dir(uri, tmp)
        manifest = read_manifest(folder, origin=uri)
        files = verify_files(folder, manifest)
    if manifest.version is None:
        raise ArtifactError(f"{storage.join(uri, MANIFEST)}: version: not set (never published)")
    return uri, manifest, files


def open_artifact(uri: str) -> Artifact:
    uri, manifest, files = open_verified(uri)
    for name in REQUIRED_FILES:
        if name not in files:
            raise ArtifactError(f"{name}: not listed in the manifest of {uri}")
    schema = json.loads(files["schema.json"])
    graphs: dict[str, dict[str, Graph]] = {}
    for graph in schema.get("graphs") or [MODEL]:
        for variant in VARIANTS:
            name = graph_file(graph, variant)
            if name not in files:
                raise ArtifactError(f"{name}: not listed in the manifest of {uri}")
            graphs.setdefault(graph, {})[variant] = graph_of(name, files)
    for name in manifest.programs:
        if name not in files:
            raise ArtifactError(f"{name}: in the manifest's programs, not in its files ({uri})")
    return Artifact(
        uri=uri,
        manifest=manifest,
        schema=schema,
        report=json.loads(files["report.json"]),
        preprocessor=kinds.from_json(files["preprocessor.json"].decode()),
        graphs=graphs,
        programs={name: files[name] for name in manifest.programs},
    )


def verify(uri: str) -> dict[str, Any]:
    """`jobs.export --verify`: the integrity check alone."""
    artifact = open_artifact(uri)
    return {
        "stage": "verify",
        "artifact": artifact.uri,
        "ok": True,
        "files": sorted(artifact.manifest.files),
    }


# --- ONNX Runtime sessions -------------------------------------------------------------------


def providers() -> list[str]:
    """CUDA when a GPU is really usable, else CPU (onnxruntime-gpu lists CUDA even without one)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available and _gpu_present():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _gpu_present() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def create_session(model: bytes | Graph, threads: int = 1):
    """An ONNX Runtime session of a graph (its bytes, or a verified Graph whose external
    weights are handed over from memory)."""
    import onnxruntime as ort

    graph = model if isinstance(model, Graph) else Graph(model, {})

    def options() -> Any:
        o = ort.SessionOptions()
        o.intra_op_num_threads = max(1, threads)
        o.inter_op_num_threads = 1
        o.log_severity_level = 3
        if graph.external:
            names, values = graph.external_values()
            o.add_external_initializers(
                names, [ort.OrtValue.ortvalue_from_numpy(v) for v in values]
            )
        return o

    try:
        return ort.InferenceSession(graph.model, options(), providers=providers())
    except Exception as e:  # noqa: BLE001 - a broken CUDA setup must not stop a CPU replica
        if providers() == ["CPUExecutionProvider"]:
            raise
        log.warning("CUDA session failed (%s); falling back to CPU", e)
        return ort.InferenceSession(graph.model, options(), providers=["CPUExecutionProvider"])


LOGITS = ["logits"]  # a classifier graph's output, the one a replica or predictor fetches


def run_logits(session, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return session.run(LOGITS, inputs)[0]
