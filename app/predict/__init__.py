"""Predict: offline batch inference with an exported artifact, published like every other stage.

    --input (Parquet | CSV | JSONL file, or a folder of one of them)          read.py
      -> Ray Data read (only the id column and the artifact's feature or text columns)
      -> map_batches(Predictor) in an autoscaling actor pool (1 .. predict.max_actors);   actor.py
         per batch: check rows (row_checks.py) -> the artifact's preprocessor -> ONNX Runtime
      -> the driver writes <output>/part-*.parquet (id, label, probabilities, model_name,
         model_version), rejects/part-*.parquet (id, reason, row) and manifest.json LAST  write.py
    driver.py runs the stage and tallies good and bad rows.

Columns are matched by name to the artifact's `schema.json` (`feature_columns`; for text its one
column). A column missing from a whole file fails the job at once, naming it. A malformed row
(null or missing value, not a number, NaN or infinity, undecodable or invalid text, bad JSON
line) is a bad row: `predict.on_bad_rows=fail` stops the job naming the first ones (exit 1,
nothing published), `reject` writes each with its reason to `rejects/`. Every input row ends in
exactly one of the two outputs; the summary asserts output + rejected == input rows.
"""
