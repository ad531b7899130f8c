"""The one exception type whose message is meant for the user: it says what went wrong and what to do."""


class UserFacingError(Exception):
    """Raised where a problem is detected; the CLI prints it on one line, the UI shows it as is."""
