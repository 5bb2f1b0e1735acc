"""Errors of the model runtime: a model directory that cannot be used (naming the file
or field at fault), and a sequence the loaded model cannot run (naming the limit)."""


class ModelLoadError(Exception):
    """A model directory, config field, weight file or tokenizer that cannot be used."""


class SequenceTooLongError(ValueError):
    """A sequence reaches past the positions the model was built for (`max_positions`)."""
