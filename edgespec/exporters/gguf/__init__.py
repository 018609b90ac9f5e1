"""GGUF in and out: source.py, tokenizer.py and pretokenizers.py read a GGUF as a source,
transcode.py turns it into an edgespec graph, export.py and bundles.py write GGUF bundles."""
