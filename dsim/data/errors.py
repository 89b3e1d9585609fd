"""The one error of the data package."""


class DatasetError(ValueError):
    """Bad dataset input (path, file contents or batch sizes); the message is one line."""
