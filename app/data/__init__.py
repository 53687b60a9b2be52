"""Data: raw sources -> published Parquet shards (prepare), the fitted preprocessor, and what a
training worker iterates (the ingest plan, memory and streamed feeds, the LM token corpus).
Nothing here imports Ray Train; Ray Data is imported only where a split is streamed.
"""
