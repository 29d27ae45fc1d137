"""The project's own errors: the CLI turns each into one message and an exit code."""

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
# 128 + the signal number, as shells report a process ended by SIGINT (Ctrl-C) or SIGTERM.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class MlengError(Exception):
    """An error with a message for the user and what to do about it."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  what to do: {self.hint}"


class UsageError(MlengError):
    """Bad arguments or input: exit 2."""


class StoreError(MlengError):
    """The results store cannot be used (corrupt, foreign, newer schema): exit 2."""


class NotAvailableError(MlengError):
    """A device, library or tool the command needs is not there: exit 2."""


class CheckFailed(MlengError):
    """A check ran and found a problem: exit 1."""

    exit_code = EXIT_PROBLEM
