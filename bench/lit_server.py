"""B5c's other side: the same artifact on LitServe, its dynamic batching on.

    python -m bench.lit_server --artifact URI --port P [--max-batch-size 16] [--batch-timeout 0.005]

The request is the v2 JSON body the Serve side gets (one BYTES tensor of text, or FP32 rows),
read with the project's own validation (app.runtime.rows) and preprocessor, and run in the
artifact's int8 ONNX Runtime session: only the serving framework differs.
"""

from __future__ import annotations

import argparse
from typing import Any

import litserve as ls
import numpy as np


class ArtifactAPI(ls.LitAPI):
    def __init__(self, artifact_uri: str, max_batch_size: int, batch_timeout: float):
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout)
        self.artifact_uri = artifact_uri

    def setup(self, device: str) -> None:
        from app.runtime.artifact import open_artifact

        self.artifact = open_artifact(self.artifact_uri)
        self.session = self.artifact.session("int8", 1)
        self.pre = self.artifact.preprocessor

    def decode_request(self, request):  # type: ignore[no-untyped-def]  # untyped: LitServe reads the JSON body
        from app.runtime.rows import request_rows
        from app.runtime.types import InferRequest, Tensor

        t = request["inputs"][0]
        tensor = Tensor(t["name"], t["datatype"], t["shape"], t["data"])
        return self.pre.features(
            request_rows(InferRequest(tensor=tensor), self.artifact.schema, 1024)
        )

    def batch(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return inputs  # predict concatenates (rows per request may differ)

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[tuple[list[str], Any]]:
        from app.runtime.artifact import run_logits
        from app.runtime.rows import softmax

        batch = {k: np.concatenate([r[k] for r in inputs]) for k in inputs[0]}
        probabilities = softmax(run_logits(self.session, batch))
        labels = np.asarray(self.pre.labels, dtype=object)[probabilities.argmax(1)].tolist()
        out, start = [], 0
        for r in inputs:
            n = len(next(iter(r.values())))
            out.append((labels[start : start + n], probabilities[start : start + n].tolist()))
            start += n
        return out

    def unbatch(self, output: list[Any]) -> list[Any]:
        return output

    def encode_response(self, output: tuple[list[str], Any]) -> dict[str, Any]:
        labels, probabilities = output
        return {"labels": labels, "probabilities": probabilities}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-timeout", type=float, default=0.005)
    args = p.parse_args(argv)
    api = ArtifactAPI(args.artifact, args.max_batch_size, args.batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1)
    server.run(
        host="127.0.0.1",
        port=args.port,
        num_api_servers=1,
        log_level="warning",
        generate_client_file=False,
    )


if __name__ == "__main__":
    main()
