"""The one exception every checkpoint problem raises."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (or written); the message says why and how to fix it."""
