"""User-facing errors: printed as one line by the launcher, never as a traceback."""


class UserError(Exception):
    """Bad input from the user; the message names the bad value and what is accepted."""


class ConfigError(UserError, ValueError):
    pass


class TrainingDiverged(UserError):
    """The loss or gradient norm stopped being finite: the run cannot go on usefully.
    Reported as bad input is (one line, exit status 2): the fix is in the settings."""
