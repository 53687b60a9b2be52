"""The stages composed: jobs.prepare (the data layer with the model families' pretrained
folders handed down) and jobs.pipeline (prepare -> ... -> a sample request), stages.py."""
