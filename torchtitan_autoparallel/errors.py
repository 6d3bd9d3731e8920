"""User-facing errors: printed as one line by the launcher, with no traceback unless
``AUTOPARALLEL_TRACEBACK=1`` asks for one (to see where a message came from)."""

import os
import traceback

TRACEBACK_ENV = "AUTOPARALLEL_TRACEBACK"


def print_traceback_if_asked() -> None:
    """Inside an ``except``: print the error's traceback when ``AUTOPARALLEL_TRACEBACK=1``."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exc()


class UserError(Exception):
    """Bad input from the user; the message names the bad value and what is accepted."""


class ConfigError(UserError, ValueError):
    pass


class TrainingDiverged(UserError):
    """The loss or gradient norm stopped being finite: the run cannot go on usefully.
    Reported as bad input is (one line, exit status 2): the fix is in the settings."""
