"""Export: the best checkpoint -> a verified ONNX fp32 + int8 artifact, or nothing at all.
Owns the ONNX export of each task, quantization, the accuracy/perplexity gate and publishing;
the artifact it writes is read and run by app/runtime, which the gate runs too.
"""
