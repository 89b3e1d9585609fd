"""The one error type of checkpointing."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved, found or read; the message is one line."""
