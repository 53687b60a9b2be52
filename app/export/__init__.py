"""Export: the best checkpoint -> a verified ONNX fp32 + int8 artifact, or nothing at all.
The stage (exporter.py: the checkpoint's task exports it, app/tasks/<task>/export.py) and what
every task's export builds on: quantization, compiled programs, measurements and publishing;
the artifact it writes is read and run by app/runtime, which the gate runs too.
"""
