"""The exceptions the command line turns into an exit status: mistakes a user can fix (config, data, paths, reward
code), and a run stopped by a signal. Only the standard library: the command line catches them before any heavy import."""

import signal


class UserError(Exception):
    """A problem in the user's input. The CLI prints its message, without a traceback, and exits 2."""

    def before_exit(self) -> None:
        """What the CLI does after printing the message, before it exits (`parallel.EveryProcessStops`: wait for the others)."""


class TrainingInterrupted(BaseException):
    """The run stopped on SIGINT/SIGTERM. `checkpoint` is the checkpoint to resume from.

    A BaseException, like KeyboardInterrupt: raised from the signal handler wherever the main
    thread is (inside a reward function, say), it must not be taken for that code's own failure
    by an `except Exception`.
    """

    def __init__(self, signum: int, update: int, checkpoint, abandoned: bool = False):
        name = signal.Signals(signum).name
        if abandoned:
            where = f"the last complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
            message = f"{name} received twice: abandoned update {update + 1}; {where}"
        else:
            message = f"{name}: stopped after update {update}; checkpoint written to {checkpoint}"
        super().__init__(message)
        self.signal_name = name
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        self.checkpoint = checkpoint
        self.abandoned = abandoned
