"""Errors raised while reading a model directory: each names the file or field at fault."""


class ModelLoadError(Exception):
    """A model directory, config field, weight file or tokenizer that cannot be used."""
