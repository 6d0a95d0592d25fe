"""The server's adapters apart from the pipeline: the registry (`registry`), each tier's LRU
policy (`cache`) and the shapes check against the model's layer table (`validation`); none of
them imports torch."""
