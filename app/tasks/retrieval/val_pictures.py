"""The val pictures of a prepared image-text dataset as a corpus to embed and index: one row per
picture: `id` its image_id, its bytes and its first caption (metadata) under the model's
image and caption column names. The
pipeline indexes it after deploying a retrieval model, so that the deployed search finds the
pictures of captions it has never trained on."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.config import Config
from app.data.ingest import iter_shards
from app.data.kinds.image_text import IMAGE_ID
from app.data.prepare import read_manifest, split_files


def val_pictures(config: Config, folder: str) -> str:
    """Write the corpus under `folder`; its URI."""
    output = config.data_output
    manifest = read_manifest(output)
    image, caption = manifest.feature_columns[:2]
    seen: set[str] = set()
    rows: dict[str, list] = {"id": [], image: [], caption: []}
    for frame in iter_shards(split_files(output, manifest, "val")):
        for picture, text, image_id in zip(
            frame[image], frame[caption], frame[IMAGE_ID], strict=True
        ):
            if str(image_id) in seen:
                continue
            seen.add(str(image_id))
            rows["id"].append(str(image_id))
            rows[image].append(bytes(picture))
            rows[caption].append(str(text))
    table = pa.table(
        {
            "id": pa.array(rows["id"], pa.string()),
            image: pa.array(rows[image], pa.binary()),
            caption: pa.array(rows[caption], pa.string()),
        }
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    uri = storage.join(folder, "pictures.parquet")
    storage.write_bytes(uri, buffer.getvalue())
    return uri
