"""Export: the best checkpoint -> a verified ONNX fp32 + int8 artifact, or nothing at all.
Owns the ONNX export of each task, quantization, the accuracy/perplexity gate, publishing, the
artifact format (manifest, checksums) that serving and batch inference load, and the decode loop
over an exported LM graph (generate.py), which the gate and the LM replica both run.
"""
