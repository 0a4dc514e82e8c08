"""User-facing errors: each one becomes a single line on stderr (the CLI shows a traceback only with --verbose)."""


class BuildError(Exception):
    """Base class for every error the builder reports to the user."""


class InputError(BuildError):
    """The model folder or hub id cannot be used (missing, unreadable, wrong model type)."""


class UnsupportedModelError(InputError):
    """The checkpoint is not a Phi-4-multimodal checkpoint."""


class CheckpointError(InputError):
    """The weights are missing, truncated, or do not match the config."""


class RoutingError(CheckpointError):
    """A tensor matches no route, or a route expects a tensor the checkpoint does not have."""


class OutputError(BuildError):
    """The output folder cannot be written as asked."""


class SpecMismatchError(BuildError):
    """A built graph does not match the I/O spec its component declares."""


class DecoderBuildError(BuildError):
    """The decoder cannot be built with the requested options."""
