"""The predict actor: a piece of the input read, scored and written in one process, so a row
never crosses Ray's object store; only the piece's record of what was written goes back."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from app.predict.actor import Scorer
from app.predict.read import read_piece
from app.predict.row_checks import InputSpec
from app.predict.write import Destination, PieceOutput, Written, records_table


class PieceWorker:
    """A Ray Data callable class: the task's scorer (one ONNX Runtime session or decode loop)
    built once per actor, then every piece it is handed read `batch_size` rows at a time."""

    def __init__(
        self,
        scorer: Scorer,
        scorer_args: tuple[str, str, int, InputSpec],
        fs: Any,
        batch_size: int,
        to: Destination,
    ):
        self.score = scorer(*scorer_args)
        self.spec = scorer_args[3]
        self.fs, self.batch_size, self.to = fs, batch_size, to

    def __call__(self, pieces: pa.Table) -> pa.Table:
        return records_table([self.run(piece) for piece in pieces.to_pylist()])

    def run(self, piece: dict[str, Any]) -> Written:
        out = PieceOutput(self.to, piece["index"])
        for batch in read_piece(piece, self.spec, self.fs, self.batch_size):
            if not out.add(self.score(batch)):
                break
        return out.close()
