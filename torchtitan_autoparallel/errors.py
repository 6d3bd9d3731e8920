"""User-facing errors: printed as one line by the launcher, never as a traceback."""


class UserError(Exception):
    """Bad input from the user; the message names the bad value and what is accepted."""


class ConfigError(UserError, ValueError):
    pass
