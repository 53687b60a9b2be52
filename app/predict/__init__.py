"""Predict: offline batch inference with an exported artifact, published like every other stage.

    --input (Parquet | CSV | JSONL file, or a folder of one of them)          read.py
      -> Ray Data read (only the id column and the artifact's feature or text columns)
      -> map_batches(Predictor) in an autoscaling actor pool (1 .. predict.max_actors);   actor.py
         per batch: check rows (row_checks.py) -> the artifact's preprocessor -> ONNX Runtime
      -> each batch's actor writes its Parquet parts under <output>/_run-<id>/ (id, label,
         probabilities, model_name, model_version; rejects/: id, reason, row)       write.py
      -> the driver tallies the parts' records and writes manifest.json LAST       driver.py

Columns are matched by name to the artifact's `schema.json` (`feature_columns`; for text its one
column). A column missing from a whole file fails the job at once, naming it. A malformed row
(null or missing value, not a number, NaN or infinity, undecodable or invalid text, bad JSON
line) is a bad row: `predict.on_bad_rows=fail` stops the job naming the first ones (exit 1,
nothing published), `reject` writes each with its reason to `rejects/`. Every input row ends in
exactly one of the two outputs; the summary asserts output + rejected == input rows.
"""
