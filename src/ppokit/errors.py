"""The one exception type for mistakes a user can fix (config, data, paths, reward code)."""


class UserError(Exception):
    """A problem in the user's input. The CLI prints its message, without a traceback, and exits 2."""

    def before_exit(self) -> None:
        """What the CLI does after printing the message, before it exits (`parallel.EveryProcessStops`: wait for the others)."""
