"""Export: the best checkpoint -> a verified ONNX fp32 + int8 artifact, or nothing at all.
Owns the ONNX export of each task, quantization, the accuracy/perplexity gate, and the
artifact format (manifest, checksums) that serving and batch inference load.
"""
