"""Documents: a text corpus for language modelling (`text_files`), one document a row and no
labels. Never fitted or served: the task that trains on it prepares it into tokens
(app/data/corpus.py)."""

from __future__ import annotations

from app.data.preprocess import Preprocessor


class Documents(Preprocessor):
    kind = "documents"
    labelled = False
